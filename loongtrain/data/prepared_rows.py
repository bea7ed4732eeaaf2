"""Post-training corpora prepared once (``loongtrain prepare --objective sft|dpo``; docs/post-training.md): the
rows of a corpus encoded by the run's :class:`RowEncoder` into token shards, read back memory-mapped.

- ``sft``: a document per row (a conversation or a prompt-completion row); beside each token shard
  ``tokens-K.bin``, ``targets-K.bin`` (one byte per token: 1 = target);
- ``dpo``: three documents per pair (the prompt, the chosen completion and its EOS, the rejected one and its
  EOS: TRL's tokenization, :mod:`loongtrain.data.preference`); no target file (the completions are the
  targets).

The manifest records ``"objective"`` and the chat format that made the tokens (``"chat"``: its identity, target
rule and ``--loss-on``; DPO without a template: none), and a run refuses a prepared corpus of another objective
or chat format. Shards are cut between rows, so a pair never spans two.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loongtrain._files import write_bytes
from loongtrain.data.chat import ChatFormat
from loongtrain.data.corpus import Corpus
from loongtrain.data.messages import content_text
from loongtrain.data.prepared import (
    MANIFEST,
    SHARD_DIR,
    buffer_digests,
    document_index,
    sampled_digest,
    verify_prepared,
)
from loongtrain.data.rows import read_rows
from loongtrain.data.tokenizer import Tokenizer
from loongtrain.data.whole_packing import EncodedDocs

Encoded = list[tuple[np.ndarray, "np.ndarray | None"]]


class RowEncoder:
    """How an objective turns one row into documents (``sft``: one, with its target marks; ``dpo``: three,
    without): ``prepared_for`` (the objective's name), ``tokenizer``, ``chat`` (None: no template), ``documents``
    per row."""

    prepared_for: str
    tokenizer: Tokenizer
    chat: ChatFormat | None
    documents: int

    def check(self, row: Any, where: str) -> None:
        """ValueError naming ``where`` for a row of another form (cheap: nothing is rendered)."""
        raise NotImplementedError

    def encode(self, row: Any, where: str) -> Encoded:
        """The row's documents ``[(ids, targets or None), ...]``."""
        raise NotImplementedError

    def record(self) -> dict[str, Any]:
        """What a prepared corpus's manifest records of the encoding (a run compares it)."""
        chat = None if self.chat is None else {"identity": self.chat.identity(), "rule": self.chat.rule,
                                               "loss_on": self.chat.loss_on}
        return {"objective": self.prepared_for, "chat": chat}


@dataclass(frozen=True)
class PreparedRow:
    """One checked row of a prepare, as read; its length is its texts' characters (what shards are cut by)."""

    where: str
    row: dict[str, Any]

    def __len__(self) -> int:
        return sum(_chars(self.row.get(field)) for field in ("messages", "prompt", "completion", "chosen", "rejected"))


def _chars(value: Any) -> int:
    if isinstance(value, str):
        return len(value)
    return sum(len(content_text(m)) for m in value if isinstance(m, dict)) if isinstance(value, list) else 0


class PreparedRows(Corpus):
    """The rows of a corpus as :class:`PreparedRow`, each checked by ``encoder`` before it joins a shard."""

    def __init__(self, spec: str, encoder: RowEncoder, decode_errors: str = "strict") -> None:
        self.name, self.encoder, self.decode_errors = spec, encoder, decode_errors

    def __iter__(self) -> Iterator[PreparedRow]:  # type: ignore[override]
        for where, row in read_rows(self.name, f"--objective {self.encoder.prepared_for}", self.decode_errors):
            self.encoder.check(row, where)
            yield PreparedRow(where, row)


def tokenize_rows_shard(task: tuple[int, list[PreparedRow], str, str, int],
                        encoder: RowEncoder) -> tuple[int, dict[str, Any], np.ndarray, int]:
    """``loongtrain prepare --objective sft|dpo``'s worker: encode one shard's rows, keep the documents of at
    least ``min_doc_tokens`` tokens (sft), write ``tokens-<k>.bin`` (and ``targets-<k>.bin``); return its
    record (as :func:`loongtrain.data.prepare`'s text shards do)."""
    k, rows, tmp, dtype, min_doc_tokens = task
    encoded = [doc for r in rows for doc in encoder.encode(r.row, r.where)]
    kept = [d for d in encoded if d[0].size >= min_doc_tokens]
    lengths = np.fromiter((ids.size for ids, _ in kept), dtype=np.int64, count=len(kept))
    tokens = np.concatenate([ids for ids, _ in kept]).astype(np.dtype(dtype)) if kept else np.empty(0, dtype)
    name = f"tokens-{k:05d}.bin"
    write_bytes(Path(tmp) / name, memoryview(tokens).cast("B"))
    record = {"file": name, "num_tokens": int(tokens.size), "num_documents": len(kept),
              **({"dropped_documents": len(encoded) - len(kept)} if min_doc_tokens else {}), **buffer_digests(tokens)}
    if encoder.documents == 1:
        targets = np.concatenate([t for _, t in kept]).astype(np.uint8) if kept else np.empty(0, np.uint8)
        targets_name = f"targets-{k:05d}.bin"
        write_bytes(Path(tmp) / targets_name, memoryview(targets).cast("B"))
        record["targets"] = {"file": targets_name, **buffer_digests(targets)}
    return k, record, lengths, sum(len(r) for r in rows)


def prepared_objective(manifest_data: dict[str, Any]) -> str:
    """The objective a prepared corpus was made for (``pretrain`` when the manifest names none)."""
    return str(manifest_data.get("objective", "pretrain"))


def open_prepared_rows(path: str, encoder: RowEncoder) -> EncodedDocs:
    """A prepared post-training corpus, memory-mapped, checked against the run's tokenizer, objective and chat
    format (sizes and sampled digests of the target files too). ValueError naming the manifest otherwise."""
    manifest = verify_prepared(path, encoder.tokenizer)
    where = manifest.root / MANIFEST
    made_for = prepared_objective(manifest.data)
    if made_for != encoder.prepared_for:
        raise ValueError(f"{where}: prepared for --objective {made_for}, not --objective {encoder.prepared_for}: "
                         f"prepare it again with `loongtrain prepare --objective {encoder.prepared_for}`")
    saved, now = manifest.data.get("chat") or {}, encoder.record()["chat"] or {}
    if saved.get("identity") != now.get("identity"):
        loss_on = f" (--loss-on {encoder.chat.loss_on})" if encoder.documents == 1 and encoder.chat else ""
        raise ValueError(f"{where}: prepared with chat format {saved.get('identity')!r} ({saved.get('loss_on')}), "
                         f"this run's is {now.get('identity')!r}{loss_on}: prepare it again with this run's "
                         f"--chat-template / --loss-on")
    tokens, targets = [], []
    for shard in manifest.data["shards"]:
        tokens.append(_memmap(manifest.root / SHARD_DIR / shard["file"], manifest.dtype))
        record = shard.get("targets")
        if encoder.documents != 1:
            continue
        file = manifest.root / SHARD_DIR / (record or {}).get("file", f"targets of {shard['file']}")
        if not record or not file.is_file() or file.stat().st_size != record["size"] or \
                sampled_digest(file) != record["sampled"]:
            raise ValueError(f"{file}: missing, truncated or corrupted (see {where}); prepare the corpus again")
        targets.append(_memmap(file, np.dtype("u1")))
    offsets = np.asarray(document_index(manifest), dtype=np.int64)
    if (len(offsets) - 1) % encoder.documents:
        raise ValueError(f"{where}: {len(offsets) - 1} documents, not {encoder.documents} per row; prepare it again")
    return EncodedDocs(_joined(tokens), _joined(targets) if targets else None, offsets)


def _memmap(file: Path, dtype: np.dtype) -> np.ndarray:
    return np.memmap(file, dtype=dtype, mode="r") if file.stat().st_size else np.empty(0, dtype)


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    """One array of the shards (a single shard stays memory-mapped)."""
    return parts[0] if len(parts) == 1 else np.concatenate(parts)
