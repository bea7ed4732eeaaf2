"""AdamW with decoupled weight decay on matrices only, a warmup + cosine schedule, and gradient clipping."""

from __future__ import annotations

import math

import torch
from torch import nn

from loongtrain.sections.training import OptimSection


def lr_factor(step: int, *, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of the peak learning rate for optimizer step ``step`` (0-based).

    Linear warmup ``(step + 1) / warmup`` for the first ``warmup`` steps, then a cosine from 1 down
    to ``min_ratio`` reached at the last step ``total - 1``.
    """
    if step < warmup:
        return (step + 1) / warmup
    decay_steps = max(1, total - 1 - warmup)
    progress = min(1.0, (step - warmup) / decay_steps)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def adamw_implementation(device: torch.device, offload_params: bool) -> dict[str, bool]:
    """How AdamW steps (docs/kernels.md#host-work): on CUDA ``fused`` (one kernel per group of tensors, no
    temporaries); elsewhere ``foreach`` (a few kernels per group, bit for bit the single-tensor step's arithmetic:
    tests/unit/test_host_work.py); with ``--offload-params`` the single-tensor step on the host, whose temporaries
    are one parameter's (the memory model's ``ADAMW_STEP_TEMPORARIES``), where foreach's would be every one's."""
    if offload_params:
        return {"foreach": False}
    if torch.device(device).type == "cuda":
        return {"fused": True}
    return {"foreach": True}


def build_optimizer(
    model: nn.Module, cfg: OptimSection, offload_params: bool = False
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW (weight decay on >= 2-D weights, none on norms) and its LambdaLR schedule; ``offload_params``: the
    step runs on the host (FSDP2's ``CPUOffloadPolicy``)."""
    decay, no_decay = [], []
    for _, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    params = [p for g in groups for p in g["params"]]
    device = params[0].device if params else torch.device("cpu")
    optimizer = torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
        **adamw_implementation(device, offload_params),
    )

    def factor(step: int) -> float:
        return lr_factor(step, warmup=cfg.warmup, total=cfg.steps, min_ratio=cfg.min_lr_ratio)

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    return optimizer, scheduler


@torch.no_grad()
def fill_missing_grads(params: list[torch.Tensor]) -> None:
    """Give every parameter that got no gradient this step a zero one, so that AdamW treats it alike at every
    world size (docs/kernels.md#gradient-sync): replicated across ranks the sync fills it with zeros where a
    peer had a gradient, so a single rank must too (AdamW then decays the weight and its moments, as on any
    rank of a larger run)."""
    for p in params:
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)


def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip the global L2 norm of the (already synchronised) gradients; return the norm before clipping, a
    float64 scalar on the gradients' device (not read back: the trainer reads it with the step's guard).

    Gradients are replicated after synchronisation, so every rank computes the same norm locally: each
    gradient's fp64 norm (``torch._foreach_norm``, one kernel per device and dtype), their norm, and one
    ``_foreach_mul_`` per device and dtype to clip. ``max_norm <= 0`` only measures.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    if any(type(g).__name__ == "DTensor" for g in grads):  # FSDP2 shards: torch reduces across ranks
        total = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
        total = total.full_tensor() if hasattr(total, "full_tensor") else total
        return total.to(torch.float64)
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        by_kind.setdefault((g.device, g.dtype), []).append(g)
    norms = [n.to(grads[0].device) for group in by_kind.values()
             for n in torch._foreach_norm(group, 2, dtype=torch.float64)]  # one kernel per group (fp64 sums)
    total = torch.linalg.vector_norm(torch.stack(norms))
    if max_norm > 0:
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for (device, dtype), group in by_kind.items():
            torch._foreach_mul_(group, coef.to(device=device, dtype=dtype))
    return total
