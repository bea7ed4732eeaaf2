"""The 2D zigzag sequence layout on a mesh (docs/attention.md#zigzag-sharding): :func:`shard_sequence` and its exact
inverse :func:`gather_sequence`. The mesh-free arithmetic (chunk orders, shard indices, the
sequence-length rule) is :mod:`loongtrain.parallel.zigzag`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from loongtrain.parallel.mesh import Mesh
from loongtrain.parallel.zigzag import ChunkOrder, replica_permutation, shard_indices


def shard_sequence(x: torch.Tensor, mesh: Mesh, dim: int, chunk_order: ChunkOrder | None = None) -> torch.Tensor:
    """This rank's ``S/sp`` slice of the full tensor ``x`` along ``dim``, in the 2D zigzag layout (or the
    layout of ``chunk_order``, e.g. :func:`loongtrain.parallel.documents.balanced_chunk_order`)."""
    dim = dim % x.dim()
    idx = shard_indices(x.shape[dim], mesh.hp, mesh.cp, mesh.cp_rank, mesh.hp_rank, chunk_order).to(x.device)
    return x.index_select(dim, idx)


class _GatherSequence(torch.autograd.Function):
    """Forward: all-gather the replica's shards and undo the zigzag. Backward: sum the full
    gradient over the replica (every rank may have used the full tensor) and keep this rank's slice."""

    @staticmethod
    def forward(ctx, x_local: torch.Tensor, mesh: Mesh, dim: int, chunk_order: ChunkOrder | None) -> torch.Tensor:
        ctx.mesh, ctx.dim, ctx.chunk_order = mesh, dim, chunk_order
        if mesh.sp == 1:
            return x_local.clone()
        moved = x_local.movedim(dim, 0).contiguous()
        pieces = [torch.empty_like(moved) for _ in range(mesh.sp)]
        dist.all_gather(pieces, moved, group=mesh.sp_group)  # in group order: sorted global ranks
        by_sp_rank = sorted(range(mesh.sp), key=lambda i: _sp_rank_of(mesh, dist.get_global_rank(mesh.sp_group, i)))
        pieces = [pieces[i] for i in by_sp_rank]
        seq_len = moved.shape[0] * mesh.sp
        perm = replica_permutation(seq_len, mesh.hp, mesh.cp, chunk_order).to(moved.device)
        full = torch.empty((seq_len, *moved.shape[1:]), dtype=moved.dtype, device=moved.device)
        full[perm] = torch.cat(pieces)
        return full.movedim(0, dim)

    @staticmethod
    def backward(ctx, grad_full: torch.Tensor):
        mesh = ctx.mesh
        if mesh.sp == 1:
            return grad_full, None, None, None
        grad_full = grad_full.contiguous()
        dist.all_reduce(grad_full, group=mesh.sp_group)
        return shard_sequence(grad_full, mesh, ctx.dim, ctx.chunk_order), None, None, None


def _sp_rank_of(mesh: Mesh, global_rank: int) -> int:
    _, cp_rank, hp_rank = mesh.layout.coords(global_rank)
    return cp_rank * mesh.hp + hp_rank


def gather_sequence(x_local: torch.Tensor, mesh: Mesh, dim: int, chunk_order: ChunkOrder | None = None) -> torch.Tensor:
    """The full sequence on every rank of the replica: exact inverse of :func:`shard_sequence` (same
    ``chunk_order``)."""
    order = tuple(chunk_order) if chunk_order is not None else None
    return _GatherSequence.apply(x_local, mesh, dim % x_local.dim(), order)
