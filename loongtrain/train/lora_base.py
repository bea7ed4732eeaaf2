"""The base model of a LoRA run (``--lora``; docs/lora.md): what its checkpoints record of it, the check that
a resume or an export finds the same base, and the base rebuilt for an export.

A LoRA checkpoint holds only the adapters (loongtrain/train/checkpoint.py), so the base must come back from
where the run took it, unchanged:

- a **preset**: the seeded initial weights of ``--model`` with ``--seed`` (the model's shape as recorded,
  ``model_config``); its identity is a digest of that shape and the seed;
- a **Hugging Face directory**: its weights; its identity is a digest of its ``config.json`` and, per
  ``*.safetensors`` file, the name, size and sampled digest (:func:`loongtrain.data.prepared.sampled_digest`:
  evenly spaced blocks, about 1 MiB per file), and of ``--seed`` when it has no weight files (a seeded init).

:func:`base_record` is the trainer state's ``"lora"`` entry (the LoRA config, the base's kind, name, absolute
directory and identity); :func:`check_base` compares it with the present base (``train --resume`` in the
launcher, ``export``), ValueError naming what changed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from loongtrain.data.prepared import sampled_digest
from loongtrain.hf.build import build_hf_model, hf_weight_files
from loongtrain.hf.load import hf_config_from_dict
from loongtrain.model.config import ModelConfig
from loongtrain.model.llama import Transformer
from loongtrain.sections.model import ModelSection, param_dtype
from loongtrain.train.model_setup import hf_model_dir


def hf_dir_identity(directory: Path, seed: int) -> str:
    """``sha256:`` of a Hugging Face model directory's config.json and weight files (module docstring)."""
    digest = hashlib.sha256((Path(directory) / "config.json").read_bytes())
    files = hf_weight_files(directory)
    for file in files:
        digest.update(f"\0{file.name}\0{file.stat().st_size}\0{sampled_digest(file)}".encode())
    if not files:
        digest.update(f"\0seed={seed}".encode())
    return f"sha256:{digest.hexdigest()}"


def preset_identity(model_config: dict[str, Any], seed: int) -> str:
    """``sha256:`` of a preset's recorded shape and the seed of its initial weights."""
    text = json.dumps({"model_config": model_config, "seed": seed}, sort_keys=True, default=str)
    return f"sha256:{hashlib.sha256(text.encode()).hexdigest()}"


def base_record(cfg: ModelSection, seed: int, model_record: dict[str, Any]) -> dict[str, Any] | None:
    """The trainer state's ``"lora"`` entry of a run (None without ``--lora``) of model section ``cfg`` and weights
    seeded by ``seed``: ``{"config", "base": {"kind", "model", "seed", "directory", "identity"}}``;
    ``model_record``: the checkpoint's model record (:func:`loongtrain.train.model_setup.model_record`)."""
    lora = cfg.lora_config()
    if lora is None:
        return None
    directory = hf_model_dir(cfg.model)
    if directory is None:
        base = {"kind": "preset", "model": cfg.model, "seed": seed,
                "identity": preset_identity(model_record["model_config"], seed)}
    else:
        base = {"kind": "hf", "model": cfg.model, "seed": seed, "directory": str(directory.resolve()),
                "identity": hf_dir_identity(directory, seed)}
    return {"config": lora.to_dict(), "base": base}


def base_directory(record: dict[str, Any]) -> Path | None:
    """The Hugging Face directory of a LoRA checkpoint's base (None for a preset)."""
    base = record["base"]
    return Path(base["directory"]) if base["kind"] == "hf" else None


def check_base(state: dict[str, Any], where: str, present: ModelConfig | None = None) -> None:
    """ValueError naming the checkpoint ``where`` when its LoRA base is no longer the one it trained on (gone,
    or its files changed; a preset: ``present``, the shape the run builds now, when given, else the recorded
    one); nothing for a checkpoint without adapters."""
    record = state.get("lora")
    if not record:
        return
    base = record["base"]
    if base["kind"] == "preset":
        shape = state.get("model_config") if present is None else json.loads(json.dumps(
            dataclasses.asdict(present), default=str))
        now = preset_identity(shape, base["seed"])
        if now != base["identity"]:
            raise ValueError(f"checkpoint {where!r}: its LoRA base, preset {base['model']!r} with seed {base['seed']}, "
                             f"has another shape now than it trained on (identity {base['identity']} then, {now} now)")
        return
    directory = Path(base["directory"])
    if not (directory / "config.json").is_file():
        raise ValueError(f"checkpoint {where!r}: its LoRA base {str(directory)!r} is gone (a LoRA checkpoint holds "
                         f"only the adapters): restore the model directory it trained on")
    now = hf_dir_identity(directory, base["seed"])
    if now != base["identity"]:
        raise ValueError(f"checkpoint {where!r}: its LoRA base {str(directory)!r} changed since training (identity "
                         f"{base['identity']} then, {now} now): restore the files it trained on")


def build_base(state: dict[str, Any]) -> nn.Module:
    """The unparallelized base model of a LoRA checkpoint (after :func:`check_base`), on CPU in the dtype it
    trained in: the preset's seeded weights, or the Hugging Face directory's with the recorded config (its
    RoPE as trained)."""
    record = state["lora"]
    dtype = param_dtype(str((state.get("config") or {}).get("dtype", "auto")))
    directory = base_directory(record)
    if directory is None:
        return Transformer(ModelConfig(**state["model_config"]), seed=record["base"]["seed"]).to(dtype)
    model = build_hf_model(directory, dtype, record["base"]["seed"], hf_config_from_dict(state["hf_config"]))
    return model.to(torch.device("cpu"))
