"""The 2D zigzag sequence layout (docs/design.md §3): one permutation and its inverse.

Split the sequence into ``2*cp`` chunks; context rank ``c`` owns ``T_c = chunk(c) ++ chunk(2cp-1-c)``;
``T_c`` is cut into ``hp`` equal pieces and head rank ``h`` holds piece ``h``. The head group's
all-to-all (concatenating pieces in head-rank order) therefore rebuilds ``T_c`` exactly.

Option ``chunk_order`` generalises the chunk assignment (any ``n`` equal chunks, ``n/cp`` per context
rank, in the listed order); zigzag is ``chunk_order = zigzag_order(cp)``. Packed documents make zigzag
unbalanced; :func:`loongtrain.parallel.documents.balanced_chunk_order` balances them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from loongtrain.parallel.mesh import Mesh


def check_sequence_length(seq_len: int, hp: int, cp: int) -> None:
    """Raise ValueError unless ``seq_len`` is divisible by ``2 * cp * hp``."""
    unit = 2 * cp * hp
    if seq_len % unit != 0:
        lower, upper = (seq_len // unit) * unit, (seq_len // unit + 1) * unit
        raise ValueError(
            f"sequence length {seq_len} must be divisible by 2*cp*hp = 2*{cp}*{hp} = {unit} "
            f"(nearest valid lengths: {lower or unit}, {upper})"
        )


ChunkOrder = tuple[int, ...]


def zigzag_order(cp: int) -> ChunkOrder:
    """The default chunk order: ``2 cp`` chunks, context rank ``c`` holding chunks ``c`` and ``2 cp - 1 - c``."""
    return tuple(x for c in range(cp) for x in (c, 2 * cp - 1 - c))


def check_chunk_order(chunk_order: ChunkOrder, seq_len: int, hp: int, cp: int) -> None:
    """Raise ValueError unless ``chunk_order`` is a layout of ``seq_len`` tokens on ``cp x hp`` ranks: a
    permutation of ``range(n)`` with ``cp | n``, ``n | seq_len`` and ``hp | seq_len / cp``."""
    n = len(chunk_order)
    if sorted(chunk_order) != list(range(n)) or n == 0 or n % cp:
        raise ValueError(f"chunk_order={list(chunk_order)[:16]} must be a permutation of range(n) with n a multiple "
                         f"of cp={cp} (n/cp chunks per context rank)")
    if seq_len % n or (seq_len // cp) % hp:
        raise ValueError(f"sequence length {seq_len} must be divisible by the {n} chunks of chunk_order, and "
                         f"seq_len/cp = {seq_len / cp:g} by hp={hp}")


def shard_indices(seq_len: int, hp: int, cp: int, cp_rank: int, hp_rank: int,
                  chunk_order: ChunkOrder | None = None) -> torch.Tensor:
    """Global token positions held by rank (cp_rank, hp_rank), in local order. Length ``seq_len/(hp*cp)``.

    ``chunk_order`` (default :func:`zigzag_order`): the sequence cut into ``n = len(chunk_order)`` equal
    chunks; context rank ``c`` holds chunks ``chunk_order[c*n/cp : (c+1)*n/cp]`` in that order."""
    if chunk_order is None:
        check_sequence_length(seq_len, hp, cp)
        chunk_order = zigzag_order(cp)
    else:
        check_chunk_order(chunk_order, seq_len, hp, cp)
    chunk, per_rank = seq_len // len(chunk_order), len(chunk_order) // cp
    mine = chunk_order[cp_rank * per_rank : (cp_rank + 1) * per_rank]
    tokens = torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in mine])  # T_c, length S/cp
    piece = seq_len // (cp * hp)
    return tokens[hp_rank * piece : (hp_rank + 1) * piece]


def replica_permutation(seq_len: int, hp: int, cp: int, chunk_order: ChunkOrder | None = None) -> torch.Tensor:
    """Concatenation of every rank's shard indices in sp_rank order (cp_rank-major): a permutation of S."""
    return torch.cat([shard_indices(seq_len, hp, cp, c, h, chunk_order) for c in range(cp) for h in range(hp)])


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
