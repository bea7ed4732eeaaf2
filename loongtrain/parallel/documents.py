"""Packed documents: boundaries, per-document positions, and the work they leave to each rank.

A packed row is documents back to back, each closed by an EOS token (``loongtrain.data``'s packing). Its
document boundaries in flash-attn's convention (``cu_seqlens``: ``0 = c_0 < ... < c_n = S``) are what
:func:`loongtrain.attention` takes (always of the **full** sequence); the position ids restart at 0 in
each document and are sharded like the tokens (:func:`loongtrain.shard_sequence`, docs/attention.md#zigzag-sharding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loongtrain.parallel.config import CHUNK_ORDERS
from loongtrain.parallel.mesh import Mesh
from loongtrain.parallel.sharding import shard_sequence
from loongtrain.parallel.zigzag import check_chunk_order, shard_indices

Tensor = torch.Tensor




@dataclass(frozen=True)
class Documents:
    """Packed documents of a batch, for the planner (docs/planner.md): one ``cu_seqlens`` per row (a single
    row stands for every row) and the chunk layout the tokens are sharded with: ``"zigzag"`` (the default)
    or ``"balanced"`` (:func:`balanced_chunk_order` of this batch)."""

    cu_seqlens: tuple[tuple[int, ...], ...]
    chunk_order: str = "zigzag"

    def __post_init__(self) -> None:
        if self.chunk_order not in CHUNK_ORDERS:
            raise ValueError(f"chunk_order={self.chunk_order!r} is not one of {CHUNK_ORDERS}")
        if not self.cu_seqlens:
            raise ValueError("Documents needs at least one row of cu_seqlens")

    def rows(self, batch: int) -> list[tuple[int, ...]]:
        """One ``cu_seqlens`` per batch row."""
        if len(self.cu_seqlens) not in (1, batch):
            raise ValueError(f"{len(self.cu_seqlens)} rows of cu_seqlens for batch={batch}: give 1 or {batch}")
        return list(self.cu_seqlens) * (batch // len(self.cu_seqlens))

    def order(self, seq_len: int, cp: int, hp: int, sliding_window: int | None) -> tuple[int, ...] | None:
        """The ``chunk_order`` of a ``cp x hp`` layout (``None``: zigzag), for every row of the batch."""
        if self.chunk_order == "zigzag":
            return None
        return balanced_chunk_order(list(self.cu_seqlens), seq_len, cp, hp, sliding_window=sliding_window)


def cu_seqlens_from_eos(input_ids: Tensor, eos_id: int) -> list[Tensor]:
    """One ``cu_seqlens`` (int64, 1-D) per row of ``input_ids [B, S]`` (or ``[S]``): a document ends at,
    and includes, each EOS token; a row's last document may be cut off by the row's end."""
    if input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq] or [seq]; got shape {tuple(input_ids.shape)}")
    seq = input_ids.shape[1]
    out = []
    for row in input_ids:
        ends = (row[:-1] == eos_id).nonzero().flatten().cpu() + 1  # a document starts after each EOS
        zero, end = torch.zeros(1, dtype=torch.int64), torch.tensor([seq], dtype=torch.int64)
        out.append(torch.cat([zero, ends.to(torch.int64), end]))
    return out


def check_cu_seqlens(cu_seqlens: list[int] | tuple[int, ...], seq_len: int) -> None:
    """ValueError unless ``cu_seqlens`` starts at 0, ends at ``seq_len`` and strictly increases."""
    cu = list(cu_seqlens)
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != seq_len or any(a >= b for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens={cu[:16]} must start at 0, end at seq_len={seq_len} and strictly increase")


def document_position_ids(cu_seqlens: Tensor | list[Tensor], seq_len: int) -> Tensor:
    """Position ids ``[B, S]`` (``[S]`` for a single 1-D ``cu_seqlens``) that restart at 0 in each document."""
    rows = [cu_seqlens] if isinstance(cu_seqlens, Tensor) else list(cu_seqlens)
    positions = []
    for cu in rows:
        cu = cu.to(torch.int64).cpu()
        lengths = cu[1:] - cu[:-1]
        check_cu_seqlens(cu.tolist(), seq_len)
        starts = torch.repeat_interleave(cu[:-1], lengths)
        positions.append(torch.arange(seq_len, dtype=torch.int64) - starts)
    stacked = torch.stack(positions)
    return stacked[0] if isinstance(cu_seqlens, Tensor) else stacked


def packed_inputs(input_ids: Tensor, eos_id: int, mesh: Mesh | None = None) -> tuple[list[Tensor], Tensor]:
    """``(cu_seqlens, position_ids)`` for a packed full-sequence batch ``input_ids [B, S]``: the boundaries
    of the full sequence (pass them to ``loongtrain.attention`` / the model as they are) and this rank's
    shard of the per-document position ids (the whole ``[B, S]`` when ``mesh`` is ``None``)."""
    cu = cu_seqlens_from_eos(input_ids, eos_id)
    positions = document_position_ids(cu, input_ids.shape[-1]).to(input_ids.device)
    return cu, positions if mesh is None else shard_sequence(positions, mesh, 1)


def visible_pairs(cu_seqlens: Tensor | list[int] | None, seq_len: int, *, causal: bool = True,
                  sliding_window: int | None = None) -> int:
    """Number of visible (query, key) pairs of one row: the attention work (FLOPs are proportional)."""
    bounds = [0, seq_len] if cu_seqlens is None else [int(x) for x in cu_seqlens]
    total = 0
    for s, e in zip(bounds, bounds[1:]):
        total += _doc_pairs(e - s, causal, sliding_window)
    return total


def _doc_pairs(n: int, causal: bool, w: int | None) -> int:
    if w is None or w >= n:
        return n * (n + 1) // 2 if causal else n * n
    causal_pairs = w * (w + 1) // 2 + (n - w) * w  # rows 0..w-1 see i+1 keys, the rest w
    return causal_pairs if causal else 2 * causal_pairs - n


def visible_keys(cu_seqlens: Tensor | list[int] | None, seq_len: int, *, causal: bool = True,
                 sliding_window: int | None = None) -> Tensor:
    """``[S]`` int64: how many keys each query position sees (its row of the attention work)."""
    i = torch.arange(seq_len, dtype=torch.int64)
    bounds = torch.tensor([0, seq_len] if cu_seqlens is None else [int(x) for x in cu_seqlens], dtype=torch.int64)
    doc = torch.bucketize(i, bounds[1:], right=True)
    start, end = bounds[doc], bounds[doc + 1]
    w = sliding_window if sliding_window is not None else seq_len
    lo = torch.maximum(start, i - w + 1)
    hi = i if causal else torch.minimum(end - 1, i + w - 1)
    return hi - lo + 1


def rank_work(cu_seqlens: list | None, seq_len: int, cp: int, *, chunk_order: tuple[int, ...] | None = None,
              causal: bool = True, sliding_window: int | None = None) -> list[int]:
    """Visible (query, key) pairs each context rank computes for a batch (one ``cu_seqlens`` per row, or
    ``None`` for one document per row of a single row) under ``chunk_order`` (default zigzag). Head
    ranks split a context rank's work evenly (by heads)."""
    rows = [None] if cu_seqlens is None else list(cu_seqlens)
    per_token = sum(visible_keys(cu, seq_len, causal=causal, sliding_window=sliding_window) for cu in rows)
    return [int(per_token[shard_indices(seq_len, 1, cp, c, 0, chunk_order)].sum()) for c in range(cp)]


def balanced_chunk_order(cu_seqlens: list | None, seq_len: int, cp: int, hp: int = 1, *, chunks_per_rank: int = 8,
                         causal: bool = True, sliding_window: int | None = None) -> tuple[int, ...]:
    """A sequence layout (``chunk_order`` for :func:`loongtrain.shard_sequence`, :func:`loongtrain.gather_sequence`
    and :func:`loongtrain.attention`) that balances the visible-pair work of a known batch over ``cp`` ranks.

    The sequence is cut into ``cp * k`` equal chunks (``k = chunks_per_rank``, halved until the length
    allows it); largest-work chunks first, each goes to the least-loaded rank with room left (``k``
    chunks per rank); a rank keeps its chunks in sequence order. Every rank of the replica must compute
    it from the same ``cu_seqlens`` (it is deterministic)."""
    if chunks_per_rank < 1:
        raise ValueError(f"chunks_per_rank={chunks_per_rank} must be a positive integer")
    k = chunks_per_rank
    while k > 1 and seq_len % (cp * k):
        k //= 2
    n = cp * k
    rows = [None] if cu_seqlens is None else list(cu_seqlens)
    per_token = sum(visible_keys(cu, seq_len, causal=causal, sliding_window=sliding_window) for cu in rows)
    chunk_work = per_token.view(n, seq_len // n).sum(dim=1).tolist()
    load, members = [0] * cp, [[] for _ in range(cp)]
    for c in sorted(range(n), key=lambda c: (-chunk_work[c], c)):
        rank = min((r for r in range(cp) if len(members[r]) < k), key=lambda r: (load[r], r))
        members[rank].append(c)
        load[rank] += chunk_work[c]
    order = tuple(c for m in members for c in sorted(m))
    check_chunk_order(order, seq_len, hp, cp)
    return order


def cu_seqlens_from_starts(doc_starts: Tensor) -> list[Tensor]:
    """One ``cu_seqlens`` per row of ``doc_starts [B, S]`` (bool: the tokens that start a document, as the
    data pipeline gives them; token 0 always starts one)."""
    if doc_starts.dim() != 2:
        raise ValueError(f"doc_starts must be [batch, seq]; got shape {tuple(doc_starts.shape)}")
    seq = doc_starts.shape[1]
    out = []
    for row in doc_starts.cpu():
        starts = row.nonzero().flatten()
        starts = starts[starts > 0]
        out.append(torch.cat([torch.zeros(1, dtype=torch.int64), starts, torch.tensor([seq])]))
    return out
