"""Validation batches: the held-out documents (``--val-fraction``) or a corpus of their own
(``--val-corpus``), for the evaluation loop (docs/data.md).

API for the evaluation loop::

    val = build_val_batches(cfg.data, tokenizer, cfg.optim.seed, dp_rank=mesh.dp_rank, dp=mesh.dp)
    for name, batch in val.named():   # or: for batch in val
        ...                           # batch: {input_ids, labels, position_ids, doc_starts}, [B, S]

- Every replica gets ``len(val)`` batches (the same number on every replica, so collectives line up),
  each ``batch_size`` full sequences; sp ranks of a replica shard them as training batches.
- Order: corpus by corpus (a mixture's corpora in the order given; weights do not apply), each
  corpus's validation samples in stream order (no shuffle), sample ``j`` of a corpus on replica
  ``(j // batch_size) % dp``; the samples past the last whole global batch are left out.
- Deterministic and re-iterable: every pass yields the same batches (read lazily; prepared
  directories by memory map).
- With ``val_fraction``, the sequences are packed from held-out documents only, which the training
  stream (:func:`~loongtrain.data.pipeline.build_batches` with the same ``val_fraction`` and ``seed``)
  never contains: no token of a validation document is trained on.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from loongtrain.data.packing import PackedDataset
from loongtrain.data.pipeline import DataOptions
from loongtrain.data.sampler import ReplicaSampler
from loongtrain.data.sources import open_stream, parse_corpus_spec
from loongtrain.data.split import check_fraction
from loongtrain.data.tokenizer import Tokenizer, build_tokenizer


class ValBatches:
    """This replica's validation batches (module docstring: order and guarantees)."""

    def __init__(self, parts: list[tuple[str, PackedDataset, ReplicaSampler, int]]) -> None:
        self._parts = parts  # (corpus name, dataset, sampler, batches per replica)

    def __len__(self) -> int:
        return sum(n for *_, n in self._parts)

    def named(self) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
        """(corpus name, batch) pairs."""
        for name, dataset, sampler, count in self._parts:
            for step in range(count):
                samples = [dataset[i] for i in sampler.indices(step)]
                yield name, {key: torch.stack([s[key] for s in samples]) for key in samples[0]}

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return (batch for _, batch in self.named())

    def tokens(self) -> int:
        """Input tokens of this replica's validation batches."""
        return sum(n * sampler.batch_size * dataset.seq_len for _, dataset, sampler, n in self._parts)


def build_val_batches(data: DataOptions, tokenizer: str | Tokenizer, seed: int = 0, *, dp_rank: int = 0, dp: int = 1,
                      text_field: str = "text") -> ValBatches:
    """The validation batches of replica ``dp_rank`` of ``dp``, each ``data.batch_size`` sequences of
    ``data.seq_len`` tokens: the documents of ``data.corpus`` held out by ``data.val_fraction`` (> 0) and ``seed``,
    or all of ``data.val_corpus`` (exactly one of the two).

    ValueError when neither or both are given, when the fraction is outside (0, 1), or when the
    validation data holds less than one global batch (``dp * batch_size`` sequences)."""
    seq_len, batch_size = data.seq_len, data.batch_size
    spec, datasets = _val_datasets(data, tokenizer, seed, text_field)
    parts = []
    for name, dataset in datasets:
        count = max((dataset.stream.total_length() - 1) // seq_len, 0) // (dp * batch_size)
        parts.append((name, dataset, ReplicaSampler(None, dp_rank, dp, batch_size, seed, shuffle=False), count))
    if not any(n for *_, n in parts):
        raise ValueError(_too_small(spec, bool(data.val_corpus), dp * batch_size, seq_len))
    return ValBatches(parts)


def count_val_batches(data: DataOptions, tokenizer: str | Tokenizer, dp: int, want: int, *, seed: int = 0) -> int:
    """How many of ``want`` validation batches per replica :func:`build_val_batches` would give for a run's ``data``
    section (fewer when the held-out data holds fewer), reading no more than ``want`` global batches of each
    corpus's held-out stream (a prepared corpus: its document index only). ValueError as build_val_batches."""
    seq_len = data.seq_len
    spec, datasets = _val_datasets(data, tokenizer, seed, "text")
    rows = dp * data.batch_size
    total = sum(max((d.stream.ensure(want * rows * seq_len + 1) - 1) // seq_len, 0) // rows for _, d in datasets)
    if not total:
        raise ValueError(_too_small(spec, bool(data.val_corpus), rows, seq_len))
    return min(total, want)


def _val_datasets(data: DataOptions, tokenizer: str | Tokenizer, seed: int,
                  text_field: str) -> tuple[str, list[tuple[str, PackedDataset]]]:
    """(the spec read, [(corpus, its validation samples)]): the held-out part of each corpus of ``data.corpus``,
    or every corpus of ``data.val_corpus`` whole."""
    val_fraction, val_corpus = data.val_fraction, data.val_corpus
    check_fraction(val_fraction)
    if bool(val_fraction) == bool(val_corpus):
        raise ValueError(f"validation needs exactly one of --val-fraction (got {val_fraction}) and "
                         f"--val-corpus (got {val_corpus!r})")
    tok = build_tokenizer(tokenizer)
    spec, part = (val_corpus, "all") if val_corpus else (str(data.corpus), "validation")
    return spec, [(name, PackedDataset(open_stream(name, tok, text_field=text_field, val_fraction=val_fraction,
                                                   seed=seed, part=part, decode_errors=data.decode_errors),
                                       data.seq_len))
                  for name, _ in parse_corpus_spec(spec)]


def _too_small(spec: str, whole: bool, rows: int, seq_len: int) -> str:
    return (f"the validation data of {spec!r} ({'all' if whole else 'held-out documents'}) holds less than one "
            f"global batch of dp*batch_size = {rows} sequences of {seq_len + 1} tokens; raise --val-fraction or "
            f"shorten --seq-len")
