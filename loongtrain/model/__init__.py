"""A plain LLaMA-style decoder (no meshes, no process groups), its presets and FLOP counts; RoPE scaling
(``ModelConfig(rope_scaling=RopeScaling("yarn", factor=4, original_max_position_embeddings=8192))``).

Parallelism is applied from outside (docs/memory.md): :func:`loongtrain.apply_2d_attention`
replaces each attention module's ``attention_fn``; the sharded loss lives in
:mod:`loongtrain.loss.sharded`.

Its names are imported when first used (``import loongtrain.model.config`` imports no torch).
"""

from __future__ import annotations

import sys
import types
from importlib import import_module
from typing import Any

#: each name's module (imported when the name is first used: ``import loongtrain.model.<module>`` imports no
#: sibling, and no torch where the module needs none)
_LAZY = {
    "PRESETS": "config",
    "ModelConfig": "config",
    "flops_per_token": "config",
    "get_preset": "config",
    "num_params": "config",
    "Transformer": "llama",
    "TransformerBlock": "llama",
    "AttentionFn": "local_attention",
    "local_attention": "local_attention",
    "apply_rope": "rope",
    "rope_cos_sin": "rope",
    "RopeScaling": "rope_scaling",
}

__all__ = sorted(_LAZY)


class _Package(types.ModuleType):
    """This package: its function ``local_attention`` keeps its name when the module of the same name is first
    imported (the import system sets that attribute to the module; an eager ``from ... import`` rebound it)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and name in _LAZY and name == _LAZY[name]:
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(f"loongtrain.model.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'loongtrain.model' has no attribute {name!r}")
