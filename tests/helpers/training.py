"""Train in this process the way a worker does (tests): the run resolved as the launcher would, then
``Trainer(run, mesh, device, batches).train()``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from loongtrain.launch.config import TrainConfig, run_of
from loongtrain.model.config import ModelConfig
from loongtrain.parallel.mesh import Mesh
from loongtrain.train.checkpoint import resolve_checkpoint
from loongtrain.train.model_setup import build_run_tokenizer, model_config_for
from loongtrain.train.trainer import BatchSource, Trainer


def fit(cfg: TrainConfig, mesh: Mesh, device: torch.device, *, model_config: ModelConfig | None = None,
        batch_source: BatchSource | None = None, evaluations: tuple = ()) -> list[dict[str, Any]]:
    """The step records of ``cfg`` trained on ``mesh`` (every rank calls it); ``--resume`` resolved here;
    ``evaluations``: the run's in-loop evaluations (``Run.evaluations``)."""
    tokenizer = build_run_tokenizer(cfg.model)
    resume = resolve_checkpoint(cfg.output.resume, Path(cfg.output.out_dir)) if cfg.output.resume else None
    run = run_of(cfg, model_config or model_config_for(cfg.model, tokenizer), tokenizer=tokenizer,
                 resume=str(resume or ""), evaluations=evaluations)
    return Trainer(run, mesh, device, batch_source).train()
