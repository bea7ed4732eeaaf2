"""``loongtrain eval --task position-loss``: mean loss per position bucket (docs/evaluation.md).

Buckets are powers of two, ``[0, b0), [b0, 2 b0), [2 b0, 4 b0) ... [.., seq_len)``, with ``b0 = 1024``
from ``seq_len >= 8192`` and ``2**floor(log2 seq_len) / 8`` below (so a short evaluation still has four
buckets). A token's position is its position id (inside its document under ``--doc-mask on
--position-reset``, else in the sequence): how much context precedes the token it predicts. Each rank
scores its own tokens (:func:`~loongtrain.loss.chunked.chunked_token_losses`), adds their losses and
counts per bucket, and one all-reduce of ``2 x buckets`` float64 values sums them over every rank.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from loongtrain.eval.forward import Batch, all_reduce_sum, replica_items, sharded_forward
from loongtrain.loss.chunked import chunked_token_losses
from loongtrain.loss.sharded import IGNORE_INDEX
from loongtrain.parallel.mesh import Mesh


def bucket_edges(seq_len: int) -> list[int]:
    """``[0, b0, 2 b0, ..., seq_len]``: the bucket boundaries for sequences of ``seq_len`` tokens."""
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be positive")
    first = 1024 if seq_len >= 8192 else max(1, 2 ** int(math.log2(seq_len)) // 8)
    edges = [0]
    while edges[-1] < seq_len:
        edges.append(min(seq_len, first if edges[-1] == 0 else 2 * edges[-1]))
    return edges


def bucket_sums(losses: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
                edges: list[int]) -> torch.Tensor:
    """``[2, buckets]`` float64: the loss sum and the token count of each bucket (``valid`` tokens only)."""
    bounds = torch.tensor(edges[1:-1], dtype=positions.dtype, device=positions.device)
    bucket = torch.bucketize(positions.reshape(-1), bounds, right=True)
    keep = valid.reshape(-1)
    n = len(edges) - 1
    sums = torch.zeros(n, dtype=torch.float64, device=losses.device).index_add_(
        0, bucket[keep], losses.reshape(-1)[keep].to(torch.float64))
    counts = torch.bincount(bucket[keep], minlength=n).to(torch.float64)
    return torch.stack([sums, counts])


def position_loss(model: nn.Module, batches: list[Batch], mesh: Mesh, device: torch.device, seq_len: int,
                  **layout: Any) -> list[dict]:
    """``[{start, end, loss, tokens}]`` over every bucket of ``batches`` (all replicas' batches, each
    ``[1, seq_len]``; replica ``d`` evaluates every ``dp``-th one), laid out as the run's: ``layout`` is
    :func:`~loongtrain.eval.forward.sharded_forward`'s (``amp_dtype``, ``doc_mask``, ``position_reset``,
    ``chunk_order``, ``sliding_window``). ``loss`` is None for an empty bucket. Collective (every rank)."""
    edges = bucket_edges(seq_len)
    totals = torch.zeros(2, len(edges) - 1, dtype=torch.float64, device=device)
    for item in replica_items(len(batches), mesh):
        tokens = sharded_forward(model, batches[item if item is not None else 0], mesh, device, **layout)
        losses, _ = chunked_token_losses(tokens.hidden, tokens.head, tokens.labels)
        if item is not None:  # padding rounds (see replica_items) only keep the collectives in step
            totals += bucket_sums(losses, tokens.positions, tokens.labels != IGNORE_INDEX, edges)
    totals = all_reduce_sum(totals).cpu()
    return _rows(edges, totals[0].tolist(), totals[1].tolist())


def _rows(edges: list[int], sums: Iterable[float], counts: Iterable[float]) -> list[dict]:
    return [{"start": start, "end": end, "loss": (s / c) if c else None, "tokens": int(c)}
            for start, end, s, c in zip(edges[:-1], edges[1:], sums, counts)]
