"""The router's load-balancing loss over the whole sequence of a micro-batch
(docs/moe-and-gpt-oss.md#mixture-of-experts).

Hugging Face's ``load_balancing_loss_func`` (Switch Transformer, eqs. 4-6): with ``f_e`` the fraction of top-k
assignments that went to expert ``e`` and ``P_e`` the mean router probability of ``e``, both over every token and
every MoE layer of the forward, ``aux = num_experts * sum_e f_e * P_e``. Each rank holds ``S/sp`` tokens, so the
per-expert sums (:class:`~loongtrain.model.moe.RouterStats`) are summed over the sequence ranks *before* the
product (:func:`loongtrain.parallel.comm.sum_over_ranks`): the value equals the unsharded one, not a mean of
per-shard products, and its gradient is exact when the parameter gradients are summed over the sp ranks.
"""

from __future__ import annotations

import torch

from loongtrain.model.moe import RouterStats
from loongtrain.parallel.comm import sum_over_ranks
from loongtrain.parallel.mesh import Mesh

Tensor = torch.Tensor


def load_balancing_loss(stats: RouterStats, num_experts: int, mesh: Mesh | None) -> Tensor:
    """``num_experts * sum_e f_e * P_e`` of the forward ``stats`` recorded, over the whole sequence (the same
    value on every sp rank). Communication: one all-reduce (sum) of ``2 * num_experts + 1`` values over
    ``mesh.sp_group`` when ``sp > 1``; backward: none. ValueError when ``stats`` recorded no layer."""
    if stats.counts is None or stats.probs is None:
        raise ValueError("the router statistics hold no layer: open() them before the forward of an MoE model")
    rows = stats.probs.new_tensor([float(stats.rows)])
    local = torch.cat([stats.counts, stats.probs, rows])
    group = mesh.sp_group if mesh is not None and mesh.sp > 1 else None
    total = sum_over_ranks(local, group)
    counts, probs, rows = total[:num_experts], total[num_experts:2 * num_experts], total[-1]
    return num_experts * torch.sum((counts / rows) * (probs / rows))
