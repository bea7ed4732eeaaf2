"""The Hugging Face causal-LM architectures that loongtrain's 2D-Attention supports (no transformers import).

An architecture is supported when every layer other than attention is token-wise (RMSNorm, RoPE on
the given position ids, gated MLP or a mixture of gated-MLP experts (loongtrain/hf/moe.py), optional q/k
norms and qkv bias), so that running it on zigzag
shards with global ``position_ids`` and 2D-Attention as its core is exact (docs/memory.md).
"""

from __future__ import annotations

from torch import nn

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "GptOssForCausalLM",
)


def supported_architectures() -> list[str]:
    """Class names of the supported Hugging Face causal LMs (the ``architectures`` entry of config.json)."""
    return list(SUPPORTED_ARCHITECTURES)


def check_architecture(name: str) -> str:
    """Return ``name`` if it is supported, else raise ValueError naming it and the supported list."""
    if name not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported Hugging Face architecture {name!r}; supported architectures: "
            f"{supported_architectures()}"
        )
    return name


def is_hf_model(model: object) -> bool:
    """True if ``model`` is a transformers ``PreTrainedModel`` (checked by class, never imports transformers)."""
    return any(
        cls.__name__ == "PreTrainedModel" and cls.__module__ == "transformers.modeling_utils"
        for cls in type(model).__mro__
    )


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder blocks of ``model``: ``model.layers`` (loongtrain's decoder) or ``base_model.layers``
    (a Hugging Face causal LM). ValueError when neither is a ModuleList. The one finder that
    checkpointing, sharding and the HF attention binding use."""
    for owner in (model, getattr(model, "base_model", None), getattr(model, "model", None)):
        layers = getattr(owner, "layers", None)
        if isinstance(layers, nn.ModuleList):
            return layers
    raise ValueError(f"{type(model).__name__} has neither .layers nor .base_model.layers (a ModuleList of decoder "
                     "blocks to checkpoint/shard)")
