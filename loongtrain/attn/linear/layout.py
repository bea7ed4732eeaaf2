"""Mesh-free arithmetic of linear attention over the context ranks (docs/linear-attention.md#the-context-ranks):
which runs of tokens a context rank holds, where each run's convolution halo comes from, in which order the
runs' state pairs compose, and the document masks. Nothing here touches a process group: the executor
(loongtrain/attn/linear/api.py), the planner's byte counts and the unit tests share it.

A rank's tokens (``T_c``, its chunks of ``chunk_order`` in that order) are cut into *runs*: maximal groups of its
chunks that follow each other in the sequence (zigzag: two runs per rank, one on rank ``cp - 1``, whose chunks
``cp - 1`` and ``cp`` touch). Each run is one recurrence on the rank; its state pair (the state it writes from a
zero start, and its transition) is what the ranks exchange. Every rank has ``slots`` run slots (the most runs any
rank has), so the exchanged tensors have one shape on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from loongtrain.model.delta_rule import compute_dtype
from loongtrain.parallel.config import effective_kv_heads
from loongtrain.parallel.zigzag import ChunkOrder, check_chunk_order, zigzag_order

Tensor = torch.Tensor

Run = tuple[int, int]  # (first global position, length in tokens)


@dataclass(frozen=True)
class RunLayout:
    """The runs of one replica's sequence of ``seq_len`` tokens over ``cp`` context ranks in ``chunk_order``
    (None: zigzag)."""

    seq_len: int
    cp: int
    chunk_order: ChunkOrder | None = None

    @cached_property
    def order(self) -> ChunkOrder:
        order = tuple(self.chunk_order) if self.chunk_order is not None else zigzag_order(self.cp)
        check_chunk_order(order, self.seq_len, 1, self.cp)
        return order

    @property
    def chunk_len(self) -> int:
        return self.seq_len // len(self.order)

    def runs(self, cp_rank: int) -> tuple[Run, ...]:
        """The runs of context rank ``cp_rank`` in its local order."""
        per_rank = len(self.order) // self.cp
        mine = self.order[cp_rank * per_rank: (cp_rank + 1) * per_rank]
        runs: list[list[int]] = []
        for chunk in mine:
            if runs and runs[-1][0] + runs[-1][1] == chunk:
                runs[-1][1] += 1
            else:
                runs.append([chunk, 1])
        return tuple((first * self.chunk_len, count * self.chunk_len) for first, count in runs)

    @cached_property
    def slots(self) -> int:
        """Run slots per rank: the most runs any context rank holds."""
        return max(len(self.runs(c)) for c in range(self.cp))

    @cached_property
    def sequence(self) -> tuple[tuple[int, int], ...]:
        """``(cp_rank, slot)`` of every run of the replica, in sequence order (the order pairs compose in)."""
        found = [(run[0], c, s) for c in range(self.cp) for s, run in enumerate(self.runs(c))]
        return tuple((c, s) for _, c, s in sorted(found))

    def needs_state(self, cp_rank: int) -> bool:
        """Whether a run of ``cp_rank`` starts after position 0 (its state comes from other runs)."""
        return any(start > 0 for start, _ in self.runs(cp_rank))

    @cached_property
    def any_state(self) -> bool:
        """Whether any run of the replica needs a state from another (false only for one run: cp == 1)."""
        return any(self.needs_state(c) for c in range(self.cp))

    def halo_index(self, cp_rank: int, taps: int) -> Tensor:
        """``[slots, taps - 1]`` int64: for each of this rank's runs the tokens before its start, as indices into
        every rank's run tails (``[cp, slots, taps - 1]`` in cp_rank order, flattened; a tail holds a run's last
        ``taps - 1`` tokens, aligned to its end); ``cp * slots * (taps - 1)`` (a zero row) before the sequence."""
        width = taps - 1
        owner = {}
        for c in range(self.cp):
            for s, (start, length) in enumerate(self.runs(c)):
                owner[start + length] = (c, s)  # by end position
        ends = sorted(owner)
        zero = self.cp * self.slots * width
        index = torch.full((self.slots, width), zero, dtype=torch.int64)
        for s, (start, _) in enumerate(self.runs(cp_rank)):
            for i, position in enumerate(range(start - width, start)):
                if position < 0:
                    continue
                end = next(e for e in ends if e > position)  # the run holding ``position`` ends first after it
                c, slot = owner[end]
                offset = width - (end - position)
                if offset >= 0:
                    index[s, i] = (c * self.slots + slot) * width + offset
        return index


def local_positions(layout: RunLayout, cp_rank: int) -> Tensor:
    """Global positions of context rank ``cp_rank``'s tokens ``T_c`` in local order."""
    return torch.cat([torch.arange(start, start + length) for start, length in layout.runs(cp_rank)])


def document_masks(rows: tuple[tuple[int, ...], ...] | None, batch: int, positions: Tensor,
                   taps: int) -> tuple[Tensor | None, Tensor]:
    """For local tokens at global ``positions`` (``[T]``) and each batch row's document boundaries ``rows``
    (``cu_seqlens`` of the full sequence; None: one document): ``starts [B, T]`` bool, the tokens a document (or
    the sequence) begins at (None without documents and without position 0), and ``visible [B, T, taps]``
    bool, whether a token sees the input ``j`` tokens back in the short convolution (same document, inside the
    sequence)."""
    back = positions[:, None] - torch.arange(taps)[None, :]  # [T, taps]
    if rows is None:
        starts = (positions == 0).expand(batch, -1) if bool((positions == 0).any()) else None
        return starts, (back >= 0).expand(batch, -1, -1)
    starts, visible = [], []
    for row in rows:
        bounds = torch.tensor(row, dtype=torch.int64)
        first = bounds[torch.bucketize(positions, bounds[1:], right=True)]  # the start of each token's document
        starts.append(positions == first)
        visible.append(back >= first[:, None])
    return torch.stack(starts), torch.stack(visible)


def exchange_bytes(layout: RunLayout, *, batch: int, key_heads: int, value_heads: int, key_dim: int,
                   value_dim: int, taps: int, hp: int, dtype: torch.dtype) -> dict[str, int]:
    """Bytes one rank sends over the context group in one :func:`loongtrain.linear_attention` call, forward and
    backward, by :class:`~loongtrain.parallel.comm.CommCounter` kind: each of its ``slots`` runs' convolution tail
    (``taps - 1`` tokens of its channels, the input dtype) and state pair (``Dk x (Dv + Dk)`` per value head, the
    compute dtype) to each of the ``cp - 1`` other context ranks, and their gradients back. None of it depends on
    the sequence length."""
    if layout.cp == 1:
        return {}
    peers = layout.cp - 1
    keys, values = effective_kv_heads(value_heads, key_heads, hp) // hp, value_heads // hp
    size = torch.finfo(dtype).bits // 8
    state_size = torch.finfo(compute_dtype(dtype)).bits // 8
    halo = batch * layout.slots * (taps - 1) * (2 * keys * key_dim + values * value_dim) * size * peers
    state = batch * layout.slots * values * key_dim * (value_dim + key_dim) * state_size * peers
    counted = {"state": state, "dstate": state}
    if taps > 1:
        counted.update(halo=halo, dhalo=halo)
    return counted
