"""What ``loongtrain eval MODEL`` evaluates (docs/evaluation.md): a run directory (its
``checkpoints/latest``), a checkpoint directory, or a Hugging Face model directory.

- :func:`resolve_model` (launcher, before any worker): the kind, the checkpoint (complete, every file
  verified against its checksum: :func:`~loongtrain.train.checkpoint.verify_checkpoint`) or directory, and the
  :class:`~loongtrain.train.config.TrainSections` the model came with (a checkpoint's recorded run config,
  or the defaults with ``--model DIR``): its tokenizer, corpus, dtype and ``--doc-mask`` are the evaluation's
  defaults. ValueError naming the path when it is none of the three kinds.
- :func:`build_model` (every rank): the model with its weights under the evaluation's layout. A
  checkpoint: :func:`~loongtrain.train.model_setup.model_from_record` (whole, on CPU), then
  :func:`~loongtrain.parallelize.compose.parallelize` (2D-Attention, FSDP2 with ``--zero``), then the
  weights read with ``torch.distributed.checkpoint`` into whatever shards the rank holds (any training
  layout). A LoRA checkpoint (docs/lora.md): its base rebuilt and checked unchanged
  (:mod:`loongtrain.train.lora_base`), the adapters applied by ``parallelize`` and read from the checkpoint.
  A Hugging Face directory: the trainer's own builder.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from loongtrain.model.config import ModelConfig
from loongtrain.parallel.mesh import Mesh
from loongtrain.parallelize.compose import parallelize
from loongtrain.parallelize.zero import uses_zero
from loongtrain.sections.model import autocast_dtype, param_dtype
from loongtrain.train.checkpoint import LATEST, STATE_FILE, find_checkpoint, load_model_weights, verify_checkpoint
from loongtrain.train.config import TrainSections
from loongtrain.train.export import checkpoint_model_record
from loongtrain.train.lora_base import build_base, check_base
from loongtrain.train.model_setup import model_from_record

log = logging.getLogger("loongtrain.eval")

KINDS = ("run directory (OUT_DIR with checkpoints/latest)", "checkpoint directory (with trainer_state.json)",
         "Hugging Face model directory (with config.json)")


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """``kind``: "checkpoint" or "hf"; ``path``: the checkpoint or HF directory; ``run``: the model's
    run config; ``record``: a checkpoint's model record (None for an HF directory)."""

    kind: str
    path: Path
    run: TrainSections
    record: dict[str, Any] | None = None


def resolve_model(model: str) -> ModelSource:
    """The :class:`ModelSource` that ``model`` names; ValueError naming it and the three kinds otherwise."""
    path = Path(model)
    is_checkpoint = path.is_dir() and any((root / name).is_file() for root in (path, path / "checkpoints")
                                          for name in (STATE_FILE, LATEST))
    if is_checkpoint:
        checkpoint = find_checkpoint(path)  # complete checkpoints only
        state = verify_checkpoint(checkpoint)  # every file against its checksum: the bad one is named here
        run = TrainSections.recorded(state.get("config") or {})
        check_base(state, str(checkpoint))  # a LoRA checkpoint's base: still the one it trained on
        return ModelSource("checkpoint", checkpoint, run, checkpoint_model_record(state))
    if path.is_dir() and (path / "config.json").is_file():
        if not any(path.glob("*.safetensors")):
            log.warning("MODEL %s has no *.safetensors weights: evaluating randomly initialised weights", path)
        return ModelSource("hf", path, TrainSections().replace(model=str(path)))
    raise ValueError(f"MODEL {model!r} is none of: {'; '.join(KINDS)}")


def model_config(source: ModelSource) -> ModelConfig:
    """The model's shape (heads for the layout rules, vocabulary, sliding window)."""
    from loongtrain.hf.convert import shape_config_from_hf

    if source.kind == "hf":
        from loongtrain.hf.load import check_hf_dir

        return shape_config_from_hf(check_hf_dir(source.path))
    assert source.record is not None
    if "model_config" in source.record:
        return ModelConfig(**source.record["model_config"])
    from loongtrain.hf.load import hf_config_from_dict

    return shape_config_from_hf(hf_config_from_dict(source.record["hf_config"]))


def trained_length(source: ModelSource) -> tuple[int, str]:
    """``(length, what)``: the model's ``max_position_embeddings`` (HF) or the ``--seq-len`` it trained at."""
    values: dict[str, Any] = {}
    if source.kind == "hf":
        import json

        values = json.loads((source.path / "config.json").read_text())
    elif source.record is not None and "hf_config" in source.record:
        values = source.record["hf_config"]
    if values.get("max_position_embeddings"):
        return int(values["max_position_embeddings"]), "max_position_embeddings"
    return source.run.data.seq_len, "trained --seq-len"


def build_model(source: ModelSource, cfg: TrainSections, mesh: Mesh, device: torch.device) -> nn.Module:
    """The model of ``source`` with its weights, parallelized on ``mesh`` by ``cfg.parallel`` (collective)."""
    fsdp_dtype = autocast_dtype(cfg.model.dtype, device) if uses_zero(cfg.parallel) else None
    if source.kind == "hf":
        from loongtrain.train.model_setup import build_model as build_trained

        model = build_trained(model_config(source), cfg, mesh, device, fsdp_dtype)
    elif source.record.get("lora"):  # the base, then the adapters on it (only they are in the checkpoint)
        model = build_base(source.record).to(param_dtype(cfg.model.dtype))
        model = parallelize(model, mesh, cfg.parallel, device, param_dtype=fsdp_dtype,
                            lora=source.run.model.lora_config(), seed=source.run.optim.seed)
        load_model_weights(source.path, model)
    else:
        model = model_from_record(source.record, param_dtype(cfg.model.dtype))
        model = parallelize(model, mesh, cfg.parallel, device, param_dtype=fsdp_dtype)
        load_model_weights(source.path, model)
    return model.eval()


