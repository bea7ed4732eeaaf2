"""One optimizer step of a 2D-Attention model: sharded forward/backward, gradient sync, clip, AdamW."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from loongtrain.model.config import ModelConfig
from loongtrain.model.llama import Transformer
from loongtrain.parallel.mesh import Mesh
from loongtrain.parallel.sharding import shard_sequence
from loongtrain.train.config import TrainConfig
from loongtrain.train.loss import sharded_cross_entropy
from loongtrain.train.optim import build_optimizer, clip_grad_norm
from loongtrain.train.parallelize import parallelize
from loongtrain.train.sync import all_reduce_gradients, needs_grad_sync

Batch = dict[str, torch.Tensor]


def param_dtype(cfg: TrainConfig) -> torch.dtype:
    """Storage dtype of the weights: float64 for --dtype fp64, else float32 (bf16 runs use autocast)."""
    return torch.float64 if cfg.dtype == "fp64" else torch.float32


def autocast_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype | None:
    """bf16 autocast for --dtype bf16, and for --dtype auto on CUDA; None means no autocast."""
    if cfg.dtype == "bf16" or (cfg.dtype == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None


class Trainer:
    """Model, optimizer and schedule of one rank, and :meth:`step` (one optimizer step).

    ``step`` takes ``grad_accum`` micro-batches of this replica's *full* sequences
    (``input_ids``, ``labels``, ``position_ids`` of shape ``[batch, seq_len]``); each rank keeps its
    2D zigzag shard (:func:`loongtrain.shard_sequence`), so the trainer is layout-agnostic.
    """

    def __init__(self, cfg: TrainConfig, mesh: Mesh, device: torch.device,
                 model_config: ModelConfig) -> None:
        self.cfg, self.mesh, self.device = cfg, mesh, device
        model = Transformer(model_config, seed=cfg.seed).to(param_dtype(cfg))
        self.model: nn.Module = parallelize(model, mesh, cfg.parallel, device)
        self.params = [p for _, p in sorted(self.model.named_parameters(), key=lambda kv: kv[0])]
        self.grad_sync = needs_grad_sync(self.model)
        self.optimizer, self.scheduler = build_optimizer(self.model, cfg)
        self.amp_dtype = autocast_dtype(cfg, device)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def _local(self, x: torch.Tensor) -> torch.Tensor:
        return shard_sequence(x, self.mesh, dim=1).to(self.device, non_blocking=True)

    def step(self, micro_batches: list[Batch]) -> dict[str, Any]:
        """Forward/backward every micro-batch, synchronise and clip gradients, apply AdamW.

        Returns ``loss`` (mean over micro-batches and dp replicas, identical on every rank),
        ``grad_norm`` (before clipping) and ``lr`` (the rate used for this step).
        """
        assert len(micro_batches) == self.cfg.grad_accum
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for batch in micro_batches:
            input_ids, labels = self._local(batch["input_ids"]), self._local(batch["labels"])
            position_ids = self._local(batch["position_ids"])
            with self._autocast():
                logits = self.model(input_ids, position_ids)
            loss, value = sharded_cross_entropy(logits, labels, self.mesh)
            (loss / len(micro_batches)).backward()
            loss_sum += value.detach().to(torch.float64)
        if self.grad_sync:
            all_reduce_gradients(self.params, self.mesh.dp)
        grad_norm = clip_grad_norm(self.params, self.cfg.clip)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        loss_value = loss_sum / len(micro_batches)
        if self.mesh.dp > 1:
            dist.all_reduce(loss_value, group=self.mesh.dp_group)
            loss_value /= self.mesh.dp
        return {"loss": float(loss_value), "grad_norm": grad_norm, "lr": float(lr)}
