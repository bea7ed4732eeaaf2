"""JSON rows of a post-training corpus (``--objective sft`` conversations, ``--objective dpo`` pairs): a
``.jsonl`` file or a directory of them (sorted, recursively), one row per non-blank line, read in order
(docs/post-training.md). Each row is named ``FILE:LINE`` in errors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from loongtrain.data.corpus import corpus_files, decode_text


def row_files(spec: str, what: str) -> list[Path]:
    """The ``.jsonl`` files of ``spec``; ValueError naming ``spec`` for a plain-text corpus (``.txt`` files,
    ``stdlib``, a dataset) or a path that holds none. ``what``: the objective (it "reads" rows), for the
    message."""
    if spec == "stdlib":
        raise ValueError(f"corpus 'stdlib' is plain text; {what} reads .jsonl rows (plain text trains with "
                         f"--objective pretrain)")
    kind, files = corpus_files(spec)
    text = [f for f in files if f.suffix != ".jsonl"]
    if kind != "files" or text:
        example = str(text[0]) if text else spec
        raise ValueError(f"corpus {spec!r} holds plain text ({example}); {what} reads .jsonl rows (plain text "
                         f"trains with --objective pretrain)")
    return files


def read_rows(spec: str, what: str, decode_errors: str = "strict") -> Iterator[tuple[str, Any]]:
    """``(where, row)`` of every non-blank line of the corpus's files, ``where`` = ``FILE:LINE``; ValueError
    naming it for invalid JSON."""
    for path in row_files(spec, what):
        offset = 0
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                line = decode_text(raw, path, decode_errors, offset)
                offset += len(raw)
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    yield where, json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{where}: invalid JSON ({exc.msg})") from None
