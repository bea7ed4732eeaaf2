"""The one entry point the trainer needs: :func:`build_batches`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch

from loongtrain.data.mixture import MixtureDataset
from loongtrain.data.packing import PackedDataset
from loongtrain.data.sampler import ReplicaSampler
from loongtrain.data.sources import open_dataset
from loongtrain.data.tokenizer import Tokenizer, build_tokenizer


class Batches:
    """Iterator of full-sequence batches ``{input_ids, labels, position_ids, doc_starts}``, each
    ``[batch, seq_len]``.

    int64 (``doc_starts``: bool, the tokens that start a packed document). ``step`` is the global step
    of the NEXT batch; ``state_dict``/``load_state_dict``
    resume exactly.
    """

    def __init__(self, dataset: PackedDataset | MixtureDataset, sampler: ReplicaSampler) -> None:
        self.dataset, self.sampler = dataset, sampler

    @property
    def step(self) -> int:
        return self.sampler.step

    def batch(self, step: int) -> dict[str, torch.Tensor]:
        """The batch of global step ``step`` for this replica (pure: does not advance)."""
        return _collate([self.dataset[i] for i in self.sampler.indices(step)])

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        return _collate([self.dataset[i] for i in self.sampler.next_indices()])

    def state_dict(self) -> dict[str, int]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.sampler.load_state_dict(state)

    def tokens_by_corpus(self, step: int | None = None) -> dict[str, int]:
        """Input tokens each corpus has supplied to ALL replicas before step ``step`` (global; default
        ``self.step``)."""
        positions = (self.sampler.step if step is None else step) * self.sampler.dp * self.sampler.batch_size
        if isinstance(self.dataset, MixtureDataset):
            return self.dataset.tokens_by_corpus(positions)
        return {self.dataset.stream.corpus.name: positions * self.dataset.seq_len}


class DataOptions(Protocol):
    """What the corpus readers read of a run's data section (``TrainConfig.data``, a
    :class:`~loongtrain.sections.data.DataSection`; docs/data.md): the corpus spec, its validation split or corpus,
    the sequence length, the sequences per replica and the decoding of raw bytes."""

    corpus: str
    seq_len: int
    batch_size: int
    val_fraction: float
    val_corpus: str
    decode_errors: str


def build_batches(
    data: DataOptions,
    tokenizer: str | Tokenizer = "byte",
    seed: int = 0,
    *,
    dp_rank: int = 0,
    dp: int = 1,
    start_step: int = 0,
    shuffle: bool = True,
    text_field: str = "text",
) -> Batches:
    """Batches of ``data.batch_size`` sequences of ``data.seq_len`` tokens for replica ``dp_rank`` of ``dp`` from
    global step ``start_step`` (infinite; wraps epochs).

    Every sp rank of a replica gets the same full-sequence batch and shards it itself with
    ``loongtrain.shard_sequence(x, mesh, dim=1)``. ``shuffle=True`` reorders samples per epoch with
    ``seed`` and therefore tokenizes the whole corpus once up front (well under a second for "stdlib"
    with the byte tokenizer); ``shuffle=False`` streams samples in corpus order, tokenizing lazily.

    ``data.corpus``: a prepared directory (memory-mapped, nothing read up front), a raw corpus, or a
    mixture ``a=0.7,b=0.3`` of them (:mod:`loongtrain.data.sources`). The same corpus prepared or raw
    gives bit-identical batches. ``data.val_fraction`` > 0 leaves out the validation documents
    (:mod:`loongtrain.data.split`; their batches: :func:`loongtrain.data.validation.build_val_batches`);
    ``data.val_corpus`` is not read here. ``data.decode_errors``: raw corpora's non-UTF-8 bytes
    (``--decode-errors``: strict, replace or ignore).
    """
    seq_len, val_fraction = data.seq_len, data.val_fraction
    tok = build_tokenizer(tokenizer)
    dataset = open_dataset(data.corpus, tok, seq_len, text_field=text_field, val_fraction=val_fraction, seed=seed,
                           part="train" if val_fraction else "all", decode_errors=data.decode_errors, shuffle=shuffle)
    # a mixture maps every global position itself
    num_samples = dataset.num_samples() if shuffle and isinstance(dataset, PackedDataset) else None
    sampler = ReplicaSampler(num_samples, dp_rank, dp, data.batch_size, seed, shuffle=shuffle, start_step=start_step)
    return Batches(dataset, sampler)


def _collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {key: torch.stack([s[key] for s in samples]) for key in samples[0]}
