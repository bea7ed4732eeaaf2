"""Packing whole documents into fixed-length rows, never splitting one (post-training: conversations and
preference pairs; docs/post-training.md).

- :class:`EncodedDocs`: documents as one token array, their target marks and their offsets (in memory,
  or memory-mapped from a prepared corpus);
- :func:`pack_whole`: greedy in corpus order: a unit (a conversation, a pair) joins the current row when it
  fits in what is left of ``seq_len``, else it starts the next row; a unit longer than ``seq_len`` is left
  out (its number is returned) or, with ``on_long="error"``, refused;
- :func:`build_row`: one row ``{input_ids, labels, position_ids, doc_starts}`` from its documents: each
  document's label at position ``j`` is its token ``j + 1`` when that token is a target, else
  ``IGNORE_INDEX`` (the last token of a document predicts nothing); the rest of the row is padding (the
  EOS id, never a target) marked as a document of its own. ``position_ids`` are ``0..seq_len-1``: the
  trainer's ``--doc-mask on --position-reset`` restarts them per document (``doc_starts``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from loongtrain.data.labels import IGNORE_INDEX
from loongtrain.data.messages import ON_LONG


@dataclass(frozen=True)
class EncodedDocs:
    """Documents ``i = 0..n-1``: tokens ``tokens[offsets[i]:offsets[i+1]]``, their target marks
    ``targets[...]`` (None: not stored, e.g. preference pieces)."""

    tokens: np.ndarray
    targets: np.ndarray | None
    offsets: np.ndarray

    @property
    def num_documents(self) -> int:
        return len(self.offsets) - 1

    def lengths(self) -> np.ndarray:
        return np.diff(np.asarray(self.offsets, dtype=np.int64))

    def ids(self, i: int) -> np.ndarray:
        return np.asarray(self.tokens[int(self.offsets[i]):int(self.offsets[i + 1])], dtype=np.int64)

    def marks(self, i: int) -> np.ndarray:
        assert self.targets is not None, "these documents store no targets"
        return np.asarray(self.targets[int(self.offsets[i]):int(self.offsets[i + 1])], dtype=bool)

    def select(self, documents: np.ndarray | None) -> EncodedDocs:
        """The documents numbered ``documents`` (sorted; None: all), in order, as one new array set."""
        if documents is None:
            return self
        if not len(documents):
            return EncodedDocs(self.tokens[:0], None if self.targets is None else self.targets[:0],
                               np.zeros(1, dtype=np.int64))
        pieces = [np.arange(int(self.offsets[d]), int(self.offsets[d + 1])) for d in documents]
        index = np.concatenate(pieces)
        offsets = np.concatenate([[0], np.cumsum([len(p) for p in pieces])]).astype(np.int64)
        return EncodedDocs(np.asarray(self.tokens[index]), None if self.targets is None else
                           np.asarray(self.targets[index]), offsets)


def concat_docs(docs: Sequence[tuple[np.ndarray, np.ndarray | None]]) -> EncodedDocs:
    """:class:`EncodedDocs` of ``(ids, targets)`` pairs (targets all None or all arrays)."""
    lengths = [len(ids) for ids, _ in docs]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = np.concatenate([ids for ids, _ in docs]).astype(np.int64) if docs else np.zeros(0, np.int64)
    with_targets = bool(docs) and docs[0][1] is not None
    targets = (np.concatenate([t for _, t in docs]).astype(bool) if with_targets else
               (None if docs else np.zeros(0, bool)))
    return EncodedDocs(tokens, targets, offsets)


def pack_whole(lengths: np.ndarray, seq_len: int, on_long: str, what: str) -> tuple[list[np.ndarray], int]:
    """``(rows, dropped)``: each row the unit numbers it holds (module docstring: the rule), and how many
    units were longer than ``seq_len``. ValueError with ``on_long="error"`` naming the first such unit, or
    when no unit fits (``what``: the units, e.g. "conversations", for the messages)."""
    if on_long not in ON_LONG:
        raise ValueError(f"--on-long={on_long!r} is not one of {ON_LONG}")
    lengths = np.asarray(lengths, dtype=np.int64)
    long = np.flatnonzero(lengths > seq_len)
    if len(long) and on_long == "error":
        raise ValueError(f"{what.rstrip('s')} {int(long[0])} (counting from 0) has {int(lengths[long[0]])} tokens, "
                         f"more than --seq-len {seq_len} ({len(long)} of {len(lengths)} {what} are longer): raise "
                         f"--seq-len, or --on-long drop to leave them out")
    if len(lengths) and len(long) == len(lengths):
        raise ValueError(f"every one of the {len(lengths)} {what} is longer than --seq-len {seq_len} (the shortest "
                         f"has {int(lengths.min())} tokens): raise --seq-len to at least {int(lengths.min())}")
    rows: list[np.ndarray] = []
    current: list[int] = []
    used = 0
    for unit, n in enumerate(lengths.tolist()):
        if n > seq_len:
            continue
        if used + n > seq_len:
            rows.append(np.array(current, dtype=np.int64))
            current, used = [], 0
        current.append(unit)
        used += n
    if current:
        rows.append(np.array(current, dtype=np.int64))
    return rows, len(long)


def build_row(docs: Sequence[tuple[np.ndarray, np.ndarray]], seq_len: int, pad_id: int,
              segments: Sequence[int] | None = None) -> dict[str, torch.Tensor]:
    """One row of ``docs`` (``(ids, targets)`` each; module docstring). ``segments``: each document's
    sequence number, which adds ``segment [seq_len]`` (that number at every target label, else -1)."""
    input_ids = np.full(seq_len, pad_id, dtype=np.int64)
    labels = np.full(seq_len, IGNORE_INDEX, dtype=np.int64)
    starts = np.zeros(seq_len, dtype=bool)
    segment = np.full(seq_len, -1, dtype=np.int64)
    pos = 0
    for k, (ids, targets) in enumerate(docs):
        n = len(ids)
        assert pos + n <= seq_len, "pack_whole fits every row"
        input_ids[pos:pos + n] = ids
        labels[pos:pos + n - 1] = np.where(targets[1:], ids[1:], IGNORE_INDEX)
        if segments is not None:
            segment[pos:pos + n - 1] = np.where(targets[1:], segments[k], -1)
        starts[pos] = True
        pos += n
    if pos < seq_len:
        starts[pos] = True  # the padding: a document of its own
    row = {"input_ids": torch.from_numpy(input_ids), "labels": torch.from_numpy(labels),
           "position_ids": torch.arange(seq_len, dtype=torch.int64), "doc_starts": torch.from_numpy(starts)}
    if segments is not None:
        row["segment"] = torch.from_numpy(segment)
    return row
