"""The supervised fine-tuning loss: the mean over every target token of the optimizer step (docs/post-training.md).

A step's loss is ``sum over all its target tokens (every replica, micro-batch and sequence) of their
cross-entropy / N``, ``N`` the step's target count, counted from the step's full-sequence micro-batches
before any forward (:func:`target_count`; the trainer all-reduces it over the dp replicas once a step). So
it is the same at every layout, and a rank, a sequence or a whole micro-batch without a target adds 0 to
the sum and nothing to ``N``: never a NaN. The trainer averages each micro-batch's loss over the step's
micro-batches and its replicas (``loss / micro_batches`` backward, the gradients averaged over dp); so each
micro-batch gives ``local_sum * scale`` with ``scale = dp * micro_batches / N`` (:func:`step_scale`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from loongtrain.loss.chunked import FinalNorm, chunked_token_sum
from loongtrain.loss.sharded import IGNORE_INDEX
from loongtrain.parallel.mesh import Mesh

Tensor = torch.Tensor


def target_count(labels: Sequence[Tensor]) -> int:
    """Target tokens of full-sequence micro-batches (labels other than ``IGNORE_INDEX``): host values."""
    return int(sum(int((x != IGNORE_INDEX).sum()) for x in labels))


def step_scale(step_targets: float, micro_batches: int, dp: int) -> float:
    """``dp * micro_batches / step_targets`` (module docstring); 0 for a step without targets."""
    return dp * micro_batches / step_targets if step_targets else 0.0


def replica_sum(value: Tensor, mesh: Mesh | None) -> Tensor:
    """``value`` summed over the replica's sp ranks. Communication: one all-reduce (sum) over
    ``mesh.sp_group`` when ``sp > 1`` (no gradient: for detached values)."""
    value = value.detach().clone()
    if mesh is not None and mesh.sp > 1:
        dist.all_reduce(value, group=mesh.sp_group)
    return value


def sft_loss(hidden: Tensor, head: Tensor, labels: Tensor, mesh: Mesh | None, scale: float, *,
             norm: FinalNorm | None = None, bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(local_sum * scale, replica_sum * scale)`` of this rank's shard of a micro-batch: the chunked
    cross-entropy's sum over the rank's target tokens (:func:`~loongtrain.loss.chunked.chunked_token_sum`),
    scaled by :func:`step_scale`; the second detached and identical on every sp rank. Communication: one
    all-reduce of one scalar over ``mesh.sp_group`` (forward); backward, none."""
    local_sum = chunked_token_sum(hidden, head, labels, bias=bias, norm=norm)
    return local_sum * scale, replica_sum(local_sum, mesh) * scale
