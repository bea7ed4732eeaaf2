"""Rows of a post-training corpus (``--objective sft`` conversations and prompt-completion rows,
``--objective dpo`` pairs; docs/post-training.md#rows): a ``.jsonl`` file or a directory of them (sorted,
recursively), one row per non-blank line, read in order, or a saved Hugging Face dataset (its ``train`` split),
one row per record. Each row is named ``FILE:LINE`` (``DATASET[i]``) in errors; a dataset's rows have the
``None`` values Arrow adds removed (:func:`loongtrain.data.messages.without_none`)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from loongtrain.data.corpus import corpus_files, decode_text, load_hf_dataset
from loongtrain.data.messages import without_none


def row_files(spec: str, what: str) -> tuple[str, list[Path]]:
    """``(kind, files)`` of ``spec``: ``"files"`` and its ``.jsonl`` files, or ``"dataset"`` (a saved Hugging
    Face dataset); ValueError naming ``spec`` for a plain-text corpus (``.txt`` files, ``stdlib``) or a path
    that holds none. ``what``: the objective (it "reads" rows), for the message."""
    if spec == "stdlib":
        raise ValueError(f"corpus 'stdlib' is plain text; {what} reads .jsonl rows (plain text trains with "
                         f"--objective pretrain)")
    kind, files = corpus_files(spec)
    if kind == "dataset":
        return kind, files
    text = [f for f in files if f.suffix != ".jsonl"]
    if kind != "files" or text:
        example = str(text[0]) if text else spec
        raise ValueError(f"corpus {spec!r} holds plain text ({example}); {what} reads .jsonl rows or a saved "
                         f"dataset (plain text trains with --objective pretrain)")
    return kind, files


def read_rows(spec: str, what: str, decode_errors: str = "strict") -> Iterator[tuple[str, Any]]:
    """``(where, row)`` of every row of the corpus (module docstring); ValueError naming ``FILE:LINE`` for
    invalid JSON."""
    kind, files = row_files(spec, what)
    if kind == "dataset":
        for i, row in enumerate(load_hf_dataset(Path(spec))):
            yield f"{spec}[{i}]", without_none(row)
        return
    for path in files:
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
