"""The (double-)ring pass as data: one description, run by ``attn/ring.py`` and simulated by the planner
(docs/design.md §4).

A context ring of ``size = num_windows * window`` members is cut into ``num_windows`` windows of
``window`` consecutive members; member ``p`` is ``(j, i) = divmod(p, window)``. Inner hops go round a
window, outer hops go to the same position of the next window. At outer step ``o`` and inner step ``t``
member ``(j, i)`` holds the K/V block of member ``((j - o) mod n, (i - t) mod window)`` (:meth:`DoubleRing.source`).

A pass is a list of events, the same for every member (a member only adds its own position):

- :class:`Post` sends a register's tensor to the hop's next peer and receives a same-shaped tensor from
  the hop's previous peer (the transfer is named so a later :class:`Wait` can find it);
- :class:`Compute` runs the attention kernel on the K/V block in ``kv`` (backward: stores the block's
  dK/dV contribution in ``dkv``);
- :class:`Wait` blocks until a transfer has arrived and stores (or adds) what was received in a register.

Forward: the outer K/V hop is posted at the start of an outer step and awaited after its ``window`` inner
steps; each inner hop is posted before the step's compute and awaited after it. Backward: the same
K/V moves, and dK/dV partial sums travel *behind* the blocks along the same path to their owner: after
step ``t > 0`` a member adds the partial received for the block it holds and passes it on (inner hop);
a window's last inner dK/dV hop is awaited only after the next block's compute (deferred), then the
window's sum goes one outer hop. ``window - 1`` inner and ``1`` outer dK/dV hop per outer step, ``cp - 1``
in all, like K/V.

A sliding window shorter than a few chunks needs only the blocks of nearby members: the short pass
(:func:`pass_reach`, :func:`_short_pass`) sends ``2 r`` blocks each way instead of ``cp - 1``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

Hop = Literal["inner", "outer"]
Payload = Literal["kv", "dkv"]
HOPS: tuple[Hop, ...] = ("inner", "outer")
PAYLOADS: tuple[Payload, ...] = ("kv", "dkv")

# registers a member keeps between events (names used by the events below)
KV_OUTER = "kv_outer"  # the block received by the last outer hop (at the start: the member's own K/V)
KV_INNER = "kv_inner"  # the block received by the last inner hop
DKV_OWN = "dkv_own"  # dK/dV of the member's own block: the pass's result
DKV_CHAIN = "dkv_chain"  # partial dK/dV passed along a window


@dataclass(frozen=True)
class DoubleRing:
    """Position arithmetic of a double ring: ``num_windows`` windows of ``window`` members."""

    num_windows: int
    window: int

    def __post_init__(self) -> None:
        assert self.num_windows >= 1 and self.window >= 1, self

    @property
    def size(self) -> int:
        return self.num_windows * self.window

    def peer(self, position: int, hop: Hop, step: int) -> int:
        """Position ``step`` members away along ``hop`` (``+1``: next, ``-1``: previous)."""
        j, i = divmod(position, self.window)
        if hop == "inner":
            i = (i + step) % self.window
        else:
            j = (j + step) % self.num_windows
        return j * self.window + i

    def cycle(self, position: int, hop: Hop) -> list[int]:
        """Positions of the ``hop`` cycle through ``position`` (its window, or its column across the
        windows), in ring order starting from the cycle's first member."""
        n = self.window if hop == "inner" else self.num_windows
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
        j, i = divmod(position, self.window)
        return ((j - outer) % self.num_windows) * self.window + (i - inner) % self.window


@dataclass(frozen=True)
class Post:
    """Send register ``register`` to the next peer on ``hop`` and receive from the previous one
    (``direction=-1``: to the previous, from the next)."""

    transfer: str
    hop: Hop
    payload: Payload
    register: str
    direction: int = 1


@dataclass(frozen=True)
class Compute:
    """Attention of the local queries against the block in ``kv`` held at ``(outer, inner)``;
    backward: the block's dK/dV contribution goes to register ``dkv`` (forward: ``None``)."""

    outer: int
    inner: int
    kv: str
    dkv: str | None = None


@dataclass(frozen=True)
class Wait:
    """Block until ``transfer`` has arrived; put the received tensor in ``register``, or add it to the
    register's tensor when ``add``."""

    transfer: str
    register: str
    add: bool = False


Event = Post | Compute | Wait


def _window_register(outer: int) -> str:
    """Register of a window's dK/dV sum; two alternate, because window ``o``'s sum is finished after the
    first compute of window ``o + 1``."""
    return DKV_OWN if outer == 0 else f"dkv_window{outer % 2}"


def pass_reach(ring: DoubleRing, chunk: int, sliding_window: int | None) -> int | None:
    """``r`` when a short sliding window lets the pass stop early, else ``None`` (the full pass).

    Under zigzag (docs/design.md §3) a query sees keys at most ``w - 1`` positions away, i.e. at most
    ``r = ceil((w - 1) / chunk)`` chunks away, and those chunks belong to the ring members at most ``r``
    positions away in ring order. The short pass (:func:`pass_events` with ``reach=r``) brings exactly
    those blocks, ``r`` hops each way: worth it when ``2 r < cp - 1``. It needs ring order to be one hop
    class, so it runs on a single ring (one window, or windows of one member) and a double ring with
    ``1 < window < cp`` keeps the full pass (and skips the invisible blocks' compute)."""
    if sliding_window is None or (ring.num_windows > 1 and ring.window > 1):
        return None
    r = -(-(sliding_window - 1) // chunk)
    return r if 2 * r < ring.size - 1 else None


def _short_pass(ring: DoubleRing, backward: bool, reach: int) -> tuple[Event, ...]:
    """The pass that brings each member the blocks of the members at most ``reach`` ring positions away:
    ``reach`` K/V hops forward and ``reach`` backward, computing each block as it arrives; backward, the
    dK/dV partial of a block then rides ``reach`` hops back to its owner, each member adding its share.

    Registers: ``kv_fwd``/``kv_bwd`` (the block from ``t`` members before/after), ``dkv_fwd{t}``/
    ``dkv_bwd{t}`` (the partial for that block)."""
    assert ring.num_windows == 1 or ring.window == 1, ring
    assert 0 <= reach and 2 * reach < ring.size - 1, (reach, ring)
    hop: Hop = "inner" if ring.num_windows == 1 else "outer"

    def at(offset: int) -> tuple[int, int]:  # (outer, inner) of the source ``offset`` members before
        return (0, offset % ring.size) if hop == "inner" else (offset % ring.size, 0)

    events: list[Event] = []
    for t in range(reach + 1):
        if t < reach:
            events.append(Post(f"kv.fwd.{t + 1}", hop, "kv", KV_OUTER if t == 0 else "kv_fwd", 1))
            events.append(Post(f"kv.bwd.{t + 1}", hop, "kv", KV_OUTER if t == 0 else "kv_bwd", -1))
        if t == 0:
            events.append(Compute(*at(0), KV_OUTER, DKV_OWN if backward else None))
        else:
            events.append(Compute(*at(t), "kv_fwd", f"dkv_fwd{t}" if backward else None))
            events.append(Compute(*at(-t), "kv_bwd", f"dkv_bwd{t}" if backward else None))
        if t < reach:
            events.append(Wait(f"kv.fwd.{t + 1}", "kv_fwd"))
            events.append(Wait(f"kv.bwd.{t + 1}", "kv_bwd"))
    if backward:
        for t in range(reach, 0, -1):
            events.append(Post(f"dkv.fwd.{t}", hop, "dkv", f"dkv_fwd{t}", -1))
            events.append(Post(f"dkv.bwd.{t}", hop, "dkv", f"dkv_bwd{t}", 1))
            events.append(Wait(f"dkv.fwd.{t}", f"dkv_fwd{t - 1}" if t > 1 else DKV_OWN, add=True))
            events.append(Wait(f"dkv.bwd.{t}", f"dkv_bwd{t - 1}" if t > 1 else DKV_OWN, add=True))
    return tuple(events)


@lru_cache(maxsize=256)
def pass_events(num_windows: int, window: int, backward: bool, reach: int | None = None) -> tuple[Event, ...]:
    """The events of one forward (or backward) pass round a double ring, in the order every member runs them.
    ``reach`` (from :func:`pass_reach`): the short pass of a short sliding window instead."""
    ring = DoubleRing(num_windows, window)
    if reach is not None:
        return _short_pass(ring, backward, reach)
    events: list[Event] = []
    chain: str | None = None  # dK/dV inner hop this member will receive next
    deferred: tuple[int, str | None] | None = None  # (outer step, its last inner dK/dV hop)
    grad_out: str | None = None  # dK/dV outer hop in flight

    def finish_window(outer: int, last_inner: str | None) -> None:
        nonlocal grad_out
        register = _window_register(outer)
        if last_inner is not None:  # the rest of the window's sum for the block held at (outer, 0)
            events.append(Wait(last_inner, register, add=True))
        if outer > 0:
            if grad_out is not None:
                events.append(Wait(grad_out, register, add=True))
            grad_out = f"dkv.outer.{outer}"
            events.append(Post(grad_out, "outer", "dkv", register))

    for o in range(ring.num_windows):
        outer_kv = f"kv.outer.{o}" if o < ring.num_windows - 1 else None
        if outer_kv is not None:
            events.append(Post(outer_kv, "outer", "kv", KV_OUTER))
        for t in range(ring.window):
            block = KV_OUTER if t == 0 else KV_INNER
            inner_kv = f"kv.inner.{o}.{t}" if t < ring.window - 1 else None
            if inner_kv is not None:
                events.append(Post(inner_kv, "inner", "kv", block))
            if not backward:
                events.append(Compute(o, t, block))
            else:
                events.append(Compute(o, t, block, _window_register(o) if t == 0 else DKV_CHAIN))
                if deferred is not None:
                    finish_window(*deferred)
                    deferred = None
                if t > 0:
                    if chain is not None:  # the partial from the block's previous holder
                        events.append(Wait(chain, DKV_CHAIN, add=True))
                    chain = f"dkv.inner.{o}.{t}"
                    events.append(Post(chain, "inner", "dkv", DKV_CHAIN))
                if t == ring.window - 1:
                    deferred, chain = (o, chain), None
            if inner_kv is not None:
                events.append(Wait(inner_kv, KV_INNER))
        if outer_kv is not None:
            events.append(Wait(outer_kv, KV_OUTER))
    if deferred is not None:
        finish_window(*deferred)
    if grad_out is not None:
        events.append(Wait(grad_out, DKV_OWN, add=True))
    return tuple(events)
