"""Hugging Face causal LMs trained with loongtrain's 2D-Attention (docs/memory.md).

``import loongtrain.hf`` needs neither transformers nor safetensors; the functions that use them
import them when called (``pip install loongtrain[hf]``).

- :func:`apply_to_hf` (reached through :func:`loongtrain.apply_2d_attention`, ``hf/apply.py``): route an HF model's
  attention through 2D-Attention on a mesh.
- :func:`load_hf_model`: a supported model from a local directory (config.json + safetensors);
  :func:`read_hf_config` / :func:`check_hf_dir` validate such a directory without loading weights.
- :func:`shape_config_from_hf`: the :class:`~loongtrain.model.config.ModelConfig` shape of any supported
  family (planning, FLOPs).
- :func:`export_hf`, :func:`hf_config_from_model_config`, :func:`model_config_from_hf`,
  :func:`native_to_hf_state_dict`, :func:`hf_to_native_state_dict`: loongtrain's LLaMA <-> HF Llama.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from loongtrain.hf.families import SUPPORTED_ARCHITECTURES, check_architecture, is_hf_model, supported_architectures

_LAZY = {
    "ATTN_IMPLEMENTATION": "attention",
    "apply_to_hf": "attention",
    "register_attention": "attention",
    "load_hf_model": "load",
    "read_hf_config": "load",
    "check_hf_dir": "load",
    "shape_config_from_hf": "convert",
    "export_hf": "convert",
    "hf_config_from_model_config": "convert",
    "model_config_from_hf": "convert",
    "native_to_hf_state_dict": "convert",
    "hf_to_native_state_dict": "convert",
}

__all__ = ["SUPPORTED_ARCHITECTURES", "check_architecture", "is_hf_model", "supported_architectures", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(f"loongtrain.hf.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'loongtrain.hf' has no attribute {name!r}")
