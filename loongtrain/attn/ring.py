"""Zigzag (double-)ring attention over one context ring, forward and backward (DESIGN.md sections 6, 3).

Tensors are ``[B, H, S_c, D]`` with ``S_c = S/cp`` the local zigzag pair ``[front ; back]``.
The ring of ``cp`` members is cut into ``cp // window`` windows. At outer step ``o`` and inner step
``t`` member ``(j, i)`` (window ``j``, position ``i``) holds the K/V block of member
``((j - o) mod n, (i - t) mod window)``. The outer transfer is posted at the start of an outer step
and awaited after its ``window`` inner steps; each inner transfer is posted before the step's
compute. ``window == 1`` or ``window == cp`` is the plain ring.

dK/dV partial sums travel *behind* the K/V blocks along the same path and end at their owner:
``window - 1`` inner hops per outer step and ``n - 1`` outer hops, i.e. ``cp - 1`` blocks per rank,
the same as K/V. They use their own process group so they do not queue behind K/V.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from loongtrain.attn.kernels import Kernel, select_kernel
from loongtrain.parallel.comm import Exchange, post_exchange

Tensor = torch.Tensor


@dataclass(frozen=True)
class Ring:
    ranks: list[int]  # global ranks in ring order
    position: int  # this rank's index in ``ranks``
    window: int
    inner_group: dist.ProcessGroup | None  # K/V inside a window
    outer_group: dist.ProcessGroup | None  # K/V between windows
    inner_grad_group: dist.ProcessGroup | None  # dK/dV, same paths, own groups
    outer_grad_group: dist.ProcessGroup | None

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def num_windows(self) -> int:
        return self.size // self.window

    def _peer(self, window_shift: int, inner_shift: int) -> int:
        j, i = divmod(self.position, self.window)
        j = (j + window_shift) % self.num_windows
        i = (i + inner_shift) % self.window
        return self.ranks[j * self.window + i]

    def source(self, outer: int, inner: int) -> int:
        """Ring position whose block this rank holds at (outer, inner)."""
        j, i = divmod(self.position, self.window)
        return ((j - outer) % self.num_windows) * self.window + (i - inner) % self.window

    def visit(self, kv: Tensor) -> Iterator[tuple[int, int, int, Tensor]]:
        """Yield ``(outer, inner, source, block)`` for every ring block, moving ``kv`` round the ring
        with transfers posted ahead of the compute that the caller does between yields."""
        outer_block = kv
        for o in range(self.num_windows):
            outer_ex = None
            if o < self.num_windows - 1:
                outer_ex = post_exchange(outer_block, self._peer(1, 0), self._peer(-1, 0), self.outer_group, "kv")
            block = outer_block
            for t in range(self.window):
                inner_ex = None
                if t < self.window - 1:
                    inner_ex = post_exchange(block, self._peer(0, 1), self._peer(0, -1), self.inner_group, "kv")
                yield o, t, self.source(o, t), block
                if inner_ex is not None:
                    block = inner_ex.wait()
            if outer_ex is not None:
                outer_block = outer_ex.wait()


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _merge(out_acc: Tensor, lse_acc: Tensor, out_blk: Tensor, lse_blk: Tensor) -> None:
    """In place: combine two partial softmax results by their log-sum-exp, in the accumulators' dtype."""
    lse_blk = lse_blk.to(lse_acc.dtype)
    new_lse = torch.logaddexp(lse_acc, lse_blk)
    out_acc.mul_(torch.exp(lse_acc - new_lse).unsqueeze(-1))
    out_acc.add_(out_blk.to(out_acc.dtype) * torch.exp(lse_blk - new_lse).unsqueeze(-1))
    lse_acc.copy_(new_lse)


def ring_forward(
    q: Tensor, k: Tensor, v: Tensor, ring: Ring, causal: bool, scale: float, kernel: Kernel | None = None
) -> tuple[Tensor, Tensor]:
    """out ``[B, H, S_c, D]`` (input dtype) and lse ``[B, H, S_c]`` (fp32, fp64 for fp64 inputs)."""
    kernel = kernel or select_kernel(q.device, q.dtype, q.shape[-1])
    half = q.shape[2] // 2
    acc = _acc_dtype(q.dtype)
    out_acc = torch.empty(q.shape, dtype=acc, device=q.device)
    lse_acc = torch.empty(q.shape[:3], dtype=acc, device=q.device)
    first = True
    for _, _, src, block in ring.visit(torch.stack([k, v])):
        kb, vb = block[0], block[1]
        rows = slice(None)
        if not causal:
            out_blk, lse_blk = kernel.forward(q, kb, vb, False, scale)
        elif src == ring.position:
            out_blk, lse_blk = kernel.forward(q, kb, vb, True, scale)
        elif src < ring.position:  # all local queries see the source's front chunk
            out_blk, lse_blk = kernel.forward(q, kb[:, :, :half], vb[:, :, :half], False, scale)
        else:  # only the local back chunk sees the source's whole block
            rows = slice(half, None)
            out_blk, lse_blk = kernel.forward(q[:, :, half:], kb, vb, False, scale)
        if first:
            assert rows == slice(None)
            out_acc.copy_(out_blk)
            lse_acc.copy_(lse_blk)
            first = False
        else:
            _merge(out_acc[:, :, rows], lse_acc[:, :, rows], out_blk, lse_blk)
    return out_acc.to(q.dtype), lse_acc


class _GradChain:
    """dK/dV partial sums passed behind the K/V blocks (inner hops, then outer hops) to their owner.

    A window's last inner hop is awaited only after the next block's compute (``_deferred``), so it
    hides behind compute like every other hop; only the final outer hop of the pass is exposed.
    """

    def __init__(self, ring: Ring):
        self.ring = ring
        self.inner_in: Exchange | None = None
        self.outer_in: Exchange | None = None
        self.window_acc: Tensor | None = None  # this rank's own part of the outer block's window sum
        self.own: Tensor | None = None  # sum for this rank's own block
        self._deferred: tuple[int, Tensor, Exchange | None] | None = None

    def add(self, outer: int, inner: int, contrib: Tensor) -> None:
        """Take this step's contribution for the block held at (outer, inner); called after its compute."""
        ring = self.ring
        if self._deferred is not None:
            self._finish_window(*self._deferred)
            self._deferred = None
        if inner == 0:
            self.window_acc = contrib
        else:
            if self.inner_in is not None:  # partial from the previous holder of this block
                contrib = contrib + self.inner_in.wait()
            self.inner_in = post_exchange(
                contrib, ring._peer(0, 1), ring._peer(0, -1), ring.inner_grad_group, "dkv"
            )
        if inner == ring.window - 1:
            self._deferred = (outer, self.window_acc, self.inner_in)
            self.inner_in = None

    def _finish_window(self, outer: int, total: Tensor, last_inner: Exchange | None) -> None:
        ring = self.ring
        if last_inner is not None:  # the rest of the window's sum for the block this rank holds
            total = total + last_inner.wait()
        if outer == 0:
            self.own = total
            return
        if self.outer_in is not None:
            total = total + self.outer_in.wait()
        self.outer_in = post_exchange(total, ring._peer(1, 0), ring._peer(-1, 0), ring.outer_grad_group, "dkv")

    def result(self) -> Tensor:
        if self._deferred is not None:
            self._finish_window(*self._deferred)
            self._deferred = None
        assert self.own is not None and self.inner_in is None
        if self.outer_in is not None:
            return self.own + self.outer_in.wait()
        return self.own


def ring_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    ring: Ring,
    causal: bool,
    scale: float,
    kernel: Kernel | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv (input dtype) for :func:`ring_forward`; K/V re-circulate, dK/dV ride behind."""
    kernel = kernel or select_kernel(q.device, q.dtype, q.shape[-1])
    half = q.shape[2] // 2
    acc = _acc_dtype(q.dtype)
    dq_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
    chain = _GradChain(ring)
    kv_shape = (2, *k.shape)
    for o, t, src, block in ring.visit(torch.stack([k, v])):
        kb, vb = block[0], block[1]
        if not causal or src == ring.position:
            dq, dk, dv = kernel.backward(dout, q, kb, vb, out, lse, causal, scale)
            dq_acc.add_(dq)
            contrib = torch.stack([dk, dv]).to(acc)
        elif src < ring.position:  # only the source's front chunk was attended
            kf, vf = kb[:, :, :half].contiguous(), vb[:, :, :half].contiguous()
            dq, dk, dv = kernel.backward(dout, q, kf, vf, out, lse, False, scale)
            dq_acc.add_(dq)
            contrib = torch.zeros(kv_shape, dtype=acc, device=k.device)
            contrib[0, :, :, :half].copy_(dk)
            contrib[1, :, :, :half].copy_(dv)
        else:  # only the local back chunk attended
            back = slice(half, None)
            dq, dk, dv = kernel.backward(
                dout[:, :, back].contiguous(), q[:, :, back].contiguous(), kb, vb,
                out[:, :, back].contiguous(), lse[:, :, back].contiguous(), False, scale,
            )
            dq_acc[:, :, back].add_(dq)
            contrib = torch.stack([dk, dv]).to(acc)
        chain.add(o, t, contrib)
    dkv = chain.result()
    return dq_acc.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)
