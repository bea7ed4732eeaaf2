"""The 2D-Attention communication/compute steps as ``torch.library`` custom ops.

Being custom ops (not plain autograd Functions) lets selective activation checkpointing save their
outputs (``CheckpointPolicy.MUST_SAVE`` on ``torch.ops.loongtrain.*``), so a recompute pass re-runs
neither attention nor any of its communication (Selective Checkpoint++). Process groups travel as
their registered names.
"""

from __future__ import annotations

import torch

from loongtrain.attn.ring import Ring, ring_backward, ring_forward
from loongtrain.parallel.comm import all_to_all, resolve_group

Tensor = torch.Tensor


@torch.library.custom_op("loongtrain::head_all_to_all", mutates_args=())
def head_all_to_all(x: Tensor, group: str, scatter_dim: int, gather_dim: int) -> Tensor:
    """Forward: all-to-all over the head group, scattering ``scatter_dim`` and gathering ``gather_dim``.
    Backward: the same all-to-all with the two dims swapped."""
    return all_to_all(x, resolve_group(group), scatter_dim, gather_dim)


@head_all_to_all.register_fake
def _(x: Tensor, group: str, scatter_dim: int, gather_dim: int) -> Tensor:
    n = torch.distributed.get_world_size(resolve_group(group))
    shape = list(x.shape)
    shape[scatter_dim] //= n
    shape[gather_dim] *= n
    return x.new_empty(shape)


def _a2a_setup(ctx, inputs, output) -> None:
    _, ctx.group, ctx.scatter_dim, ctx.gather_dim = inputs


def _a2a_backward(ctx, grad: Tensor):
    return head_all_to_all(grad.contiguous(), ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


head_all_to_all.register_autograd(_a2a_backward, setup_context=_a2a_setup)


def _ring(ranks: list[int], window: int, groups: str) -> Ring:
    """``groups``: comma-joined names of the inner K/V, outer K/V, inner dK/dV and outer dK/dV groups
    (an empty name for a group of one rank)."""
    if len(ranks) == 1:
        return Ring(ranks, 0, 1, None, None, None, None)
    me = ranks.index(torch.distributed.get_rank())
    return Ring(ranks, me, window, *(resolve_group(g) if g else None for g in groups.split(",")))


@torch.library.custom_op("loongtrain::ring_attention", mutates_args=())
def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    ranks: list[int],
    window: int,
    groups: str,
    causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor]:
    """Forward: zigzag (double-)ring attention of ``q [B, S_c, H, D]`` against the ring's K/V
    ``[B, S_c, Hkv, D]``; returns out ``[B, S_c, H, D]`` and lse ``[B, H, S_c]``. Backward: ring backward,
    K/V re-circulated and dK/dV returned to their owners; lse is not differentiable."""
    ring = _ring(ranks, window, groups)
    out, lse = ring_forward(_bhsd(q), _bhsd(k), _bhsd(v), ring, causal, scale)
    return out.transpose(1, 2).contiguous(), lse


@ring_attention.register_fake
def _(q, k, v, ranks, window, groups, causal, scale):
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty(q.shape), q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=acc)


def _bhsd(x: Tensor) -> Tensor:
    return x.transpose(1, 2).contiguous()


def _ring_setup(ctx, inputs, output) -> None:
    q, k, v, ranks, window, groups, causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.args = (ranks, window, groups, causal, scale)
    ctx.mark_non_differentiable(lse)


def _ring_backward(ctx, dout: Tensor, _dlse: Tensor | None):
    q, k, v, out, lse = ctx.saved_tensors
    ranks, window, groups, causal, scale = ctx.args
    ring = _ring(ranks, window, groups)
    dq, dk, dv = ring_backward(
        _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse, ring, causal, scale
    )
    return (dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)) + (None,) * 5


ring_attention.register_autograd(_ring_backward, setup_context=_ring_setup)
