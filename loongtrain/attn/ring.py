"""Zigzag (double-)ring attention: an executor of the ring schedule (docs/attention.md).

Tensors are ``[B, H, S_c, D]`` with ``S_c = S/cp`` a member's zigzag pair ``[front ; back]``. The order
of every transfer, compute and wait comes from :func:`loongtrain.attn.schedule.pass_events`; this module
hands each block to the step math and moves tensors through a :class:`Transport`:

- :class:`DistTransport`: one member per process, hops through
  :func:`loongtrain.parallel.comm.post_exchange` (so :class:`~loongtrain.parallel.comm.CommCounter` sees
  every byte);
- :class:`PostOffice`: all members of a ring in one process, hops are tensor hand-offs; each event is
  applied to every member before the next one (:func:`local_ring_forward`, :func:`local_ring_backward`).

The math of a step lives in :mod:`loongtrain.attn.ring_step` (:class:`~loongtrain.attn.ring_step.ForwardStep`,
:class:`~loongtrain.attn.ring_step.BackwardStep`): which local queries see which keys of the source's block is
decided from the global token positions of both zigzag blocks (:mod:`loongtrain.attn.masking`: causal,
documents, sliding window); the visible pieces become kernel calls (packed into variable-length calls where
the kernel has them), merged by log-sum-exp; a block with nothing visible costs nothing. Plain causal
attention gives one call per step: the own block -> causal; a source before the member -> all local queries
against the source's front half; a source after it -> the local back half against the whole block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from loongtrain.attn.kernel_choice import kernel_for
from loongtrain.attn.kernels import Kernel, for_head_dims
from loongtrain.attn.masking import AttnMask, Piece
from loongtrain.attn.ring_step import (
    BackwardStep,
    ForwardStep,
    KVBlock,
    PieceCalls,
    VarlenCall,
    acc_dtype,
    step_plans,
    whole_piece,
)
from loongtrain.attn.schedule import DKV_OWN, KV_OUTER, Compute, Event, Payload, Post, Wait, pass_events
from loongtrain.attn.short_pass import pass_reach
from loongtrain.attn.sinks import fold_sinks
from loongtrain.parallel.comm import Exchange, post_exchange
from loongtrain.parallel.layout import DoubleRing, Hop

Tensor = torch.Tensor


class Transport(Protocol):
    """One member's ring hops. ``post``: start sending ``tensor`` to the hop's next peer and receiving a
    same-shaped tensor from its previous peer (``direction=-1``: the other way round); ``wait``: the
    received tensor. No autograd (the ring's
    backward posts its own transfers)."""

    def post(self, hop: Hop, payload: Payload, tensor: Tensor, direction: int = 1) -> object: ...

    def wait(self, handle: object) -> Tensor: ...


@dataclass(frozen=True)
class Ring:
    """This rank's context ring: global ranks in ring order, its position, and one process group per
    (hop, payload) so no transfer queues behind another (``None`` where a hop class has one member)."""

    ranks: tuple[int, ...]
    position: int
    inner_ring: int
    inner_group: dist.ProcessGroup | None = None  # K/V inside an inner ring
    outer_group: dist.ProcessGroup | None = None  # K/V between inner rings
    inner_grad_group: dist.ProcessGroup | None = None  # dK/dV, same paths, own groups
    outer_grad_group: dist.ProcessGroup | None = None

    @property
    def geometry(self) -> DoubleRing:
        return DoubleRing(len(self.ranks) // self.inner_ring, self.inner_ring)

    def group(self, hop: Hop, payload: Payload) -> dist.ProcessGroup | None:
        if hop == "inner":
            return self.inner_group if payload == "kv" else self.inner_grad_group
        return self.outer_group if payload == "kv" else self.outer_grad_group

    def peer(self, hop: Hop, step: int) -> int:
        """Global rank ``step`` members away along ``hop`` (``+1`` next, ``-1`` previous)."""
        return self.ranks[self.geometry.peer(self.position, hop, step)]


@dataclass(frozen=True)
class RingCall:
    """What one ring attention call computes, on every member alike: its mask (causal, documents, sliding window,
    chunk order; checked where it was made), its softmax scale, and its kernel (None: the rule's or the measured one
    for the inputs, :func:`_kernel`)."""

    mask: AttnMask
    scale: float
    kernel: Kernel | None = None


class DistTransport:
    """Ring hops between processes, each through :func:`~loongtrain.parallel.comm.post_exchange`."""

    def __init__(self, ring: Ring) -> None:
        self.ring = ring

    def post(self, hop: Hop, payload: Payload, tensor: Tensor, direction: int = 1) -> Exchange:
        """Forward: async send to the hop's next rank (``direction=-1``: previous), async receive from the
        opposite one. No backward."""
        ring = self.ring
        group = ring.group(hop, payload)
        assert group is not None, (hop, payload, ring)
        return post_exchange(tensor, ring.peer(hop, direction), ring.peer(hop, -direction), group, payload)

    def wait(self, handle: Exchange) -> Tensor:
        return handle.wait()


class PostOffice:
    """Mailboxes of all members of one ring in one process; :meth:`transport` gives a member its hops.

    A post leaves the tensor itself (no copy) in the next peer's box, tagged with the sender's count of
    posts on that (hop, payload); every member posts the same sequence, so the receiver's own count
    names the message meant for it."""

    def __init__(self, geometry: DoubleRing) -> None:
        self.geometry = geometry
        self.boxes: dict[tuple, Tensor] = {}

    def transport(self, position: int) -> Transport:
        return _LocalTransport(self, position)


class _LocalTransport:
    def __init__(self, office: PostOffice, position: int) -> None:
        self.office, self.position = office, position
        self.sent: dict[tuple[Hop, Payload], int] = {}

    def post(self, hop: Hop, payload: Payload, tensor: Tensor, direction: int = 1) -> tuple:
        """Forward: hand ``tensor`` to the hop's next member (``direction=-1``: previous); the handle names
        what this member receives. No backward."""
        seq = self.sent.get((hop, payload, direction), 0)
        self.sent[(hop, payload, direction)] = seq + 1
        dst = self.office.geometry.peer(self.position, hop, direction)
        self.office.boxes[(dst, hop, payload, direction, seq)] = tensor
        return hop, payload, direction, seq

    def wait(self, handle: tuple) -> Tensor:
        key = (self.position, *handle)
        assert key in self.office.boxes, f"member {self.position} awaits {handle} before its sender posted it"
        return self.office.boxes.pop(key)


class _Member:
    """One ring member's registers and in-flight transfers while it runs the events of a pass."""

    def __init__(self, geometry: DoubleRing, position: int, transport: Transport, step, kv: Tensor) -> None:
        self.geometry, self.position, self.transport, self.step = geometry, position, transport, step
        self.registers: dict[str, Tensor] = {KV_OUTER: kv}
        self.in_flight: dict[str, object] = {}

    def apply(self, event: Event) -> None:
        regs = self.registers
        if isinstance(event, Post):
            self.in_flight[event.transfer] = self.transport.post(
                event.hop, event.payload, regs[event.register], event.direction)
        elif isinstance(event, Wait):
            received = self.transport.wait(self.in_flight.pop(event.transfer))
            regs[event.register] = regs[event.register] + received if event.add else received
        else:
            assert isinstance(event, Compute)
            src = self.geometry.source(self.position, event.outer, event.inner)
            contrib = self.step(src, regs[event.kv])
            if event.dkv is not None:
                regs[event.dkv] = contrib


def run_pass(geometry: DoubleRing, members: Sequence[_Member], backward: bool, reach: int | None = None) -> None:
    """Apply the pass's events in order, each to every member before the next event (``reach``: the
    short-window pass of :func:`~loongtrain.attn.schedule.pass_events`)."""
    for event in pass_events(geometry.num_inner_rings, geometry.inner_ring, backward, reach):
        for member in members:
            member.apply(event)
    assert all(not m.in_flight for m in members)


def _kernel(kernel: Kernel | None, q: Tensor, k: Tensor, v: Tensor) -> Kernel:
    """``kernel``, or the rule's / the measured one (docs/attention.md#kernels), for V's head dim (padded to Q/K's
    where the kernel needs one head dim: :func:`~loongtrain.attn.kernels.for_head_dims`)."""
    return for_head_dims(kernel or kernel_for(q, k, v), q.shape[-1], v.shape[-1])


def _whole(geometry: DoubleRing, mask: AttnMask, q: Tensor, kernel: Kernel) -> Piece | VarlenCall | None:
    """A ring of one member whose step is one kernel call: one full, causal or band piece over every row
    (:func:`whole_piece`), or one varlen call of every row in order (packed documents: ``VarlenCall.natural``).
    Its result is the step's as it is: no fp32 accumulator, no merge (docs/memory.md, "cp = 1")."""
    if geometry.size != 1:
        return None
    plans = step_plans(mask, q.shape[0], q.shape[2], 1, 0, q.device, kernel.varlen_forward is not None,
                       kernel.varlen_bottom_right, kernel.windowed)
    piece = whole_piece(plans.items(0), q.shape[2])
    if piece is not None:
        return piece
    plan = plans(0)
    if not plan.dense and len(plan.varlen) == 1 and plan.varlen[0].natural:
        return plan.varlen[0]
    return None


def _packed(x: Tensor) -> Tensor:
    """``[B, H, S, D]`` seen from ``[B, S, H, D]`` storage -> the varlen ops' ``[B*S, H, D]`` (a view there)."""
    b, h, s, d = x.shape
    return x.transpose(1, 2).reshape(b * s, h, d)


def _unpacked(x: Tensor, batch: int) -> Tensor:
    """``[B*S, H, D]`` -> ``[B, H, S, D]``, a view of ``[B, S, H, D]`` storage (the flash kernels' layout)."""
    t, h, d = x.shape
    return x.view(batch, t // batch, h, d).transpose(1, 2)


#: the band a whole piece is called with: never read (a whole piece is full, causal or band, never masked)
WHOLE_BAND = (0, 0)


def whole_forward(kernel: Kernel, whole: Piece | VarlenCall, q: Tensor, k: Tensor, v: Tensor,
                  scale: float) -> tuple[Tensor, Tensor]:
    """out ``[B, H, S, D]`` and lse ``[B, H, S]`` (contiguous) of :func:`_whole`'s one call."""
    if isinstance(whole, Piece):
        out, lse = PieceCalls(kernel, scale, WHOLE_BAND).forward(whole, q, k, v)
        return out, lse.contiguous()
    out, lse = kernel.varlen_forward(_packed(q), _packed(k), _packed(v), whole.seqlens, whole.mask(scale))
    h, b = lse.shape[0], q.shape[0]
    return _unpacked(out, b), lse.reshape(h, b, -1).transpose(0, 1).contiguous()


def _reach(geometry: DoubleRing, q: Tensor, mask: AttnMask) -> int | None:
    return pass_reach(geometry, q.shape[2] // 2, mask.sliding_window, zigzag=mask.chunk_order is None)


def ring_forward(q: Tensor, k: Tensor, v: Tensor, ring: Ring, call: RingCall, *,
                 sinks: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """out ``[B, H, S_c, Dv]`` (input dtype) and lse ``[B, H, S_c]`` (fp32, fp64 for fp64 inputs) of this
    rank's queries against every ring member's K/V under ``call`` (mask, scale, kernel); K/V blocks move round the
    ring (only as far as a short sliding window reaches). ``sinks [H]``: attention sinks, folded in once after the
    last merge (:func:`~loongtrain.attn.sinks.fold_sinks`; the returned out and lse include them, so
    :func:`ring_backward` with them gives dq, dk, dv as they are)."""
    mask, scale = call.mask, call.scale
    geometry = ring.geometry
    kernel = _kernel(call.kernel, q, k, v)
    whole = _whole(geometry, mask, q, kernel)
    if whole is not None:  # one call, no ring: the kernel's result, without the fp32 accumulators
        out, lse = whole_forward(kernel, whole, q, k, v, scale)
        lse = lse.to(acc_dtype(q.dtype))
        if sinks is not None:
            out, lse = fold_sinks(out, lse, sinks)
        return out.to(q.dtype), lse.contiguous()  # the accumulators' layout
    layout = KVBlock.of(k, v)
    step = ForwardStep(q, ring.position, mask, geometry.size, scale, kernel, layout)
    run_pass(geometry, [_Member(geometry, ring.position, DistTransport(ring), step, layout.pack(k, v))], False,
             _reach(geometry, q, mask))
    return step.result(sinks)


def ring_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, ring: Ring,
                  call: RingCall) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv (input dtype) for :func:`ring_forward`: K/V re-circulate, dK/dV ride behind to their owner."""
    dq, dkv = ring_backward_packed(dout, q, k, v, out, lse, ring, call)
    return (dq, *KVBlock.of(k, v).split(dkv))


def backward_workspace_bytes(tokens: float, heads: int, kv_heads: int, head_dim: int, dtype_bytes: int,
                             cp: int, v_head_dim: int | None = None) -> float:
    """Bytes :func:`ring_backward_packed` holds at its peak beyond its inputs and its results (dQ, packed
    dK/dV), for ``tokens`` local query tokens of ``heads`` heads against ``kv_heads`` (measured against the
    code: tests/unit/test_ring_workspace.py). The kernel's dQ, dK and dV of the piece being accumulated (at
    ``cp = 1`` the one call's dK and dV until they are packed: its dQ is the result), and with a ring (``cp > 1``) also
    the fp32 (fp64) dQ accumulator, three K/V blocks (in flight, received, being sent) in the input dtype
    and four dK/dV blocks (this block's contribution, the running sum, in flight, received) in the
    accumulators' dtype. ``v_head_dim`` (MLA; default ``head_dim``): a block holds K and V of their own head dims,
    and at ``cp = 1`` the one call runs on V, dO and O zero-padded to the wider head dim
    (:func:`~loongtrain.attn.kernels.for_head_dims`), whose copies and padded dV live until it returns. The
    kernel's own scratch is not included (FA2's: :data:`loongtrain.attn.cuda_kernels.SPLIT_BACKWARD_BYTES`)."""
    dv = v_head_dim or head_dim
    kv = tokens * kv_heads * (head_dim + dv)
    q = tokens * heads * head_dim
    if cp == 1:  # the flash kernels' dQ is the result itself; their dK and dV until packed
        if dv == head_dim:
            return kv * dtype_bytes
        width = max(head_dim, dv)
        kernel = tokens * (heads + 2 * kv_heads) * width  # its dQ, dK, dV at the padded width
        padded = tokens * width * ((heads + kv_heads) * (head_dim < width) + (2 * heads + kv_heads) * (dv < width))
        return (max(padded + kernel, kernel + kv) - q - kv) * dtype_bytes
    acc = max(4, dtype_bytes)
    return (q + kv) * dtype_bytes + acc * q + 3 * kv * dtype_bytes + 4 * kv * acc


def ring_backward_packed(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, ring: Ring,
                         call: RingCall) -> tuple[Tensor, Tensor]:
    """:func:`ring_backward` with dK and dV as one block (:class:`~loongtrain.attn.ring_step.KVBlock`, k's dtype)."""
    mask, scale = call.mask, call.scale
    geometry = ring.geometry
    kernel = _kernel(call.kernel, q, k, v)
    whole = _whole(geometry, mask, q, kernel)
    if whole is not None:  # one call, no ring: dq, dk, dv as the kernel gives them, no fp32 accumulators
        return whole_backward(kernel, whole, dout, q, k, v, out, lse, scale)
    step = BackwardStep(dout, q, out, lse, ring.position, mask, geometry.size, scale, kernel)
    member = _Member(geometry, ring.position, DistTransport(ring), step, KVBlock.of(k, v).pack(k, v))
    run_pass(geometry, [member], True, _reach(geometry, q, mask))
    return step.dq.to(q.dtype), member.registers[DKV_OWN].to(k.dtype)


def whole_backward(kernel: Kernel, whole: Piece | VarlenCall, dout: Tensor, q: Tensor, k: Tensor, v: Tensor,
                   out: Tensor, lse: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """A ring of one member's backward: :func:`_whole`'s one kernel call, its results in the accumulators'
    layout (dQ ``[B, H, S, D]`` seen from ``[B, S, H, D]`` storage, as the flash kernels give it: otherwise
    copied into it; dK/dV packed in one block)."""
    if isinstance(whole, Piece):
        dq, dk, dv = PieceCalls(kernel, scale, WHOLE_BAND).backward(whole, dout, q, k, v, out, lse)
    else:
        b = q.shape[0]
        packed_lse = lse.transpose(0, 1).reshape(lse.shape[1], -1).contiguous()  # [H, B*S]
        grads = kernel.varlen_backward(_packed(dout), _packed(q), _packed(k), _packed(v), _packed(out), packed_lse,
                                       whole.seqlens, whole.mask(scale))
        dq, dk, dv = (_unpacked(g, b) for g in grads)
    dq = dq.to(q.dtype)
    if not dq.transpose(1, 2).is_contiguous():
        dq = token_major(dq)
    return dq, KVBlock.of(k, v).pack(dk, dv, k.dtype)


def token_major(x: Tensor) -> Tensor:
    """``x [B, H, S, D]`` copied into ``[B, S, H, D]`` storage (the op's result layout), seen as ``[B, H, S, D]``."""
    b, h, s, d = x.shape
    return x.new_empty((b, s, h, d)).transpose(1, 2).copy_(x)


def _local_members(
    inner_ring: int, steps: Sequence, ks: Sequence[Tensor], vs: Sequence[Tensor],
    transports: Sequence[Transport] | None,
) -> tuple[DoubleRing, list[_Member]]:
    cp = len(steps)
    assert cp % inner_ring == 0 and len(ks) == len(vs) == cp, (cp, inner_ring, len(ks), len(vs))
    geometry = DoubleRing(cp // inner_ring, inner_ring)
    if transports is None:
        office = PostOffice(geometry)
        transports = [office.transport(p) for p in range(cp)]
    assert len(transports) == cp, (len(transports), cp)
    members = [_Member(geometry, p, transports[p], steps[p], KVBlock.of(ks[p], vs[p]).pack(ks[p], vs[p]))
               for p in range(cp)]
    return geometry, members


def local_ring_forward(
    qs: Sequence[Tensor], ks: Sequence[Tensor], vs: Sequence[Tensor], inner_ring: int, call: RingCall,
    transports: Sequence[Transport] | None = None, *, sinks: Tensor | None = None,
) -> list[tuple[Tensor, Tensor]]:
    """:func:`ring_forward` of all ``cp = len(qs)`` members of one ring in this process (``qs[p]``: member
    ``p``'s zigzag shard ``[B, H, S_c, D]``); returns each member's ``(out, lse)``. ``transports``: one per
    member (default: hand-offs through one :class:`PostOffice`)."""
    mask, cp = call.mask, len(qs)
    steps = [ForwardStep(q, p, mask, cp, call.scale, _kernel(call.kernel, q, ks[p], vs[p]), KVBlock.of(ks[p], vs[p]))
             for p, q in enumerate(qs)]
    geometry, members = _local_members(inner_ring, steps, ks, vs, transports)
    run_pass(geometry, members, False, _reach(geometry, qs[0], mask))
    return [s.result(sinks) for s in steps]


def local_ring_backward(
    douts: Sequence[Tensor], qs: Sequence[Tensor], ks: Sequence[Tensor], vs: Sequence[Tensor],
    outs: Sequence[Tensor], lses: Sequence[Tensor], inner_ring: int, call: RingCall,
    transports: Sequence[Transport] | None = None,
) -> list[tuple[Tensor, Tensor, Tensor]]:
    """:func:`ring_backward` of all members of one ring in this process; returns each member's dq, dk, dv."""
    mask, cp = call.mask, len(qs)
    steps = [BackwardStep(douts[p], q, outs[p], lses[p], p, mask, cp, call.scale,
                          _kernel(call.kernel, q, ks[p], vs[p])) for p, q in enumerate(qs)]
    geometry, members = _local_members(inner_ring, steps, ks, vs, transports)
    run_pass(geometry, members, True, _reach(geometry, qs[0], mask))
    out = []
    for s, m, q, k, v in zip(steps, members, qs, ks, vs):
        dk, dv = KVBlock.of(k, v).split(m.registers[DKV_OWN])
        out.append((s.dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)))
    return out
