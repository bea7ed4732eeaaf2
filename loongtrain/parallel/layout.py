"""Rank placement for 2D-Attention: a pure function of (world_size, hp, cp, inner_ring, placement, interleaved).

Every rank has coordinates ``(dp_rank, cp_rank, hp_rank)``; ``cp_rank`` is the rank's position in its
context ring. ``Layout.grid[d][c][h]`` is the global rank at those coordinates. No process group is
touched here, so the same object serves the mesh, the traffic accounting and the planner.

Placement rules (docs/attention.md#rank-placement):
- ``dp`` is outermost: replica ``d`` owns global ranks ``[d*sp, (d+1)*sp)``.
- ``head_first``: a head group is ``hp`` consecutive ranks; context neighbours are ``hp`` apart.
- ``context_first``: ring neighbours are consecutive ranks; head-group members are ``cp`` apart.
- Double ring: the ring is cut into ``cp // inner_ring`` inner rings of ``inner_ring`` consecutive ring members.
- ``interleaved``: inside each inner ring, ring member ``i`` sits on physical slot ``2*i`` for the first
  half of the inner ring and ``2*(i - inner_ring/2) + 1`` for the second half, so that two devices that share
  a NIC (slots ``2k``, ``2k+1``) hold ring members half an inner ring apart instead of ring neighbours.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Literal

from loongtrain.parallel.zigzag import divisors

Hop = Literal["inner", "outer"]
HOPS: tuple[Hop, ...] = ("inner", "outer")

PLACEMENTS = ("head_first", "context_first")


@dataclass(frozen=True)
class Layout:
    world_size: int
    hp: int
    cp: int
    inner_ring: int = 1
    placement: str = "head_first"
    interleaved: bool = False

    def __post_init__(self) -> None:
        for name in ("world_size", "hp", "cp", "inner_ring"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        sp = self.hp * self.cp
        if self.world_size % sp != 0:
            raise ValueError(
                f"world_size={self.world_size} is not divisible by hp*cp={self.hp}*{self.cp}={sp}; "
                f"valid hp*cp values divide the world size: {divisors(self.world_size)}"
            )
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement={self.placement!r} is not one of {PLACEMENTS}")
        if self.cp % self.inner_ring != 0:
            raise ValueError(
                f"inner_ring={self.inner_ring} must divide cp={self.cp}; valid sizes: {divisors(self.cp)}"
            )
        if self.interleaved and (self.inner_ring < 2 or self.inner_ring % 2 != 0):
            raise ValueError(
                f"interleaved=True needs an even inner ring >= 2 (devices pair up inside an inner ring); "
                f"got inner_ring={self.inner_ring}"
            )

    @property
    def sp(self) -> int:
        return self.hp * self.cp

    @property
    def dp(self) -> int:
        return self.world_size // self.sp

    @property
    def num_inner_rings(self) -> int:
        return self.cp // self.inner_ring

    def physical_context_slot(self, cp_rank: int) -> int:
        """Physical position (0..cp-1) along the context axis of ring member ``cp_rank``."""
        ring_idx, inner = divmod(cp_rank, self.inner_ring)
        if self.interleaved:
            half = self.inner_ring // 2
            inner = 2 * inner if inner < half else 2 * (inner - half) + 1
        return ring_idx * self.inner_ring + inner

    def global_rank(self, dp_rank: int, cp_rank: int, hp_rank: int) -> int:
        slot_c = self.physical_context_slot(cp_rank)
        if self.placement == "head_first":
            local = slot_c * self.hp + hp_rank
        else:
            local = hp_rank * self.cp + slot_c
        return dp_rank * self.sp + local

    @cached_property
    def grid(self) -> list[list[list[int]]]:
        """grid[d][c][h] -> global rank; c is the ring position."""
        return [
            [[self.global_rank(d, c, h) for h in range(self.hp)] for c in range(self.cp)]
            for d in range(self.dp)
        ]

    @cached_property
    def _coords(self) -> dict[int, tuple[int, int, int]]:
        out = {}
        for d, plane in enumerate(self.grid):
            for c, row in enumerate(plane):
                for h, rank in enumerate(row):
                    out[rank] = (d, c, h)
        assert sorted(out) == list(range(self.world_size))
        return out

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(dp_rank, cp_rank, hp_rank) of a global rank."""
        return self._coords[rank]

    def head_groups(self) -> list[list[int]]:
        """Ranks of each head group, ordered by hp_rank."""
        return [list(row) for plane in self.grid for row in plane]

    def context_groups(self) -> list[list[int]]:
        """Ranks of each context ring, in ring order."""
        return [[plane[c][h] for c in range(self.cp)] for plane in self.grid for h in range(self.hp)]

    def inner_ring_groups(self) -> list[list[int]]:
        """Ranks of each double-ring inner ring (``inner_ring`` consecutive ring members), in ring order."""
        return self._ring_cycles("inner")

    def outer_ring_groups(self) -> list[list[int]]:
        """Ring members at the same position ``i`` of every inner ring, in inner-ring order."""
        return self._ring_cycles("outer")

    def _ring_cycles(self, hop: str) -> list[list[int]]:
        """Every ``hop`` cycle of every context ring, as global ranks (cycles from DoubleRing,
        docs/attention.md#the-ring-schedule)."""
        ring = DoubleRing(self.num_inner_rings, self.inner_ring)
        firsts = sorted({ring.cycle(p, hop)[0] for p in range(self.cp)})
        return [[ranks[p] for p in ring.cycle(first, hop)] for ranks in self.context_groups() for first in firsts]

    def replica_groups(self) -> list[list[int]]:
        """The sp ranks of each replica, ordered by (cp_rank, hp_rank): the sequence-shard order."""
        return [[rank for row in plane for rank in row] for plane in self.grid]

    def dp_groups(self) -> list[list[int]]:
        """Ranks holding the same (cp_rank, hp_rank) in each replica, ordered by dp_rank."""
        return [
            [self.grid[d][c][h] for d in range(self.dp)] for c in range(self.cp) for h in range(self.hp)
        ]

    def ring_peers(self, rank: int) -> dict[str, int]:
        """Global ranks this rank exchanges with: inner-ring next/prev and outer-ring next/prev (the ring
        arithmetic of :class:`loongtrain.parallel.layout.DoubleRing`, docs/attention.md#the-ring-schedule)."""
        d, c, h = self.coords(rank)
        ring = DoubleRing(self.num_inner_rings, self.inner_ring)
        return {f"{hop}_{name}": self.grid[d][ring.peer(c, hop, step)][h]
                for hop in ("inner", "outer") for name, step in (("next", 1), ("prev", -1))}


@dataclass(frozen=True)
class DoubleRing:
    """Position arithmetic of a double ring: ``num_inner_rings`` inner rings of ``inner_ring`` members."""

    num_inner_rings: int
    inner_ring: int

    def __post_init__(self) -> None:
        assert self.num_inner_rings >= 1 and self.inner_ring >= 1, self

    @property
    def size(self) -> int:
        return self.num_inner_rings * self.inner_ring

    def peer(self, position: int, hop: Hop, step: int) -> int:
        """Position ``step`` members away along ``hop`` (``+1``: next, ``-1``: previous)."""
        j, i = divmod(position, self.inner_ring)
        if hop == "inner":
            i = (i + step) % self.inner_ring
        else:
            j = (j + step) % self.num_inner_rings
        return j * self.inner_ring + i

    def cycle(self, position: int, hop: Hop) -> list[int]:
        """Positions of the ``hop`` cycle through ``position`` (its inner ring, or its column across the
        inner rings), in ring order starting from the cycle's first member."""
        n = self.inner_ring if hop == "inner" else self.num_inner_rings
        start = position
        for _ in range(n):
            prev = self.peer(start, hop, -1)
            if prev > start:  # wrapped: ``start`` is the cycle's first member
                break
            start = prev
        members = [start]
        while len(members) < n:
            members.append(self.peer(members[-1], hop, 1))
        return members

    def source(self, position: int, outer: int, inner: int) -> int:
        """Position whose K/V block member ``position`` holds at step ``(outer, inner)``."""
        j, i = divmod(position, self.inner_ring)
        return ((j - outer) % self.num_inner_rings) * self.inner_ring + (i - inner) % self.inner_ring
