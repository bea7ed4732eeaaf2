"""Conversations for ``--objective sft`` (docs/post-training.md): rows ``{"messages": [...]}`` of ``.jsonl``
files, directories of them, or a corpus prepared with ``loongtrain prepare --objective sft``, encoded by the
run's :class:`~loongtrain.data.chat.ChatFormat` and packed whole into rows of ``--seq-len``
(:mod:`loongtrain.data.whole_packing`).

The prepared form stores, beside each token shard ``tokens-K.bin``, ``targets-K.bin`` (one byte per token:
1 = target) and in the manifest ``"objective": "sft"`` and the chat format's identity (template digest and
rule); the conversations' tokens are stored as they are, without an EOS between them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from loongtrain._files import write_bytes
from loongtrain.data.chat import ChatFormat, Message, conversation_of
from loongtrain.data.corpus import Corpus
from loongtrain.data.prepared import (
    MANIFEST,
    SHARD_DIR,
    buffer_digests,
    document_index,
    is_prepared_dir,
    sampled_digest,
    verify_prepared,
)
from loongtrain.data.rows import read_rows
from loongtrain.data.split import selected
from loongtrain.data.tokenizer import Tokenizer
from loongtrain.data.whole_packing import EncodedDocs, build_row, concat_docs, pack_whole

log = logging.getLogger("loongtrain.train")

SFT = "sft"
WHAT = "--objective sft"


def encode_conversations(spec: str, chat: ChatFormat, decode_errors: str = "strict") -> EncodedDocs:
    """Every row's conversation encoded (ValueError naming ``FILE:LINE`` for a bad row)."""
    docs = [chat.encode(conversation_of(row, where), where) for where, row in read_rows(spec, WHAT, decode_errors)]
    if not docs:
        raise ValueError(f"corpus {spec!r} holds no rows")
    return concat_docs(docs)


def prepared_objective(manifest_data: dict[str, Any]) -> str:
    """The objective a prepared corpus was made for (``pretrain`` when the manifest names none)."""
    return str(manifest_data.get("objective", "pretrain"))


def holds_conversations(manifest_data: dict[str, Any]) -> bool:
    """Whether a prepared corpus holds conversations and their target masks (its manifest records the chat format
    that made them)."""
    return "chat" in manifest_data


def open_prepared_conversations(path: str, tokenizer: Tokenizer, chat: ChatFormat) -> EncodedDocs:
    """A prepared SFT corpus, memory-mapped, checked against the run's tokenizer and chat format (sizes and
    sampled digests of the target files too). ValueError naming the manifest otherwise."""
    manifest = verify_prepared(path, tokenizer)
    where = manifest.root / MANIFEST
    if not holds_conversations(manifest.data):
        raise ValueError(f"{where}: prepared for --objective {prepared_objective(manifest.data)}, without target "
                         f"masks: prepare it again with `loongtrain prepare --objective sft`")
    saved = manifest.data.get("chat", {})
    if saved.get("identity") != chat.identity():
        raise ValueError(f"{where}: prepared with chat format {saved.get('identity')!r} ({saved.get('loss_on')}), "
                         f"this run's is {chat.identity()!r} (--loss-on {chat.loss_on}, its chat template): prepare "
                         f"it again with this run's --chat-template / --loss-on")
    tokens, targets = [], []
    for shard in manifest.data["shards"]:
        tokens.append(_memmap(manifest.root / SHARD_DIR / shard["file"], manifest.dtype))
        record = shard["targets"]
        file = manifest.root / SHARD_DIR / record["file"]
        if not file.is_file() or file.stat().st_size != record["size"] or sampled_digest(file) != record["sampled"]:
            raise ValueError(f"{file}: missing, truncated or corrupted (see {where}); prepare the corpus again")
        targets.append(_memmap(file, np.dtype("u1")))
    offsets = np.asarray(document_index(manifest), dtype=np.int64)
    return EncodedDocs(_joined(tokens), _joined(targets), offsets)


def _memmap(file: Path, dtype: np.dtype) -> np.ndarray:
    return np.memmap(file, dtype=dtype, mode="r") if file.stat().st_size else np.empty(0, dtype)


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    """One array of the shards (a single shard stays memory-mapped)."""
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def open_conversations(spec: str, tokenizer: Tokenizer, chat: ChatFormat, *, val_fraction: float = 0.0,
                       seed: int = 0, part: str = "all", decode_errors: str = "strict") -> EncodedDocs:
    """The conversations of ``spec`` (raw rows or prepared), ``part`` of the split by ``val_fraction``
    (:mod:`loongtrain.data.split`, by conversation number)."""
    docs = (open_prepared_conversations(spec, tokenizer, chat) if is_prepared_dir(spec)
            else encode_conversations(spec, chat, decode_errors))
    return docs.select(selected(docs.num_documents, val_fraction, seed, part))


class ConversationDataset:
    """Rows of whole conversations (:func:`~loongtrain.data.whole_packing.pack_whole` in corpus order);
    index ``i`` past the last row wraps around (epochs)."""

    def __init__(self, docs: EncodedDocs, seq_len: int, pad_id: int, name: str, on_long: str = "drop") -> None:
        self.docs, self.seq_len, self.pad_id, self.name = docs, seq_len, pad_id, name
        lengths = docs.lengths()
        self.rows, self.dropped = pack_whole(lengths, seq_len, on_long, "conversations")
        self.tokens = int(lengths[lengths <= seq_len].sum())

    def num_samples(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = self.rows[index % len(self.rows)]
        return build_row([(self.docs.ids(int(d)), self.docs.marks(int(d))) for d in row], self.seq_len, self.pad_id)

    def summary(self) -> str:
        kept = self.docs.num_documents - self.dropped
        return (f"{kept} conversations in {len(self.rows)} rows of {self.seq_len} tokens "
                f"({self.tokens / max(1, len(self.rows) * self.seq_len):.0%} filled)"
                + (f"; {self.dropped} longer than --seq-len left out (--on-long drop)" if self.dropped else ""))


@dataclass(frozen=True)
class ConversationRow:
    """One row's conversation for ``loongtrain prepare --objective sft``; its length is its contents'
    characters (what the prepare's shards are cut by)."""

    where: str
    messages: list[Message]

    def __len__(self) -> int:
        return sum(len(m["content"]) for m in self.messages)


class ConversationRows(Corpus):
    """The conversations of a ``.jsonl`` corpus as :class:`ConversationRow` (each row checked)."""

    def __init__(self, spec: str, decode_errors: str = "strict") -> None:
        self.name, self.decode_errors = spec, decode_errors

    def __iter__(self) -> Iterator[ConversationRow]:  # type: ignore[override]
        for where, row in read_rows(self.name, WHAT, self.decode_errors):
            yield ConversationRow(where, conversation_of(row, where))


def tokenize_conversation_shard(task: tuple[int, list[ConversationRow], str, str, int],
                                chat: ChatFormat) -> tuple[int, dict[str, Any], np.ndarray, int]:
    """``loongtrain prepare --objective sft``'s worker: encode one shard's conversations, keep those of at
    least ``min_doc_tokens`` tokens, write ``tokens-<k>.bin`` and ``targets-<k>.bin``; return its record (as
    :func:`loongtrain.data.prepare`'s text shards do)."""
    k, rows, tmp, dtype, min_doc_tokens = task
    encoded = [e for e in (chat.encode(r.messages, r.where) for r in rows) if e[0].size >= min_doc_tokens]
    lengths = np.fromiter((ids.size for ids, _ in encoded), dtype=np.int64, count=len(encoded))
    tokens = np.concatenate([ids for ids, _ in encoded]).astype(np.dtype(dtype)) if encoded else np.empty(0, dtype)
    targets = np.concatenate([t for _, t in encoded]).astype(np.uint8) if encoded else np.empty(0, np.uint8)
    name, targets_name = f"tokens-{k:05d}.bin", f"targets-{k:05d}.bin"
    write_bytes(Path(tmp) / name, memoryview(tokens).cast("B"))
    write_bytes(Path(tmp) / targets_name, memoryview(targets).cast("B"))
    return k, {"file": name, "num_tokens": int(tokens.size), "num_documents": len(encoded),
               **({"dropped_documents": len(rows) - len(encoded)} if min_doc_tokens else {}),
               **buffer_digests(tokens), "targets": {"file": targets_name, **buffer_digests(targets)}}, \
        lengths, sum(len(r) for r in rows)
