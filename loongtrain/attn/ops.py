"""The 2D-Attention communication/compute steps as ``torch.library`` custom ops.

Being custom ops (not plain autograd Functions) lets selective activation checkpointing save their
outputs (``CheckpointPolicy.MUST_SAVE`` on ``torch.ops.loongtrain.*``), so a recompute pass re-runs
neither attention nor any of its communication (Selective Checkpoint++; docs/design.md §6). Process
groups travel as their registered names, a context ring as the key of its registered :class:`Ring`.
"""

from __future__ import annotations

import torch

from loongtrain.attn.masking import AttnMask, unflatten_cu_seqlens
from loongtrain.attn.ring import Ring, ring_backward, ring_forward
from loongtrain.parallel.comm import all_to_all, resolve_group
from loongtrain.parallel.mesh import Mesh

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


_RINGS: dict[str, Ring] = {}  # ring_key -> Ring, filled by ring_key (process groups are per process too)


def _ring_groups(ring: Ring) -> tuple:
    return ring.inner_group, ring.outer_group, ring.inner_grad_group, ring.outer_grad_group


def ring_key(mesh: Mesh) -> str:
    """Register this rank's context ring (ranks, position, window, its four process groups) once per
    mesh and return the key the ``ring_attention`` op finds it by (like torch, which resolves process
    groups by name)."""
    groups = (mesh.inner_group, mesh.outer_group, mesh.inner_grad_group, mesh.outer_grad_group)
    names = ",".join(g.group_name if g is not None else "-" for g in groups)
    key = f"{mesh.rank}:{mesh.window}:{','.join(map(str, mesh.ring_ranks))}:{names}"
    ring = _RINGS.get(key)
    if ring is None or any(a is not b for a, b in zip(_ring_groups(ring), groups)):  # a group was remade
        _RINGS[key] = Ring(tuple(mesh.ring_ranks), mesh.cp_rank, mesh.window, *groups)
    return key


def _mask(causal: bool, cu_seqlens: list[int], sliding_window: int | None, chunk_order: list[int]) -> AttnMask:
    return AttnMask(causal, sliding_window, unflatten_cu_seqlens(cu_seqlens),
                    chunk_order=tuple(chunk_order) if chunk_order else None)


@torch.library.custom_op("loongtrain::ring_attention", mutates_args=())
def ring_attention(
    q: Tensor, k: Tensor, v: Tensor, ring: str, causal: bool, scale: float, cu_seqlens: list[int],
    sliding_window: int | None, chunk_order: list[int],
) -> tuple[Tensor, Tensor]:
    """Forward: zigzag (double-)ring attention of ``q [B, S_c, H, D]`` against the K/V ``[B, S_c, Hkv, D]``
    of every member of the ring registered as ``ring`` (:func:`ring_key`); returns out ``[B, S_c, H, D]`` and
    lse ``[B, H, S_c]``. ``cu_seqlens``: each batch row's document boundaries, rows concatenated (empty:
    one document); ``sliding_window``: Mistral's window (None: none); ``chunk_order``: the tokens' layout
    (empty: zigzag). Backward: ring backward, K/V re-circulated and dK/dV returned to their owners; lse is
    not differentiable (docs/design.md §4, §6)."""
    mask = _mask(causal, cu_seqlens, sliding_window, chunk_order)
    out, lse = ring_forward(_bhsd(q), _bhsd(k), _bhsd(v), _RINGS[ring], causal, scale, mask=mask)
    return out.transpose(1, 2).contiguous(), lse


@ring_attention.register_fake
def _(q, k, v, ring, causal, scale, cu_seqlens, sliding_window, chunk_order):
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty(q.shape), q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=acc)


def _bhsd(x: Tensor) -> Tensor:
    """``[B, S, H, D] -> [B, H, S, D]`` as a view (K/V are copied once when stacked into a ring block;
    the kernels take strided views)."""
    return x.transpose(1, 2)


def _ring_setup(ctx, inputs, output) -> None:
    q, k, v, ring, causal, scale, cu_seqlens, sliding_window, chunk_order = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.args = (ring, causal, scale, cu_seqlens, sliding_window, chunk_order)
    ctx.mark_non_differentiable(lse)


def _ring_backward(ctx, dout: Tensor, _dlse: Tensor | None):
    q, k, v, out, lse = ctx.saved_tensors
    ring, causal, scale, cu_seqlens, sliding_window, chunk_order = ctx.args
    dq, dk, dv = ring_backward(
        _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse, _RINGS[ring], causal, scale,
        mask=_mask(causal, cu_seqlens, sliding_window, chunk_order),
    )
    return (dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)) + (None,) * 6


ring_attention.register_autograd(_ring_backward, setup_context=_ring_setup)
