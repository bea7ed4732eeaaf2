"""``loongtrain export CHECKPOINT --hf OUT``: a training checkpoint as a Hugging Face model directory.

CHECKPOINT is a checkpoint directory (``OUT_DIR/checkpoints/step_N``), a checkpoints root or a run's
``--out-dir`` (their ``latest`` is taken). The model is rebuilt from what the checkpoint records
(:func:`loongtrain.train.models.model_record`: the preset's ModelConfig, or the HF model's config),
its weights are read with ``torch.distributed.checkpoint`` in this one process (any training layout),
and :func:`loongtrain.hf.export_hf` writes ``config.json`` + ``model.safetensors``, which
``transformers.AutoModelForCausalLM.from_pretrained(OUT)`` loads. Native presets become
``LlamaForCausalLM`` with ``rms_norm_eps`` written explicitly. Exit codes: 0 ok, 2 bad input.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from loongtrain.hf.convert import export_hf
from loongtrain.train import models
from loongtrain.train.checkpoint import find_checkpoint, read_trainer_state
from loongtrain.train.config import TrainConfig, param_dtype
from loongtrain.train.models import model_from_record

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}


def _record(state: dict[str, Any]) -> dict[str, Any]:
    """The model record of a checkpoint; for checkpoints without one, rebuilt from the run's config."""
    if "model_config" in state or "hf_config" in state:
        return state
    cfg = TrainConfig.from_dict(state["config"])
    return models.model_record(models.model_config_for(cfg), cfg)


def load_trained_model(checkpoint: str | Path) -> nn.Module:
    """The model of a checkpoint with its trained weights, whole, on CPU, in the dtype it trained in."""
    path = find_checkpoint(checkpoint)
    state = read_trainer_state(path)
    dtype = param_dtype(TrainConfig.from_dict(state["config"]))
    model = model_from_record(_record(state), dtype)
    weights = get_model_state_dict(model)
    with warnings.catch_warnings():  # one process: DCP warns that torch.distributed is off
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": weights}, checkpoint_id=str(path))
    set_model_state_dict(model, weights)
    return model


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, *, dtype: torch.dtype | None = None) -> Path:
    """Write the checkpoint's model as a Hugging Face directory ``out_dir`` (``dtype``: the tensors' dtype,
    default as trained); returns ``out_dir``."""
    model = load_trained_model(checkpoint)
    if dtype is not None:
        model = model.to(dtype)
    return export_hf(model, None, out_dir)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="loongtrain export", description="Write a training checkpoint's model as a "
                                "Hugging Face directory (config.json + model.safetensors) for from_pretrained.")
    p.add_argument("checkpoint", help="checkpoint directory (OUT_DIR/checkpoints/step_N), checkpoints root or "
                   "run directory (its latest checkpoint)")
    p.add_argument("--hf", required=True, metavar="OUT", help="output Hugging Face model directory")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="dtype of the written tensors (default: as trained)")
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2)
        return int(exc.code or 0)
    try:
        out = export_checkpoint(args.checkpoint, args.hf, dtype=DTYPES.get(args.dtype))
    except ValueError as exc:
        print(f"loongtrain export: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out / 'config.json'} and {out / 'model.safetensors'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
