"""Direct preference optimisation's loss on sequence-sharded pairs (docs/post-training.md).

A row of a DPO batch packs whole pairs: pair ``k``'s prompt + chosen completion is sequence ``2k``, its
prompt + rejected completion sequence ``2k + 1`` (documents of their own). ``segment [B, S]`` names, for
every label that is a completion token, the sequence it belongs to (-1 for the rest: prompts, padding, the
last token of a sequence). A sequence's log-probability is the sum of its completion tokens' ones
(:func:`sequence_logps`: each rank sums its shard, then one all-reduce over the replica's sp ranks), and

    loss = mean over the step's pairs of -logsigmoid(beta * ((pc - rc) - (pr - rr)))

with ``pc, pr`` the policy's and ``rc, rr`` the reference's log-probabilities of chosen and rejected. As for
the SFT loss (loongtrain/loss/sft.py) the step's pair count ``P`` is known before the forward, so each
micro-batch gives ``sum of its pairs' losses * scale`` with ``scale = dp * micro_batches / P``. Metrics as
TRL names them (:data:`REWARD_METRICS`): the implicit rewards ``beta * (pc - rc)`` and ``beta * (pr - rr)``,
their margin and how often chosen beats rejected, means over the step's pairs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from loongtrain.parallel.mesh import Mesh

Tensor = torch.Tensor

#: the metrics a DPO step adds to its record (TRL's names), in :func:`dpo_loss`'s ``stats`` order
REWARD_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies")


class _ReplicaSum(torch.autograd.Function):
    """forward: all-reduce (sum) over the sp group; backward: the identity, no communication (every rank
    computes the same function of the sum, so the ranks' gradients through their own terms add up)."""

    @staticmethod
    def forward(ctx, local: Tensor, group) -> Tensor:
        total = local.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


def sequence_logps(token_logps: Tensor, segment: Tensor, num_sequences: int, mesh: Mesh | None) -> Tensor:
    """``[B, num_sequences]``: each sequence's sum of its tokens' log-probabilities over the whole replica.
    ``token_logps [B, s]`` and ``segment [B, s]`` are this rank's shard. Differentiable: the value is the
    replica's sum, the gradient reaches this rank's own terms. Communication: forward, one all-reduce (sum)
    of ``B * num_sequences`` values over ``mesh.sp_group`` when ``sp > 1``; backward, none."""
    if token_logps.shape != segment.shape:
        raise ValueError(f"token_logps {tuple(token_logps.shape)} and segment {tuple(segment.shape)} must match")
    inside = segment >= 0
    local = torch.zeros(segment.shape[0], num_sequences, dtype=token_logps.dtype, device=token_logps.device)
    local = local.scatter_add(1, segment.clamp(min=0), torch.where(inside, token_logps, 0))
    if mesh is None or mesh.sp == 1:
        return local
    return _ReplicaSum.apply(local, mesh.sp_group)


def pair_mask(num_pairs: Tensor, max_pairs: int) -> Tensor:
    """``[B, max_pairs]`` bool: which pair slots of each row hold a pair."""
    return torch.arange(max_pairs, device=num_pairs.device)[None, :] < num_pairs[:, None]


def dpo_loss(policy: Tensor, reference: Tensor, num_pairs: Tensor, beta: float,
             scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(loss_for_backward, value, stats)`` of one micro-batch from the sequences' log-probabilities
    ``policy`` and ``reference`` (``[B, 2 * max_pairs]``: chosen at even, rejected at odd columns) and each
    row's pair count: ``sum of the pairs' -logsigmoid(beta * margin) * scale``, its detached value, and the
    detached sums of :data:`REWARD_METRICS` (rewards chosen, rejected, margins, accuracies) over its pairs.
    Communication: none."""
    reference = reference.to(policy.dtype)
    valid = pair_mask(num_pairs.to(policy.device), policy.shape[1] // 2)
    chosen = beta * (policy[:, 0::2] - reference[:, 0::2])
    rejected = beta * (policy[:, 1::2] - reference[:, 1::2])
    losses = torch.where(valid, -F.logsigmoid(chosen - rejected), 0)
    total = losses.sum()
    with torch.no_grad():
        c, r = torch.where(valid, chosen, 0), torch.where(valid, rejected, 0)
        stats = torch.stack([c.sum(), r.sum(), (c - r).sum(), (valid & (chosen > rejected)).sum().to(c.dtype)])
    return total * scale, total.detach() * scale, stats
