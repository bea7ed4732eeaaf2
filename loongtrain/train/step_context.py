"""The step context (docs/design.md#how-to-add-an-objective): what one rank's training step runs on, and the one
thing the trainer hands its collaborators (the objective, DPO's reference, the memory report, the simulation)
instead of itself: the model, the mesh, the device, how a batch is laid on this rank, the compute's autocast, and
the forward to the final norm's input."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from loongtrain.loss.chunked import FinalNorm
from loongtrain.model.config import ModelConfig
from loongtrain.parallel.mesh import Mesh
from loongtrain.train.batch import Batch, BatchSharding, LocalBatch
from loongtrain.train.model_setup import loss_inputs

Tensor = torch.Tensor


@dataclass(frozen=True)
class StepContext:
    """One rank's step: ``model`` (parallelized), ``model_config`` (its shape), ``mesh``, ``device``, ``sharding``
    (the run's rules for laying a full-sequence batch on this rank) and ``amp_dtype`` (the autocast dtype; None:
    FSDP2 casts the weights, or the run computes in its parameters' dtype)."""

    model: nn.Module
    model_config: ModelConfig
    mesh: Mesh
    device: torch.device
    sharding: BatchSharding
    amp_dtype: torch.dtype | None

    def autocast(self) -> contextlib.AbstractContextManager:
        """The run's autocast (nothing without one)."""
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def local(self, batch: Batch) -> LocalBatch:
        """A full-sequence micro-batch laid on this rank (:meth:`~loongtrain.train.batch.BatchSharding.local`)."""
        return self.sharding.local(batch)

    def forward(self, local: LocalBatch, model: nn.Module | None = None) -> tuple[Tensor, Tensor, FinalNorm | None]:
        """``(hidden, head_weight, norm)`` of ``model`` (default: the trained one) on a batch laid on this rank: the
        hidden states before the final norm, for a chunked loss (:func:`~loongtrain.train.model_setup.loss_inputs`).
        Under the caller's autocast (:meth:`autocast`)."""
        return loss_inputs(model if model is not None else self.model, local.input_ids, local.position_ids,
                           local.cu_seqlens, local.chunk_order)
