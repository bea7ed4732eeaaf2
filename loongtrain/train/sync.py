"""Gradient synchronisation without FSDP (``--zero none``; FSDP2 reduces gradients itself).

Loss convention (``loongtrain.loss.sharded.sharded_cross_entropy``): each rank back-propagates its
local token-loss sum divided by the replica's token count. Parameters are replicated on all
``world = dp * sp`` ranks, so the exact gradient of the dp-averaged loss is

    grad = (1 / dp) * sum over all world ranks of the local gradient

(the sum over the sp ranks of a replica gives that replica's full-sequence gradient; dividing the
sum over replicas by dp averages them). One all-reduce over the world group does both.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from loongtrain.parallel.runtime import is_distributed

BUCKET_BYTES = 32 * 1024 * 1024


def needs_grad_sync(model: nn.Module) -> bool:
    """False when gradients are already synchronised by a wrapper (FSDP2 DTensor parameters)."""
    if not is_distributed() or dist.get_world_size() == 1:
        return False
    return not any(type(p).__name__ == "DTensor" for p in model.parameters())


@torch.no_grad()
def all_reduce_gradients(params: list[nn.Parameter], dp: int, bucket_bytes: int = BUCKET_BYTES) -> None:
    """All-reduce SUM every gradient over the world in flat buckets, then divide by ``dp``.

    Parameters without a gradient get a zero one first so that every rank issues the same
    collectives (ranks must agree on the bucket layout).
    """
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    bucket: list[torch.Tensor] = []
    size = 0
    for p in params:
        grad = p.grad
        nbytes = grad.numel() * grad.element_size()
        if bucket and (grad.dtype != bucket[0].dtype or size + nbytes > bucket_bytes):
            _reduce_bucket(bucket, dp)
            bucket, size = [], 0
        bucket.append(grad)
        size += nbytes
    if bucket:
        _reduce_bucket(bucket, dp)


def _reduce_bucket(grads: list[torch.Tensor], dp: int) -> None:
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    if dp > 1:
        flat.div_(dp)
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset : offset + n].view_as(g))
        offset += n
