"""Weighted mixtures of corpora, deterministic and resumable (docs/data.md).

The global sample positions ``g`` (the sampler's; :mod:`loongtrain.data.sampler`) are cut into blocks
of :data:`BLOCK` positions. Each block gives corpus ``c`` exactly ``counts[c]`` positions, the weights
scaled to :data:`BLOCK` by largest remainder (so weights are exact to 1/BLOCK), at places given by a
permutation seeded by ``(seed, block)``. The ``k``-th position of corpus ``c`` in block ``b`` draws that
corpus's sample number ``n = b * counts[c] + k``, which the corpus's own
:class:`~loongtrain.data.sampler.ReplicaSampler` (seed ``seed + c``) maps to a sample (epochs
reshuffled as for a single corpus). Everything is a function of ``g``, so a resumed run (at any dp with
the same global batch) continues exactly, and the tokens drawn from each corpus up to any step are
known in O(1) (:meth:`MixtureDataset.tokens_by_corpus`). A one-corpus mixture is that corpus alone.
Weights are fractions of sequences (so of tokens), not of documents.
"""

from __future__ import annotations

import numpy as np
import torch

from loongtrain.data.packing import PackedDataset
from loongtrain.data.sampler import ReplicaSampler

BLOCK = 1024


def block_counts(weights: list[float], block: int = BLOCK) -> list[int]:
    """Positions per block for each weight: proportional, summing to ``block`` (largest remainder,
    ties to the earlier corpus)."""
    total = sum(weights)
    exact = [w / total * block for w in weights]
    counts = [int(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: block - sum(counts)]:
        counts[i] += 1
    return counts


class MixtureDataset:
    """Global sample position -> a sample of one of ``datasets`` (module docstring: the rule)."""

    def __init__(self, datasets: list[PackedDataset], names: list[str], weights: list[float], seed: int = 0,
                 *, shuffle: bool = True) -> None:
        if len({d.seq_len for d in datasets}) != 1:
            raise ValueError("every corpus of a mixture needs the same seq_len")
        self.datasets, self.names, self.seed = datasets, names, seed
        self.seq_len = datasets[0].seq_len
        self.counts = block_counts(weights)
        self.samplers = [
            ReplicaSampler(d.num_samples() if shuffle and n else None, 0, 1, 1, seed + c, shuffle=shuffle)
            for c, (d, n) in enumerate(zip(datasets, self.counts))
        ]
        self._blocks: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(corpus of each position, its rank among that corpus's positions) in block ``b``."""
        if b not in self._blocks:
            if len(self._blocks) > 2:
                self._blocks.clear()
            labels = np.repeat(np.arange(len(self.counts)), self.counts)
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + b)
            labels = labels[torch.randperm(BLOCK, generator=gen).numpy()]
            ranks = np.empty(BLOCK, dtype=np.int64)
            for c in range(len(self.counts)):
                ranks[labels == c] = np.arange(self.counts[c])
            self._blocks[b] = (labels, ranks)
        return self._blocks[b]

    def source(self, g: int) -> tuple[int, int]:
        """(corpus, its sample index) of global position ``g``."""
        b, r = divmod(g, BLOCK)
        labels, ranks = self._block(b)
        c = int(labels[r])
        return c, self.samplers[c].sample_at(b * self.counts[c] + int(ranks[r]))

    def __getitem__(self, g: int) -> dict[str, torch.Tensor]:
        c, index = self.source(g)
        return self.datasets[c][index]

    def tokens_by_corpus(self, positions: int) -> dict[str, int]:
        """Input tokens each corpus supplied to the first ``positions`` global positions."""
        b, r = divmod(positions, BLOCK)
        labels, _ = self._block(b)
        partial = np.bincount(labels[:r], minlength=len(self.counts))
        return {name: (b * n + int(p)) * self.seq_len for name, n, p in zip(self.names, self.counts, partial)}
