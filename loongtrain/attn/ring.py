"""Zigzag (double-)ring attention: an executor of the ring schedule (docs/design.md §4, §3).

Tensors are ``[B, H, S_c, D]`` with ``S_c = S/cp`` a member's zigzag pair ``[front ; back]``. The order
of every transfer, compute and wait comes from :func:`loongtrain.attn.schedule.pass_events`; this module
only supplies the math of a step and moves tensors through a :class:`Transport`:

- :class:`DistTransport`: one member per process, hops through
  :func:`loongtrain.parallel.comm.post_exchange` (so :class:`~loongtrain.parallel.comm.CommCounter` sees
  every byte);
- :class:`PostOffice`: all members of a ring in one process, hops are tensor hand-offs; each event is
  applied to every member before the next one (:func:`local_ring_forward`, :func:`local_ring_backward`).

Step math: which local queries see which keys of the source's block is decided from the global token
positions of both zigzag blocks (:mod:`loongtrain.attn.masking`: causal, documents, sliding window); each
visible piece is one kernel call, merged by log-sum-exp; a block with nothing visible costs nothing. Plain
causal attention gives one call per step: the own block -> causal; a source before the member -> all
local queries against the source's front half; a source after it -> the local back half against the
whole block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from loongtrain.attn.kernels import Kernel, reference_backward, reference_forward, select_kernel
from loongtrain.attn.masking import AttnMask, Piece, member_runs, piece_mask, visible_pieces
from loongtrain.attn.schedule import (
    DKV_OWN,
    KV_OUTER,
    Compute,
    DoubleRing,
    Event,
    Hop,
    Payload,
    Post,
    Wait,
    pass_events,
    pass_reach,
)
from loongtrain.parallel.comm import Exchange, post_exchange

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
    window: int
    inner_group: dist.ProcessGroup | None = None  # K/V inside a window
    outer_group: dist.ProcessGroup | None = None  # K/V between windows
    inner_grad_group: dist.ProcessGroup | None = None  # dK/dV, same paths, own groups
    outer_grad_group: dist.ProcessGroup | None = None

    @property
    def geometry(self) -> DoubleRing:
        return DoubleRing(len(self.ranks) // self.window, self.window)

    def group(self, hop: Hop, payload: Payload) -> dist.ProcessGroup | None:
        if hop == "inner":
            return self.inner_group if payload == "kv" else self.inner_grad_group
        return self.outer_group if payload == "kv" else self.outer_grad_group

    def peer(self, hop: Hop, step: int) -> int:
        """Global rank ``step`` members away along ``hop`` (``+1`` next, ``-1`` previous)."""
        return self.ranks[self.geometry.peer(self.position, hop, step)]


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
    for event in pass_events(geometry.num_windows, geometry.window, backward, reach):
        for member in members:
            member.apply(event)
    assert all(not m.in_flight for m in members)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _merge(out_acc: Tensor, lse_acc: Tensor, out_blk: Tensor, lse_blk: Tensor) -> None:
    """In place: combine two partial softmax results by their log-sum-exp, in the accumulators' dtype."""
    lse_blk = lse_blk.to(lse_acc.dtype)
    new_lse = torch.logaddexp(lse_acc, lse_blk)
    out_acc.mul_(torch.exp(lse_acc - new_lse).unsqueeze(-1))
    out_acc.add_(out_blk.to(out_acc.dtype) * torch.exp(lse_blk - new_lse).unsqueeze(-1))
    lse_acc.copy_(new_lse)


def _piece_forward(kernel: Kernel, piece: Piece, band: tuple[int, int], q: Tensor, k: Tensor, v: Tensor,
                   scale: float) -> tuple[Tensor, Tensor]:
    """(out, lse) of one piece (rows ``q``, columns ``k``/``v`` already cut out)."""
    if piece.kind == "full":
        return kernel.forward(q, k, v, False, scale)
    if piece.kind == "causal":
        return kernel.forward(q, k, v, True, scale)
    if piece.kind == "anticausal":  # reversed on both sides, it is the top-left causal square
        out, lse = kernel.forward(q.flip(2), k.flip(2), v.flip(2), True, scale)
        return out.flip(2), lse.flip(-1)
    acc = _acc_dtype(q.dtype)
    mask = piece_mask(piece, band, q.device)
    return reference_forward(q.to(acc), k.to(acc), v.to(acc), False, scale, mask)


def _piece_backward(kernel: Kernel, piece: Piece, band: tuple[int, int], dout: Tensor, q: Tensor, k: Tensor,
                    v: Tensor, out: Tensor, lse: Tensor, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of one piece, given the rows' final out and lse."""
    if piece.kind in ("full", "causal"):
        return kernel.backward(dout, q, k, v, out, lse, piece.kind == "causal", scale)
    if piece.kind == "anticausal":
        dq, dk, dv = kernel.backward(dout.flip(2), q.flip(2), k.flip(2), v.flip(2), out.flip(2), lse.flip(-1),
                                     True, scale)
        return dq.flip(2), dk.flip(2), dv.flip(2)
    acc = _acc_dtype(q.dtype)
    mask = piece_mask(piece, band, q.device)
    return reference_backward(*(t.to(acc) for t in (dout, q, k, v, out, lse)), False, scale, mask)


class _Pieces:
    """What a member computes against each source's block: per group of batch rows, the
    :func:`~loongtrain.attn.masking.visible_pieces` of its runs (zigzag, or ``mask.chunk_order``) against
    the source's."""

    def __init__(self, mask: AttnMask, batch: int, block_len: int, cp: int, position: int) -> None:
        self.mask, self.band, self.cp, self.seq_len = mask, mask.band(), cp, block_len * cp
        self.groups = mask.row_groups(batch)
        self.q_runs = member_runs(self.seq_len, cp, position, mask.chunk_order)

    def __call__(self, src: int) -> list[tuple[slice, Piece]]:
        k_runs = member_runs(self.seq_len, self.cp, src, self.mask.chunk_order)
        return [(rows, piece) for rows, cu in self.groups
                for piece in visible_pieces(self.q_runs, k_runs, cu, self.band, self.mask.causal, self.mask.tiny)]


class _ForwardStep:
    """Online-softmax accumulation of one member's queries over the blocks it is handed; a block none of
    whose keys a local query sees costs nothing (no kernel call, no merge)."""

    def __init__(self, q: Tensor, position: int, mask: AttnMask, cp: int, scale: float, kernel: Kernel) -> None:
        self.q, self.scale, self.kernel = q, scale, kernel
        self.pieces = _Pieces(mask, q.shape[0], q.shape[2], cp, position)
        acc = _acc_dtype(q.dtype)
        self.out = torch.zeros(q.shape, dtype=acc, device=q.device)
        self.lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)

    def __call__(self, src: int, block: Tensor) -> None:
        band = self.pieces.band
        for rows, p in self.pieces(src):
            out, lse = _piece_forward(self.kernel, p, band, self.q[rows, :, p.r0:p.r1],
                                      block[0][rows, :, p.c0:p.c1], block[1][rows, :, p.c0:p.c1], self.scale)
            _merge(self.out[rows, :, p.r0:p.r1], self.lse[rows, :, p.r0:p.r1], out, lse)

    def result(self) -> tuple[Tensor, Tensor]:
        return self.out.to(self.q.dtype), self.lse


class _BackwardStep:
    """dQ accumulation of one member; returns each block's dK/dV contribution ``[2, B, Hkv, S_c, D]``
    (zeros, without a kernel call, for a block no local query sees)."""

    def __init__(self, dout: Tensor, q: Tensor, out: Tensor, lse: Tensor, position: int, mask: AttnMask,
                 cp: int, scale: float, kernel: Kernel) -> None:
        self.dout, self.q, self.out, self.lse = dout, q, out, lse
        self.scale, self.kernel = scale, kernel
        self.pieces = _Pieces(mask, q.shape[0], q.shape[2], cp, position)
        self.dq = torch.zeros(q.shape, dtype=_acc_dtype(q.dtype), device=q.device)

    def __call__(self, src: int, block: Tensor) -> Tensor:
        contrib = torch.zeros(block.shape, dtype=self.dq.dtype, device=block.device)
        band = self.pieces.band
        for rows, p in self.pieces(src):
            r, c = slice(p.r0, p.r1), slice(p.c0, p.c1)
            dq, dk, dv = _piece_backward(
                self.kernel, p, band, self.dout[rows, :, r], self.q[rows, :, r], block[0][rows, :, c],
                block[1][rows, :, c], self.out[rows, :, r], self.lse[rows, :, r], self.scale,
            )
            self.dq[rows, :, r].add_(dq)
            contrib[0, rows, :, c].add_(dk)
            contrib[1, rows, :, c].add_(dv)
        return contrib


def _kernel(kernel: Kernel | None, q: Tensor) -> Kernel:
    return kernel or select_kernel(q.device, q.dtype, q.shape[-1])


def _reach(geometry: DoubleRing, q: Tensor, mask: AttnMask) -> int | None:
    if mask.chunk_order is not None:  # the short pass relies on zigzag's neighbourhoods
        return None
    return pass_reach(geometry, q.shape[2] // 2, mask.window)


def ring_forward(
    q: Tensor, k: Tensor, v: Tensor, ring: Ring, causal: bool, scale: float, kernel: Kernel | None = None,
    *, mask: AttnMask | None = None,
) -> tuple[Tensor, Tensor]:
    """out ``[B, H, S_c, D]`` (input dtype) and lse ``[B, H, S_c]`` (fp32, fp64 for fp64 inputs) of this
    rank's queries against every ring member's K/V; K/V blocks move round the ring (only as far as a
    short sliding window reaches). ``mask`` (documents, window) replaces ``causal`` when given."""
    mask = mask or AttnMask(causal)
    geometry = ring.geometry
    step = _ForwardStep(q, ring.position, mask, geometry.size, scale, _kernel(kernel, q))
    kv = torch.stack([k, v])
    run_pass(geometry, [_Member(geometry, ring.position, DistTransport(ring), step, kv)], False,
             _reach(geometry, q, mask))
    return step.result()


def ring_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, ring: Ring,
    causal: bool, scale: float, kernel: Kernel | None = None, *, mask: AttnMask | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv (input dtype) for :func:`ring_forward`: K/V re-circulate, dK/dV ride behind to their owner."""
    mask = mask or AttnMask(causal)
    geometry = ring.geometry
    step = _BackwardStep(dout, q, out, lse, ring.position, mask, geometry.size, scale, _kernel(kernel, q))
    member = _Member(geometry, ring.position, DistTransport(ring), step, torch.stack([k, v]))
    run_pass(geometry, [member], True, _reach(geometry, q, mask))
    dkv = member.registers[DKV_OWN]
    return step.dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


def _local_members(
    window: int, steps: Sequence, ks: Sequence[Tensor], vs: Sequence[Tensor],
    transports: Sequence[Transport] | None,
) -> tuple[DoubleRing, list[_Member]]:
    cp = len(steps)
    assert cp % window == 0 and len(ks) == len(vs) == cp, (cp, window, len(ks), len(vs))
    geometry = DoubleRing(cp // window, window)
    if transports is None:
        office = PostOffice(geometry)
        transports = [office.transport(p) for p in range(cp)]
    assert len(transports) == cp, (len(transports), cp)
    members = [_Member(geometry, p, transports[p], steps[p], torch.stack([ks[p], vs[p]])) for p in range(cp)]
    return geometry, members


def local_ring_forward(
    qs: Sequence[Tensor], ks: Sequence[Tensor], vs: Sequence[Tensor], window: int, causal: bool,
    scale: float, kernel: Kernel | None = None, transports: Sequence[Transport] | None = None,
    *, mask: AttnMask | None = None,
) -> list[tuple[Tensor, Tensor]]:
    """:func:`ring_forward` of all ``cp = len(qs)`` members of one ring in this process (``qs[p]``: member
    ``p``'s zigzag shard ``[B, H, S_c, D]``); returns each member's ``(out, lse)``. ``transports``: one per
    member (default: hand-offs through one :class:`PostOffice`)."""
    mask, cp = mask or AttnMask(causal), len(qs)
    steps = [_ForwardStep(q, p, mask, cp, scale, _kernel(kernel, q)) for p, q in enumerate(qs)]
    geometry, members = _local_members(window, steps, ks, vs, transports)
    run_pass(geometry, members, False, _reach(geometry, qs[0], mask))
    return [s.result() for s in steps]


def local_ring_backward(
    douts: Sequence[Tensor], qs: Sequence[Tensor], ks: Sequence[Tensor], vs: Sequence[Tensor],
    outs: Sequence[Tensor], lses: Sequence[Tensor], window: int, causal: bool, scale: float,
    kernel: Kernel | None = None, transports: Sequence[Transport] | None = None, *, mask: AttnMask | None = None,
) -> list[tuple[Tensor, Tensor, Tensor]]:
    """:func:`ring_backward` of all members of one ring in this process; returns each member's dq, dk, dv."""
    mask, cp = mask or AttnMask(causal), len(qs)
    steps = [_BackwardStep(douts[p], q, outs[p], lses[p], p, mask, cp, scale, _kernel(kernel, q))
             for p, q in enumerate(qs)]
    geometry, members = _local_members(window, steps, ks, vs, transports)
    run_pass(geometry, members, True, _reach(geometry, qs[0], mask))
    return [(s.dq.to(q.dtype), m.registers[DKV_OWN][0].to(k.dtype), m.registers[DKV_OWN][1].to(v.dtype))
            for s, m, q, k, v in zip(steps, members, qs, ks, vs)]
