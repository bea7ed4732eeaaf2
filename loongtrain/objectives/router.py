"""The trainer's router term for mixture-of-experts models (docs/moe-and-gpt-oss.md#mixture-of-experts).

Each micro-batch's forward records the router's statistics (:class:`~loongtrain.model.moe.RouterStats`, bound
by :func:`loongtrain.hf.moe.bind_moe`); :meth:`RouterLoss.add` turns them into the load-balancing loss of the
whole micro-batch (:func:`loongtrain.loss.router.load_balancing_loss`) and, when config.json's
``output_router_logits`` says so (as in HF's ``out.loss``), adds ``router_aux_loss_coef * aux`` to the
micro-batch's loss. The step's ``aux_loss`` metric is the mean over micro-batches and dp replicas.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from loongtrain.hf.moe import MoELayout, moe_layout, router_stats
from loongtrain.loss.router import load_balancing_loss
from loongtrain.model.moe import RouterStats
from loongtrain.parallel.mesh import Mesh

Tensor = torch.Tensor


class RouterLoss:
    """The load-balancing term of one model's micro-batches (module docstring)."""

    def __init__(self, stats: RouterStats, layout: MoELayout, mesh: Mesh) -> None:
        self.stats, self.layout, self.mesh = stats, layout, mesh
        self.values: list[Tensor] = []

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Record the statistics of the forward inside (not those of a recomputing backward)."""
        self.stats.open()
        try:
            yield
        finally:
            self.stats.close()

    def add(self, loss: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """``(loss_for_backward, value)`` of the micro-batch with its load-balancing loss (when trained on)."""
        aux = load_balancing_loss(self.stats, self.layout.num_experts, self.mesh)
        self.values.append(aux.detach().to(torch.float64))
        if not self.layout.output_router_logits:
            return loss, value
        coef = self.layout.aux_loss_coef
        return loss + coef * aux.to(loss.dtype), value + coef * aux.detach().to(value.dtype)

    def take(self) -> Tensor | None:
        """The mean aux loss of the micro-batches since the last call (a device scalar; None without any)."""
        values, self.values = self.values, []
        return torch.stack(values).mean() if values else None


def build_router_loss(model: nn.Module, mesh: Mesh) -> RouterLoss | None:
    """The :class:`RouterLoss` of a model with experts, else None: an HF model whose MoE blocks
    :func:`~loongtrain.hf.moe.bind_moe` bound (its config.json's coefficient; none for a family HF trains without
    one, DeepSeek-V3's), or loongtrain's decoder with
    ``moe_layers`` (a shape for planning: its ``aux_loss`` is reported, not trained on)."""
    stats = router_stats(model)
    if stats is not None:  # no load-balancing loss where HF defines none (DeepSeek-V3's bias-balanced routers)
        layout = moe_layout(model.config)
        return None if layout is None or not layout.load_balancing else RouterLoss(stats, layout, mesh)
    native = getattr(model, "router_stats", None)
    if isinstance(native, RouterStats):
        c = model.config
        return RouterLoss(native, MoELayout(c.moe_layers, c.num_experts, c.top_k, c.moe_ffn_dim, 0.0, False), mesh)
    return None
