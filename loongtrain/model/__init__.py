"""LLaMA-style decoder, presets, FLOP counts and the sharded loss."""

from loongtrain.model.config import PRESETS, ModelConfig, flops_per_token, get_preset, num_params
from loongtrain.model.llama import Transformer, TransformerBlock, apply_rope, rope_cos_sin
from loongtrain.model.loss import IGNORE_INDEX, sharded_cross_entropy

__all__ = [
    "IGNORE_INDEX",
    "PRESETS",
    "ModelConfig",
    "Transformer",
    "TransformerBlock",
    "apply_rope",
    "flops_per_token",
    "get_preset",
    "num_params",
    "rope_cos_sin",
    "sharded_cross_entropy",
]
