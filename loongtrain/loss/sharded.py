"""Cross-entropy over a sequence-sharded replica without ever gathering logits."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from loongtrain.data.labels import IGNORE_INDEX
from loongtrain.parallel.mesh import Mesh

Tensor = torch.Tensor


def sharded_cross_entropy(logits: Tensor, labels: Tensor, mesh: Mesh | None) -> tuple[Tensor, Tensor]:
    """``(loss_for_backward, loss_value)`` for this rank's tokens ``logits [..., V]``, ``labels [...]``.

    The replica loss is ``sum over the replica's valid tokens / number of valid tokens`` (labels equal
    to ``IGNORE_INDEX`` = -100 are ignored). ``loss_for_backward = local_sum / replica_count`` (count
    all-reduced over ``mesh.sp_group``, no grad), so summing parameter gradients over the ``sp`` ranks
    gives the exact full-sequence gradient. ``loss_value`` is the detached replica loss, identical on
    every sp rank. Communication: forward, one all-reduce (sum) of two scalars over ``mesh.sp_group``,
    none when ``mesh`` is None or ``sp == 1``; backward, none.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits shape {tuple(logits.shape)} must be labels shape {tuple(labels.shape)} + (vocab,)"
        )
    vocab = logits.shape[-1]
    work = logits if logits.dtype == torch.float64 else logits.float()  # softmax in >= fp32
    local_sum = F.cross_entropy(
        work.reshape(-1, vocab), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return replica_mean(local_sum, (labels != IGNORE_INDEX).sum(), mesh)


def replica_mean(local_sum: Tensor, local_count: Tensor, mesh: Mesh | None) -> tuple[Tensor, Tensor]:
    """``(local_sum / replica_count, replica_sum / replica_count)``, the second detached.

    Communication: one all-reduce (sum) of ``[sum, count]`` over ``mesh.sp_group`` when ``mesh.sp > 1``
    (forward only; the count is a constant for the backward). An all-ignored replica gives 0.
    """
    stats = torch.stack([local_sum.detach(), local_count.to(local_sum.dtype)])
    if mesh is not None and mesh.sp > 1:
        dist.all_reduce(stats, group=mesh.sp_group)
    replica_sum, replica_count = stats[0], stats[1].clamp(min=1)
    return local_sum / replica_count, replica_sum / replica_count
