"""Linear attention's exchange over the context ranks as ``torch.library`` custom ops (docs/linear-attention.md).

As for 2D-Attention's ops (loongtrain/attn/ops.py): selective recompute saves their outputs, so a recompute pass
sends nothing, and ``torch.compile`` sees opaque nodes whose fake implementations give the shapes. The group
travels as its registered name; ``kind`` names the traffic for :class:`~loongtrain.parallel.comm.CommCounter`.
"""

from __future__ import annotations

import torch

from loongtrain.parallel.comm import all_gather_stacked, reduce_scatter_stacked, resolve_group

Tensor = torch.Tensor


@torch.library.custom_op("loongtrain::context_all_gather", mutates_args=())
def context_all_gather(x: Tensor, group: str, kind: str) -> Tensor:
    """Forward: every context rank's ``x`` stacked ``[n, ...]`` in group-rank order (``x`` sent to each other
    member). Backward: :func:`context_reduce_scatter` of the gradient (each member's piece summed over the
    group and returned to it)."""
    return all_gather_stacked(x, resolve_group(group), kind)


@context_all_gather.register_fake
def _(x: Tensor, group: str, kind: str) -> Tensor:
    n = torch.distributed.get_world_size(resolve_group(group))
    return x.new_empty((n, *x.shape))


@torch.library.custom_op("loongtrain::context_reduce_scatter", mutates_args=())
def context_reduce_scatter(x: Tensor, group: str, kind: str) -> Tensor:
    """Forward: ``x [n, ...]`` summed over the group, this member's piece kept (piece ``i`` sent to member ``i``).
    Backward: none (the backward of :func:`context_all_gather` only)."""
    return reduce_scatter_stacked(x, resolve_group(group), kind)


@context_reduce_scatter.register_fake
def _(x: Tensor, group: str, kind: str) -> Tensor:
    return x.new_empty(x.shape[1:])


def _gather_setup(ctx, inputs, output) -> None:
    _, ctx.group, ctx.kind = inputs


def _gather_backward(ctx, grad: Tensor):
    return context_reduce_scatter(grad.contiguous(), ctx.group, "d" + ctx.kind), None, None


context_all_gather.register_autograd(_gather_backward, setup_context=_gather_setup)
