"""Deterministic, resumable sample indices per data-parallel replica.

Global step ``n`` consumes the global sample positions ``g`` in ``[n*dp*B, (n+1)*dp*B)``; replica ``d``
gets ``g = n*dp*B + d*B + b`` for ``b < B``. All sp ranks of a replica get the same indices (the
full-sequence batch; each rank then slices its own shard). Position ``g`` maps to a sample index:

- ``num_samples`` known: epoch ``e = g // num_samples``; the index is ``perm_e[g % num_samples]``
  with ``perm_e`` a permutation seeded by ``(seed, e)`` (or the identity when ``shuffle=False``);
- ``num_samples=None`` (infinite stream): the index is ``g`` itself (the dataset wraps it).

The permutation: ``torch.randperm`` (8 bytes per sample, built when an epoch starts) up to
:data:`RANDPERM_MAX` samples; above, a stateless one (:func:`feistel_index`: a 4-round Feistel network
on the next even power of two, cycle-walked into ``[0, num_samples)``), so that opening a corpus of any
size costs neither time nor memory per sample. The choice is part of the state (docs/data.md).
"""

from __future__ import annotations

import torch

#: largest epoch that ``torch.randperm`` permutes (8 MiB); larger ones use :func:`feistel_index`
RANDPERM_MAX = 1 << 20
PERMUTATIONS = ("randperm", "feistel")
_MASK64 = (1 << 64) - 1


def _mix(key: int, round_: int, value: int) -> int:
    """splitmix64 of (key, round, value)."""
    z = (key * 0x9E3779B97F4A7C15 + round_ * 0xD1B54A32D192ED03 + value + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def feistel_index(i: int, n: int, key: int) -> int:
    """Position ``i`` of a pseudo-random permutation of ``range(n)`` chosen by ``key`` (O(1) memory)."""
    bits = max(2, (n - 1).bit_length())
    half = (bits + 1) // 2
    mask = (1 << half) - 1
    x = i
    while True:  # the Feistel network permutes [0, 4**half); walking its cycle lands back in [0, n)
        left, right = x >> half, x & mask
        for round_ in range(4):
            left, right = right, left ^ (_mix(key, round_, right) & mask)
        x = (left << half) | right
        if x < n:
            return x


class ReplicaSampler:
    """Yields, step after step, the ``batch_size`` sample indices of replica ``dp_rank``."""

    def __init__(
        self,
        num_samples: int | None,
        dp_rank: int,
        dp: int,
        batch_size: int,
        seed: int = 0,
        *,
        shuffle: bool = True,
        start_step: int = 0,
        permutation: str | None = None,
    ) -> None:
        if num_samples is not None and num_samples < 1:
            raise ValueError(f"num_samples={num_samples} must be positive (or None for infinite)")
        if dp < 1 or not 0 <= dp_rank < dp:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp={dp})")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be positive")
        if start_step < 0:
            raise ValueError(f"start_step={start_step} must be non-negative")
        self.num_samples, self.dp_rank, self.dp, self.batch_size = num_samples, dp_rank, dp, batch_size
        self.seed, self.shuffle, self.step = seed, shuffle, start_step
        if permutation is None:
            permutation = "randperm" if num_samples is None or num_samples <= RANDPERM_MAX else "feistel"
        if permutation not in PERMUTATIONS:
            raise ValueError(f"permutation={permutation!r} is not one of {PERMUTATIONS}")
        self.permutation = permutation
        self._perm_cache: dict[int, torch.Tensor] = {}

    def indices(self, step: int) -> list[int]:
        """Sample indices of this replica at global step ``step`` (pure: does not advance)."""
        first = (step * self.dp + self.dp_rank) * self.batch_size
        return [self.sample_at(g) for g in range(first, first + self.batch_size)]

    def sample_at(self, g: int) -> int:
        """The sample index of global position ``g`` (module docstring: the rule)."""
        if self.num_samples is None:
            return g
        epoch, offset = divmod(g, self.num_samples)
        if not self.shuffle:
            return offset
        if self.permutation == "feistel":
            return feistel_index(offset, self.num_samples, self.seed * 1_000_003 + epoch)
        if epoch not in self._perm_cache:
            if len(self._perm_cache) > 2:
                self._perm_cache.clear()
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm_cache[epoch] = torch.randperm(self.num_samples, generator=gen)
        return int(self._perm_cache[epoch][offset])

    def next_indices(self) -> list[int]:
        """The indices of the next step, advancing first so ``state_dict()`` always names the next step."""
        step, self.step = self.step, self.step + 1
        return self.indices(step)

    def state_dict(self) -> dict[str, int]:
        """The next step to produce, plus what must match on resume."""
        return {"step": self.step, "samples_per_step": self.dp * self.batch_size, "seed": self.seed,
                "permutation": self.permutation}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume exactly where :meth:`state_dict` was taken (ValueError if global batch or seed changed)."""
        if state.get("samples_per_step", self.dp * self.batch_size) != self.dp * self.batch_size:
            raise ValueError(
                f"cannot resume: checkpoint used {state['samples_per_step']} samples per step, "
                f"now dp*batch_size = {self.dp}*{self.batch_size}"
            )
        if state.get("seed", self.seed) != self.seed:
            raise ValueError(f"cannot resume: checkpoint seed {state['seed']} != seed {self.seed}")
        self.step = int(state["step"])
        permutation = state.get("permutation", "randperm")  # checkpoints older than the choice: randperm
        if permutation not in PERMUTATIONS:
            raise ValueError(f"cannot resume: checkpoint permutation {permutation!r} is not one of {PERMUTATIONS}")
        self.permutation = permutation
