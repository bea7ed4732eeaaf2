"""LoRA adapters in PEFT's format (``OUT/adapter/`` of ``loongtrain export``; docs/lora.md), written without
importing peft: ``adapter_config.json`` (PEFT's ``LoraConfig`` fields) and ``adapter_model.safetensors`` with
PEFT's key names, ``base_model.model.<the module's Hugging Face name>.lora_A.weight`` (and ``lora_B``), which
``peft.PeftModel.from_pretrained(base, OUT/adapter)`` loads.

Adapters of loongtrain's decoder are renamed to ``LlamaForCausalLM``'s modules (:mod:`loongtrain.hf.convert`'s
mapping: ``layers.0.attention.wq`` -> ``model.layers.0.self_attn.q_proj``); a Hugging Face model's keep theirs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from loongtrain._files import save_safetensors
from loongtrain.hf.convert import native_module_name
from loongtrain.model.config import ModelConfig
from loongtrain.model.lora import LoraConfig

Tensor = torch.Tensor

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
#: the prefix PEFT's ``PeftModelForCausalLM`` gives every key (``base_model`` is the LoRA model, ``model`` the base)
PEFT_PREFIX = "base_model.model."


def peft_key(name: str, native: ModelConfig | None) -> str:
    """PEFT's key of adapter parameter ``name`` (``<module>.lora_A.weight``); ``native``: the shape of
    loongtrain's decoder when ``name`` is one of its parameters (renamed to Hugging Face's module), else None."""
    module, adapter, leaf = name.rsplit(".", 2)
    if native is not None:
        module = native_module_name(module, native)
    return f"{PEFT_PREFIX}{module}.{adapter}.{leaf}"


def adapter_config(lora: LoraConfig, target_modules: list[str], base: str | None) -> dict[str, Any]:
    """PEFT's ``adapter_config.json`` of ``lora`` (plain LoRA: no bias, rsLoRA, DoRA or per-layer patterns)."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "revision": None,
        "r": lora.r, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "target_modules": target_modules,
        "bias": "none", "lora_bias": False, "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "init_lora_weights": True, "inference_mode": True, "modules_to_save": None, "layers_to_transform": None,
        "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {},
    }


def write_peft_adapter(out_dir: str | Path, adapters: dict[str, Tensor], lora: LoraConfig, *,
                       native: ModelConfig | None = None, base: str | None = None) -> Path:
    """Write ``adapters`` (``{parameter name: tensor}`` of an unsharded model) and ``lora`` as a PEFT adapter
    directory ``out_dir``; ``native``: the decoder's shape for loongtrain's parameter names; ``base``: the
    ``base_model_name_or_path`` to record (the base's directory). Returns ``out_dir``."""
    if not adapters:
        raise ValueError("write_peft_adapter: no adapter parameters to write")
    state = {peft_key(name, native): t.detach().to("cpu").contiguous() for name, t in sorted(adapters.items())}
    targets = sorted({key[len(PEFT_PREFIX):].rsplit(".", 3)[-3] for key in state})
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_FILE).write_text(json.dumps(adapter_config(lora, targets, base), indent=2, sort_keys=True) + "\n")
    save_safetensors(state, out / WEIGHTS_FILE)
    return out
