"""``loongtrain export CHECKPOINT --hf OUT``: a training checkpoint as a Hugging Face model directory.

CHECKPOINT is a checkpoint directory (``OUT_DIR/checkpoints/step_N``), a checkpoints root or a run's
``--out-dir`` (their ``latest`` is taken). The model is rebuilt from what the checkpoint records
(:func:`loongtrain.train.run_model.model_record`: the preset's ModelConfig, or the HF model's config),
its weights are read with ``torch.distributed.checkpoint`` in this one process (any training layout),
and :func:`loongtrain.hf.export_hf` writes ``config.json`` + ``model.safetensors``, which
``transformers.AutoModelForCausalLM.from_pretrained(OUT)`` loads. Native presets become
``LlamaForCausalLM`` with ``rms_norm_eps`` written explicitly. Exit codes: 0 ok, 2 bad input.

Nothing of the user's is destroyed (docs/design.md §10): the checkpoint is verified first (checksums,
as ``train --resume`` does); ``--hf`` must not be empty, a file, or inside the run's checkpoints (nor
hold the checkpoint); an existing non-empty ``--hf`` is refused unless ``--overwrite``, which replaces
it whole (nothing of the old directory stays behind). The result is written next to the target and
renamed into place, so a failed export leaves the target as it was.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from loongtrain._input import OneLineParser, user_error
from loongtrain.hf.convert import export_hf
from loongtrain.train import run_model
from loongtrain.train.checkpoint import find_checkpoint, load_model_weights, verify_checkpoint
from loongtrain.train.config import TrainConfig, param_dtype
from loongtrain.train.run_model import model_from_record

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}


def checkpoint_model_record(state: dict[str, Any]) -> dict[str, Any]:
    """The model record of a checkpoint; for checkpoints without one, rebuilt from the run's config."""
    if "model_config" in state or "hf_config" in state:
        return state
    cfg = TrainConfig.from_dict(state["config"])
    return run_model.model_record(run_model.model_config_for(cfg), cfg)


def load_trained_model(checkpoint: str | Path) -> nn.Module:
    """The model of a checkpoint with its trained weights, whole, on CPU, in the dtype it trained in."""
    path = find_checkpoint(checkpoint)
    state = verify_checkpoint(path)  # the checks of train --resume: state, metadata, sizes, checksums
    dtype = param_dtype(TrainConfig.from_dict(state["config"]))
    model = model_from_record(checkpoint_model_record(state), dtype)
    load_model_weights(path, model)
    return model


def check_target(out_dir: str | Path, checkpoint: Path, *, overwrite: bool = False) -> Path:
    """The export directory ``out_dir``, checked: not empty text, not a file, not inside the run's
    checkpoints directory nor holding the checkpoint, and, unless ``overwrite``, not an existing
    non-empty directory. ValueError naming the rule otherwise."""
    if not str(out_dir).strip():
        raise ValueError("--hf '' is empty: name the output directory")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--hf {str(out)!r} is a file; it must be a directory (or not exist yet)")
    target, ckpt = out.resolve(), Path(checkpoint).resolve()
    root = ckpt.parent  # the run's checkpoints directory
    if target == root or root in target.parents:
        raise ValueError(f"--hf {str(out)!r} lies inside the run's checkpoints {str(root)!r}; export elsewhere")
    if target in ckpt.parents:
        raise ValueError(f"--hf {str(out)!r} holds the checkpoint {str(ckpt)!r}; export elsewhere")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"--hf {str(out)!r} exists and is not empty; pass --overwrite to replace it (its "
                         f"files are deleted) or choose a new directory")
    return out


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, *, dtype: torch.dtype | None = None,
                      overwrite: bool = False) -> Path:
    """Write the checkpoint's model as a Hugging Face directory ``out_dir`` (``dtype``: the tensors' dtype,
    default as trained); returns ``out_dir``. An existing non-empty ``out_dir`` is a ValueError unless
    ``overwrite`` (then it is replaced whole); see :func:`check_target`."""
    out = check_target(out_dir, find_checkpoint(checkpoint), overwrite=overwrite)
    model = load_trained_model(checkpoint)
    if dtype is not None:
        model = model.to(dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging, old = out.with_name(f".{out.name}.export-tmp"), out.with_name(f".{out.name}.export-old")
    for leftover in (staging, old):
        shutil.rmtree(leftover, ignore_errors=True)
    try:
        export_hf(model, None, staging)
        if out.exists():
            os.replace(out, old)  # kept until the new directory is in place
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="loongtrain export", allow_abbrev=False,
                      description="Write a training checkpoint's model as a Hugging Face directory (config.json + "
                      "model.safetensors) for from_pretrained.")
    p.add_argument("checkpoint", help="checkpoint directory (OUT_DIR/checkpoints/step_N), checkpoints root or "
                   "run directory (its latest checkpoint)")
    p.add_argument("--hf", required=True, metavar="OUT", help="output Hugging Face model directory")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="dtype of the written tensors (default: as trained)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing non-empty --hf directory "
                   "(its files are deleted)")
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        out = export_checkpoint(args.checkpoint, args.hf, dtype=DTYPES.get(args.dtype), overwrite=args.overwrite)
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    except ValueError as exc:
        return user_error("export", exc)
    print(f"wrote {out / 'config.json'} and {out / 'model.safetensors'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
