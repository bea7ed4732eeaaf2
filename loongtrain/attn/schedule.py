"""The (double-)ring pass as data: one description, run by ``attn/ring.py`` and simulated by the planner
(docs/attention.md#the-ring-schedule).

A context ring of ``size = num_inner_rings * inner_ring`` members is cut into ``num_inner_rings`` inner rings of
``inner_ring`` consecutive members; member ``p`` is ``(j, i) = divmod(p, inner_ring)``. Inner hops go round a
inner_ring, outer hops go to the same position of the next inner ring. At outer step ``o`` and inner step ``t``
member ``(j, i)`` holds the K/V block of member ``((j - o) mod n, (i - t) mod inner_ring)`` (:meth:`DoubleRing.source`).

A pass is a list of events, the same for every member (a member only adds its own position):

- :class:`Post` sends a register's tensor to the hop's next peer and receives a same-shaped tensor from
  the hop's previous peer (the transfer is named so a later :class:`Wait` can find it);
- :class:`Compute` runs the attention kernel on the K/V block in ``kv`` (backward: stores the block's
  dK/dV contribution in ``dkv``);
- :class:`Wait` blocks until a transfer has arrived and stores (or adds) what was received in a register.

Forward: the outer K/V hop is posted at the start of an outer step and awaited after its ``inner_ring`` inner
steps; each inner hop is posted before the step's compute and awaited after it. Backward: the same
K/V moves, and dK/dV partial sums travel *behind* the blocks along the same path to their owner: after
step ``t > 0`` a member adds the partial received for the block it holds and passes it on (inner hop);
an inner ring's last inner dK/dV hop is awaited only after the next block's compute (deferred), then the
inner_ring's sum goes one outer hop. ``inner_ring - 1`` inner and ``1`` outer dK/dV hop per outer step, ``cp - 1``
in all, like K/V.

A sliding window shorter than a few chunks needs only the blocks of nearby members: the short pass
walks K/V only the outer and inner hops that reach them (``2 r`` on a single ring) instead of ``cp - 1``.
Its route (:func:`pass_reach`, :func:`short_plan`, :func:`short_sends`) is in ``attn/short_pass.py``;
:func:`_short_pass` turns it into events.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

from loongtrain.attn.short_pass import short_hops, short_plan, short_stages
from loongtrain.parallel.layout import DoubleRing, Hop

Payload = Literal["kv", "dkv"]
PAYLOADS: tuple[Payload, ...] = ("kv", "dkv")

# registers a member keeps between events (names used by the events below)
KV_OUTER = "kv_outer"  # the block received by the last outer hop (at the start: the member's own K/V)
KV_INNER = "kv_inner"  # the block received by the last inner hop
DKV_OWN = "dkv_own"  # dK/dV of the member's own block: the pass's result
DKV_CHAIN = "dkv_chain"  # partial dK/dV passed along an inner ring


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


def _inner_ring_register(outer: int) -> str:
    """Register of an inner ring's dK/dV sum; two alternate, because inner ring ``o``'s sum is finished after the
    first compute of inner ring ``o + 1``."""
    return DKV_OWN if outer == 0 else f"dkv_window{outer % 2}"


def _short_pass(ring: DoubleRing, backward: bool, reach: int) -> tuple[Event, ...]:
    """The pass that brings each member the blocks of the members at most ``reach`` ring positions away
    (:func:`short_plan`): K/V walk ``a`` outer hops forward and ``b`` back; each block an outer walk
    reaches (and the member's own) then walks its inner hops both ways, and every needed block is
    computed as it arrives (a block only relayed is not). Backward, each block's dK/dV partial retraces
    its path to the owner after the last compute, each member adding its share: inner partials into the
    block they came from, then outer partials into the previous outer block, ending in ``dkv_own``.

    Registers: ``kv_outer_f``/``kv_outer_b`` (block after ``k`` outer hops forward/back), ``kv_inner_f``/
    ``kv_inner_b``; ``dkv_o{k}`` (partial of the block after ``k`` outer hops, ``dkv_own`` for 0) and
    ``dkv_o{k}f{t}``/``dkv_o{k}b{t}`` (its inner walk's partials)."""
    n, w = ring.num_inner_rings, ring.inner_ring
    (out_a, out_b), _ = short_plan(n, w, reach)
    stages = {k: (inner, ts) for k, inner, ts in short_stages(n, w, reach)}
    assert short_hops(ring, reach) < ring.size - 1, (reach, ring)
    events: list[Event] = []
    written: set[str] = set()

    def base_dkv(k: int) -> str:
        return DKV_OWN if k == 0 else f"dkv_o{k}"

    def compute(o: int, t: int, kv: str, dkv: str) -> None:
        events.append(Compute(o, t, kv, dkv if backward else None))
        written.add(dkv)

    def walk(k: int, base: str) -> None:  # inner hops from the block held after k outer hops
        (a, b), ts = stages[k]
        o = k % n
        for t in range(max(a, b) + 1):
            if t < a:
                events.append(Post(f"kv.{k}.f{t + 1}", "inner", "kv", base if t == 0 else "kv_inner_f", 1))
            if t < b:
                events.append(Post(f"kv.{k}.b{t + 1}", "inner", "kv", base if t == 0 else "kv_inner_b", -1))
            if t == 0:
                if 0 in ts:
                    compute(o, 0, base, base_dkv(k))
            else:
                if t <= a and t in ts:
                    compute(o, t, "kv_inner_f", f"dkv_o{k}f{t}")
                if t <= b and (-t) % w in ts:
                    compute(o, (-t) % w, "kv_inner_b", f"dkv_o{k}b{t}")
            if t < a:
                events.append(Wait(f"kv.{k}.f{t + 1}", "kv_inner_f"))
            if t < b:
                events.append(Wait(f"kv.{k}.b{t + 1}", "kv_inner_b"))

    def receive(transfer: str, register: str) -> None:
        events.append(Wait(transfer, register, add=register in written))
        written.add(register)

    def walk_back(k: int) -> None:  # inner partials of stage k back into its base block's partial
        (a, b), _ = stages[k]
        for t in range(max(a, b), 0, -1):
            if t <= a:
                events.append(Post(f"dkv.{k}.f{t}", "inner", "dkv", f"dkv_o{k}f{t}", -1))
            if t <= b:
                events.append(Post(f"dkv.{k}.b{t}", "inner", "dkv", f"dkv_o{k}b{t}", 1))
            if t <= a:
                receive(f"dkv.{k}.f{t}", f"dkv_o{k}f{t - 1}" if t > 1 else base_dkv(k))
            if t <= b:
                receive(f"dkv.{k}.b{t}", f"dkv_o{k}b{t - 1}" if t > 1 else base_dkv(k))

    if out_a:
        events.append(Post("kv.outer.f1", "outer", "kv", KV_OUTER, 1))
    if out_b:
        events.append(Post("kv.outer.b1", "outer", "kv", KV_OUTER, -1))
    walk(0, KV_OUTER)
    for level in range(1, max(out_a, out_b) + 1):
        for sign, limit, reg, tag in ((1, out_a, "kv_outer_f", "f"), (-1, out_b, "kv_outer_b", "b")):
            if level <= limit:
                events.append(Wait(f"kv.outer.{tag}{level}", reg))
                if level < limit:
                    events.append(Post(f"kv.outer.{tag}{level + 1}", "outer", "kv", reg, sign))
                walk(sign * level, reg)
    if backward:
        for level in range(max(out_a, out_b), 0, -1):
            sides = [(sign * level, -sign) for sign, limit in ((1, out_a), (-1, out_b)) if level <= limit]
            for k, _ in sides:
                walk_back(k)
            for k, direction in sides:
                events.append(Post(f"dkv.outer.{k}", "outer", "dkv", base_dkv(k), direction))
            for k, direction in sides:
                receive(f"dkv.outer.{k}", base_dkv(k + direction))
        walk_back(0)
    return tuple(events)


@lru_cache(maxsize=256)
def pass_events(num_inner_rings: int, inner_ring: int, backward: bool, reach: int | None = None) -> tuple[Event, ...]:
    """The events of one forward (or backward) pass round a double ring, in the order every member runs them.
    ``reach`` (from :func:`pass_reach`): the short pass of a short sliding window instead."""
    ring = DoubleRing(num_inner_rings, inner_ring)
    if reach is not None:
        return _short_pass(ring, backward, reach)
    events: list[Event] = []
    chain: str | None = None  # dK/dV inner hop this member will receive next
    deferred: tuple[int, str | None] | None = None  # (outer step, its last inner dK/dV hop)
    grad_out: str | None = None  # dK/dV outer hop in flight

    def finish_window(outer: int, last_inner: str | None) -> None:
        nonlocal grad_out
        register = _inner_ring_register(outer)
        if last_inner is not None:  # the rest of the inner ring's sum for the block held at (outer, 0)
            events.append(Wait(last_inner, register, add=True))
        if outer > 0:
            if grad_out is not None:
                events.append(Wait(grad_out, register, add=True))
            grad_out = f"dkv.outer.{outer}"
            events.append(Post(grad_out, "outer", "dkv", register))

    for o in range(ring.num_inner_rings):
        outer_kv = f"kv.outer.{o}" if o < ring.num_inner_rings - 1 else None
        if outer_kv is not None:
            events.append(Post(outer_kv, "outer", "kv", KV_OUTER))
        for t in range(ring.inner_ring):
            block = KV_OUTER if t == 0 else KV_INNER
            inner_kv = f"kv.inner.{o}.{t}" if t < ring.inner_ring - 1 else None
            if inner_kv is not None:
                events.append(Post(inner_kv, "inner", "kv", block))
            if not backward:
                events.append(Compute(o, t, block))
            else:
                events.append(Compute(o, t, block, _inner_ring_register(o) if t == 0 else DKV_CHAIN))
                if deferred is not None:
                    finish_window(*deferred)
                    deferred = None
                if t > 0:
                    if chain is not None:  # the partial from the block's previous holder
                        events.append(Wait(chain, DKV_CHAIN, add=True))
                    chain = f"dkv.inner.{o}.{t}"
                    events.append(Post(chain, "inner", "dkv", DKV_CHAIN))
                if t == ring.inner_ring - 1:
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
