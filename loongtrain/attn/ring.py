"""Zigzag (double-)ring attention: an executor of the ring schedule (docs/design.md §4, §3).

Tensors are ``[B, H, S_c, D]`` with ``S_c = S/cp`` a member's zigzag pair ``[front ; back]``. The order
of every transfer, compute and wait comes from :func:`loongtrain.attn.schedule.pass_events`; this module
only supplies the math of a step and moves tensors through a :class:`Transport`:

- :class:`DistTransport`: one member per process, hops through
  :func:`loongtrain.parallel.comm.post_exchange` (so :class:`~loongtrain.parallel.comm.CommCounter` sees
  every byte);
- :class:`PostOffice`: all members of a ring in one process, hops are tensor hand-offs; each event is
  applied to every member before the next one (:func:`local_ring_forward`, :func:`local_ring_backward`).

Step math (causal, zigzag): the source's block equals the member's own -> causal attention; a source
before the member -> all local queries see the source's front half; a source after it -> only the local
back half of the queries sees the source's whole block. Partial results merge by log-sum-exp.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from loongtrain.attn.kernels import Kernel, select_kernel
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
)
from loongtrain.parallel.comm import Exchange, post_exchange

Tensor = torch.Tensor


class Transport(Protocol):
    """One member's ring hops. ``post``: start sending ``tensor`` to the hop's next peer and receiving a
    same-shaped tensor from its previous peer; ``wait``: the received tensor. No autograd (the ring's
    backward posts its own transfers)."""

    def post(self, hop: Hop, payload: Payload, tensor: Tensor) -> object: ...

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

    def post(self, hop: Hop, payload: Payload, tensor: Tensor) -> Exchange:
        """Forward: async send to the hop's next rank, async receive from its previous rank. No backward."""
        ring = self.ring
        group = ring.group(hop, payload)
        assert group is not None, (hop, payload, ring)
        return post_exchange(tensor, ring.peer(hop, 1), ring.peer(hop, -1), group, payload)

    def wait(self, handle: Exchange) -> Tensor:
        return handle.wait()


class PostOffice:
    """Mailboxes of all members of one ring in one process; :meth:`transport` gives a member its hops.

    A post leaves the tensor itself (no copy) in the next peer's box, tagged with the sender's count of
    posts on that (hop, payload); every member posts the same sequence, so the receiver's own count
    names the message meant for it."""

    def __init__(self, geometry: DoubleRing) -> None:
        self.geometry = geometry
        self.boxes: dict[tuple[int, Hop, Payload, int], Tensor] = {}

    def transport(self, position: int) -> Transport:
        return _LocalTransport(self, position)


class _LocalTransport:
    def __init__(self, office: PostOffice, position: int) -> None:
        self.office, self.position = office, position
        self.sent: dict[tuple[Hop, Payload], int] = {}

    def post(self, hop: Hop, payload: Payload, tensor: Tensor) -> tuple[Hop, Payload, int]:
        """Forward: hand ``tensor`` to the hop's next member; the handle names what this member receives.
        No backward."""
        seq = self.sent.get((hop, payload), 0)
        self.sent[(hop, payload)] = seq + 1
        dst = self.office.geometry.peer(self.position, hop, 1)
        self.office.boxes[(dst, hop, payload, seq)] = tensor
        return hop, payload, seq

    def wait(self, handle: tuple[Hop, Payload, int]) -> Tensor:
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
            self.in_flight[event.transfer] = self.transport.post(event.hop, event.payload, regs[event.register])
        elif isinstance(event, Wait):
            received = self.transport.wait(self.in_flight.pop(event.transfer))
            regs[event.register] = regs[event.register] + received if event.add else received
        else:
            assert isinstance(event, Compute)
            src = self.geometry.source(self.position, event.outer, event.inner)
            contrib = self.step(src, regs[event.kv])
            if event.dkv is not None:
                regs[event.dkv] = contrib


def run_pass(geometry: DoubleRing, members: Sequence[_Member], backward: bool) -> None:
    """Apply the pass's events in order, each to every member before the next event."""
    for event in pass_events(geometry.num_windows, geometry.window, backward):
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


class _ForwardStep:
    """Online-softmax accumulation of one member's queries over the blocks it is handed."""

    def __init__(self, q: Tensor, position: int, causal: bool, scale: float, kernel: Kernel) -> None:
        self.q, self.position, self.causal, self.scale, self.kernel = q, position, causal, scale, kernel
        acc = _acc_dtype(q.dtype)
        self.out = torch.empty(q.shape, dtype=acc, device=q.device)
        self.lse = torch.empty(q.shape[:3], dtype=acc, device=q.device)
        self.first = True

    def __call__(self, src: int, block: Tensor) -> None:
        q, kb, vb, half = self.q, block[0], block[1], self.q.shape[2] // 2
        rows = slice(None)
        if not self.causal:
            out, lse = self.kernel.forward(q, kb, vb, False, self.scale)
        elif src == self.position:
            out, lse = self.kernel.forward(q, kb, vb, True, self.scale)
        elif src < self.position:  # all local queries see the source's front chunk
            out, lse = self.kernel.forward(q, kb[:, :, :half], vb[:, :, :half], False, self.scale)
        else:  # only the local back chunk sees the source's whole block
            rows = slice(half, None)
            out, lse = self.kernel.forward(q[:, :, half:], kb, vb, False, self.scale)
        if self.first:
            assert rows == slice(None)
            self.out.copy_(out)
            self.lse.copy_(lse)
            self.first = False
        else:
            _merge(self.out[:, :, rows], self.lse[:, :, rows], out, lse)

    def result(self) -> tuple[Tensor, Tensor]:
        return self.out.to(self.q.dtype), self.lse


class _BackwardStep:
    """dQ accumulation of one member; returns each block's dK/dV contribution ``[2, B, Hkv, S_c, D]``."""

    def __init__(self, dout: Tensor, q: Tensor, out: Tensor, lse: Tensor, position: int, causal: bool,
                 scale: float, kernel: Kernel) -> None:
        self.dout, self.q, self.out, self.lse = dout, q, out, lse
        self.position, self.causal, self.scale, self.kernel = position, causal, scale, kernel
        self.dq = torch.zeros(q.shape, dtype=_acc_dtype(q.dtype), device=q.device)

    def __call__(self, src: int, block: Tensor) -> Tensor:
        kb, vb, half = block[0], block[1], self.q.shape[2] // 2
        if not self.causal or src == self.position:
            dq, dk, dv = self.kernel.backward(self.dout, self.q, kb, vb, self.out, self.lse, self.causal, self.scale)
            self.dq.add_(dq)
            keys = slice(None)
        elif src < self.position:  # only the source's front chunk was attended
            keys = slice(None, half)
            dq, dk, dv = self.kernel.backward(
                self.dout, self.q, kb[:, :, keys], vb[:, :, keys], self.out, self.lse, False, self.scale
            )
            self.dq.add_(dq)
        else:  # only the local back chunk attended
            back = slice(half, None)
            dq, dk, dv = self.kernel.backward(
                self.dout[:, :, back], self.q[:, :, back], kb, vb,
                self.out[:, :, back], self.lse[:, :, back], False, self.scale,
            )
            self.dq[:, :, back].add_(dq)
            keys = slice(None)
        new = torch.empty if keys == slice(None) else torch.zeros
        contrib = new(block.shape, dtype=self.dq.dtype, device=block.device)
        contrib[0, :, :, keys].copy_(dk)
        contrib[1, :, :, keys].copy_(dv)
        return contrib


def _kernel(kernel: Kernel | None, q: Tensor) -> Kernel:
    return kernel or select_kernel(q.device, q.dtype, q.shape[-1])


def ring_forward(
    q: Tensor, k: Tensor, v: Tensor, ring: Ring, causal: bool, scale: float, kernel: Kernel | None = None
) -> tuple[Tensor, Tensor]:
    """out ``[B, H, S_c, D]`` (input dtype) and lse ``[B, H, S_c]`` (fp32, fp64 for fp64 inputs) of this
    rank's queries against every ring member's K/V; K/V blocks move round the ring."""
    step = _ForwardStep(q, ring.position, causal, scale, _kernel(kernel, q))
    kv = torch.stack([k, v])
    run_pass(ring.geometry, [_Member(ring.geometry, ring.position, DistTransport(ring), step, kv)], False)
    return step.result()


def ring_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, ring: Ring,
    causal: bool, scale: float, kernel: Kernel | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv (input dtype) for :func:`ring_forward`: K/V re-circulate, dK/dV ride behind to their owner."""
    step = _BackwardStep(dout, q, out, lse, ring.position, causal, scale, _kernel(kernel, q))
    member = _Member(ring.geometry, ring.position, DistTransport(ring), step, torch.stack([k, v]))
    run_pass(ring.geometry, [member], True)
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
) -> list[tuple[Tensor, Tensor]]:
    """:func:`ring_forward` of all ``cp = len(qs)`` members of one ring in this process (``qs[p]``: member
    ``p``'s zigzag shard ``[B, H, S_c, D]``); returns each member's ``(out, lse)``. ``transports``: one per
    member (default: hand-offs through one :class:`PostOffice`)."""
    steps = [_ForwardStep(q, p, causal, scale, _kernel(kernel, q)) for p, q in enumerate(qs)]
    geometry, members = _local_members(window, steps, ks, vs, transports)
    run_pass(geometry, members, False)
    return [s.result() for s in steps]


def local_ring_backward(
    douts: Sequence[Tensor], qs: Sequence[Tensor], ks: Sequence[Tensor], vs: Sequence[Tensor],
    outs: Sequence[Tensor], lses: Sequence[Tensor], window: int, causal: bool, scale: float,
    kernel: Kernel | None = None, transports: Sequence[Transport] | None = None,
) -> list[tuple[Tensor, Tensor, Tensor]]:
    """:func:`ring_backward` of all members of one ring in this process; returns each member's dq, dk, dv."""
    steps = [_BackwardStep(douts[p], q, outs[p], lses[p], p, causal, scale, _kernel(kernel, q))
             for p, q in enumerate(qs)]
    geometry, members = _local_members(window, steps, ks, vs, transports)
    run_pass(geometry, members, True)
    return [(s.dq.to(q.dtype), m.registers[DKV_OWN][0].to(k.dtype), m.registers[DKV_OWN][1].to(v.dtype))
            for s, m, q, k, v in zip(steps, members, qs, ks, vs)]
