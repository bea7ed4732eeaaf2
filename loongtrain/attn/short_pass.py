"""The short pass's route: which blocks a short sliding window needs, and the hops that bring them
(docs/attention.md#the-ring-schedule, "Short pass").

Under zigzag a sliding window reaching ``r`` chunks needs only the K/V blocks of the ring members at
most ``r`` positions away (:func:`pass_reach`). :func:`short_plan` finds, for every outer offset, the
inner offsets those blocks sit at and the fewest outer hops each way that visit them;
:func:`short_sends` and :func:`short_hops` count the blocks a member sends. Pure arithmetic, like the
rest of the schedule: :func:`loongtrain.attn.schedule.pass_events` turns the route into events (its
``reach`` argument), ``plan/traffic.py`` and the planner count its bytes.
"""

from __future__ import annotations

from functools import lru_cache

from loongtrain.parallel.layout import DoubleRing, Hop


def pass_reach(ring: DoubleRing, chunk: int, sliding_window: int | None, zigzag: bool = True) -> int | None:
    """``r`` when a short sliding window lets the pass stop early, else ``None`` (the full pass; always
    for a layout other than zigzag, ``zigzag=False``, whose chunks are not ring neighbourhoods).

    Under zigzag (docs/attention.md#zigzag-sharding) a query sees keys at most ``w - 1`` positions away, i.e. at most
    ``r = ceil((w - 1) / chunk)`` chunks away, and those chunks belong to the ring members at most ``r``
    positions away in ring order. The short pass (:func:`~loongtrain.attn.schedule.pass_events` with
    ``reach=r``) brings exactly those blocks (:func:`short_plan`): worth it when it moves fewer blocks
    than the full pass's ``cp - 1``."""
    if sliding_window is None or not zigzag:
        return None
    r = -(-(sliding_window - 1) // chunk)
    if 2 * r + 1 >= ring.size:  # every member is within reach: no pass is shorter than the full one
        return None
    return r if short_hops(ring, r) < ring.size - 1 else None


def _cover(needed: frozenset[int], size: int) -> tuple[int, int]:
    """Fewest hops ``(a, b)`` round a cycle of ``size`` (``a`` forward, ``b`` backward, ``a + b < size`` so
    no member is visited twice) that visit every offset in ``needed`` (offset 0: where the walk starts)."""
    for total in range(size):
        for a, b in sorted(((a, total - a) for a in range(total + 1)), key=lambda ab: (abs(ab[0] - ab[1]), -ab[0])):
            if all(x == 0 or x <= a or x >= size - b for x in needed):
                return a, b
    raise AssertionError((needed, size))


@lru_cache(maxsize=256)
def short_plan(num_inner_rings: int, inner_ring: int, reach: int) -> tuple[tuple[int, int], dict[int, frozenset[int]]]:
    """Route of the short pass: ``(a, b)`` outer hops forward/backward, and for every outer offset ``o``
    the inner offsets ``t`` whose block ``(o, t)`` (:meth:`~loongtrain.parallel.layout.DoubleRing.source`)
    some member needs.

    Member ``(j, i)`` needs the ring positions ``p - d``, ``|d| <= reach``; ``p - d`` is held at outer
    step ``o = ceil((d - i) / inner_ring)`` and inner step ``t = d mod inner_ring``. So outer offset ``o`` (signed)
    needs the inner offsets ``d - o * inner_ring`` for ``d`` in ``[(o-1) inner_ring + 1, (o+1) inner_ring - 1]``
    within ``[-reach, reach]``, taken modulo the inner ring size (and ``o`` modulo the number of inner rings)."""
    n, w = num_inner_rings, inner_ring
    needed: dict[int, set[int]] = {}
    top = -(-reach // w)
    for o in range(-top, top + 1):
        lo, hi = max(-(w - 1), -reach - o * w), min(w - 1, reach - o * w)
        if lo <= hi:
            needed.setdefault(o % n, set()).update(t % w for t in range(lo, hi + 1))
    outer = _cover(frozenset(needed), n)
    return outer, {o: frozenset(ts) for o, ts in needed.items()}


def short_stages(num_inner_rings: int, inner_ring: int,
                 reach: int) -> list[tuple[int, tuple[int, int], frozenset[int]]]:
    """``(signed outer offset k, inner (a, b), needed inner offsets)`` of every block the outer walk visits."""
    (a, b), needed = short_plan(num_inner_rings, inner_ring, reach)
    out = []
    for k in [0, *range(1, a + 1), *range(-1, -b - 1, -1)]:
        ts = needed.get(k % num_inner_rings, frozenset())
        out.append((k, _cover(ts, inner_ring), ts))
    return out


def short_sends(ring: DoubleRing, reach: int) -> dict[tuple[Hop, int], int]:
    """K/V blocks a member sends per pass of the short pass of ``reach``, by ``(hop, direction)``
    (``+1``: to the next peer); backward, as many dK/dV partials go the opposite way."""
    (a, b), _ = short_plan(ring.num_inner_rings, ring.inner_ring, reach)
    sends: dict[tuple[Hop, int], int] = {("outer", 1): a, ("outer", -1): b, ("inner", 1): 0, ("inner", -1): 0}
    for _, (fwd, bwd), _ in short_stages(ring.num_inner_rings, ring.inner_ring, reach):
        sends["inner", 1] += fwd
        sends["inner", -1] += bwd
    return sends


def short_hops(ring: DoubleRing, reach: int) -> int:
    """Blocks a member sends per pass in the short pass of ``reach`` (dK/dV partials backward: as many)."""
    return sum(short_sends(ring, reach).values())
