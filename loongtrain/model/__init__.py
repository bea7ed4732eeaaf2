"""A plain LLaMA-style decoder (no meshes, no process groups), its presets and FLOP counts; RoPE scaling
(``ModelConfig(rope_scaling=RopeScaling("yarn", factor=4, original_max_position_embeddings=8192))``).

Parallelism is applied from outside (docs/memory.md): :func:`loongtrain.apply_2d_attention`
replaces each attention module's ``attention_fn``; the sharded loss lives in
:mod:`loongtrain.loss.sharded`.
"""

from loongtrain.model.config import PRESETS, ModelConfig, flops_per_token, get_preset, num_params
from loongtrain.model.llama import Transformer, TransformerBlock
from loongtrain.model.local_attention import AttentionFn, local_attention
from loongtrain.model.rope import apply_rope, rope_cos_sin
from loongtrain.model.rope_scaling import RopeScaling

__all__ = [
    "PRESETS",
    "AttentionFn",
    "ModelConfig",
    "RopeScaling",
    "Transformer",
    "TransformerBlock",
    "apply_rope",
    "flops_per_token",
    "get_preset",
    "local_attention",
    "num_params",
    "rope_cos_sin",
]
