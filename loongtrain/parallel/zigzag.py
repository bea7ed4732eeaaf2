"""Mesh-free zigzag arithmetic (docs/attention.md#zigzag-sharding): the sequence-length rule, chunk orders, shard
indices.

Split the sequence into ``2*cp`` chunks; context rank ``c`` owns ``T_c = chunk(c) ++ chunk(2cp-1-c)``;
``T_c`` is cut into ``hp`` equal pieces and head rank ``h`` holds piece ``h``. The head group's
all-to-all (concatenating pieces in head-rank order) therefore rebuilds ``T_c`` exactly.

Option ``chunk_order`` generalises the chunk assignment (any ``n`` equal chunks, ``n/cp`` per context
rank, in the listed order); zigzag is ``chunk_order = zigzag_order(cp)``. Packed documents make zigzag
unbalanced; :func:`loongtrain.parallel.documents.balanced_chunk_order` balances them. Nothing here
touches a process group: the planner, the executor and :mod:`loongtrain.parallel.sharding` share it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the index functions import it: the layout's arithmetic needs none
    import torch


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n`` in increasing order."""
    return [d for d in range(1, n + 1) if n % d == 0]


def valid_sequence_length(seq_len: int, hp: int, cp: int) -> bool:
    """The sequence-length rule: ``seq_len`` is divisible by ``2 * cp * hp`` (``2 cp`` zigzag chunks, each
    split evenly over ``hp`` head ranks)."""
    return seq_len % (2 * cp * hp) == 0


def check_sequence_length(seq_len: int, hp: int, cp: int) -> None:
    """Raise ValueError naming the nearest valid lengths unless :func:`valid_sequence_length`."""
    unit = 2 * cp * hp
    if not valid_sequence_length(seq_len, hp, cp):
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
    import torch

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
    import torch

    return torch.cat([shard_indices(seq_len, hp, cp, c, h, chunk_order) for c in range(cp) for h in range(hp)])
