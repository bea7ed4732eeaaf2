"""Tracing the ring schedule's sends and kernels, and a dense per-row reference for documents."""

from __future__ import annotations

import dataclasses

import torch

from loongtrain.attn.kernels import Kernel, reference_forward
from loongtrain.attn.masking import AttnMask, dense_mask
from loongtrain.attn.ring import PostOffice
from loongtrain.parallel.layout import DoubleRing
from loongtrain.plan.attention_cost import _Link, simulate_pass


class _RecordingTransport:
    def __init__(self, recorder: Recorder, position: int, inner) -> None:
        self.recorder, self.position, self.inner, self.posts = recorder, position, inner, 0

    def post(self, hop, payload, tensor, direction=1):
        self.recorder.log.append((self.position, ("post", hop, payload) + ((direction,) if direction != 1 else ())))
        self.posts += 1
        return self.posts - 1, self.inner.post(hop, payload, tensor, direction)

    def wait(self, handle):
        index, inner = handle
        self.recorder.log.append((self.position, ("wait", index)))
        return self.inner.wait(inner)


class Recorder:
    """One log for all members: every schedule event is applied to members 0..cp-1 in turn, and each
    application makes exactly one entry (a post, a wait, or one kernel call)."""

    def __init__(self, cp: int, inner_ring: int) -> None:
        self.cp, self.log = cp, []
        office = PostOffice(DoubleRing(cp // inner_ring, inner_ring))
        self.transports = [_RecordingTransport(self, p, office.transport(p)) for p in range(cp)]

    def kernel(self, base: Kernel) -> Kernel:
        def forward(*args):
            self.log.append((None, ("compute",)))
            return base.forward(*args)

        def backward(*args):
            self.log.append((None, ("compute",)))
            return base.backward(*args)

        return dataclasses.replace(base, forward=forward, backward=backward)

    def member_trace(self, p: int) -> list[tuple]:
        entries = self.log[p :: self.cp]
        assert all(who in (None, p) for who, _ in entries)
        return [op for _, op in entries]


def planned_trace(cp: int, inner_ring: int, backward: bool, reach: int | None = None) -> list[tuple]:
    trace: list[tuple] = []
    simulate_pass((cp // inner_ring, inner_ring), 1.0, _Link(1.0, 0.0, 1.0), _Link(1.0, 0.0, 1.0), 1,
                  1 if backward else None, trace, reach)
    return trace


def dense_reference(q, k, v, dout, mask: AttnMask):
    """Attention with the dense [S, S] mask of each batch row; returns out, lse, dq, dk, dv."""
    seq = q.shape[2]
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    outs, lses = [], []
    for b in range(q.shape[0]):
        m = dense_mask(seq, mask, b)
        o, lse = reference_forward(*(t[b : b + 1] for t in leaves), False, q.shape[-1] ** -0.5, m)
        outs.append(o)
        lses.append(lse)
    out, lse = torch.cat(outs), torch.cat(lses)
    return (out.detach(), lse.detach(), *torch.autograd.grad(out, leaves, dout))
