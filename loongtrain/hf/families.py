"""The Hugging Face causal-LM architectures that loongtrain's 2D-Attention supports (no transformers import).

An architecture is supported when every layer other than attention is token-wise (RMSNorm, RoPE on
the given position ids, gated MLP or a mixture of gated-MLP experts (loongtrain/hf/moe.py), optional q/k
norms and qkv bias), so that running it on zigzag
shards with global ``position_ids`` and 2D-Attention as its core is exact (docs/memory.md); linear-attention
layers run through ``loongtrain.linear_attention`` (loongtrain/hf/linear.py, docs/linear-attention.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a model is looked at, so that --help and argument errors need none
    from torch import nn

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "GptOssForCausalLM",
    "Qwen3_5ForCausalLM",
    "DeepseekV3ForCausalLM",
    "Qwen3NextForCausalLM",
    "KimiLinearForCausalLM",
)


def supported_architectures() -> list[str]:
    """Class names of the Hugging Face causal LMs tested family by family (the ``architectures`` entry of
    config.json); any other whose layers match (:func:`loongtrain.hf.structure.structure_mismatch`) runs too."""
    return list(SUPPORTED_ARCHITECTURES)


def family_names() -> str:
    """The tested families for a help line, from :data:`SUPPORTED_ARCHITECTURES` (``LlamaForCausalLM`` ->
    ``Llama``): ``"Llama, Mistral, ..."``."""
    return ", ".join(name.removesuffix("ForCausalLM") for name in SUPPORTED_ARCHITECTURES)


def check_architecture(name: str, model: nn.Module | None = None) -> str:
    """Return ``name`` if 2D-Attention runs this architecture exactly, else raise ValueError (one line).

    With the built ``model`` (the meta device is enough) the check is by structure, for every family: its layers
    must match (:func:`~loongtrain.hf.structure.structure_mismatch`), and the error names what does not. Without
    it, only the tested families' names (:data:`SUPPORTED_ARCHITECTURES`) pass."""
    from loongtrain.hf.structure import structure_mismatch

    if model is not None:
        found = structure_mismatch(model)
        if found is not None:
            raise ValueError(f"unsupported Hugging Face architecture {name!r}: {found}; tested architectures: "
                             f"{supported_architectures()} (others run when their layers match: docs/hf-models.md"
                             f"#families)")
        return name
    if name not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported Hugging Face architecture {name!r}; supported architectures: "
            f"{supported_architectures()} (others are checked by structure once built: docs/hf-models.md#families)"
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
    from torch import nn

    for owner in (model, getattr(model, "base_model", None), getattr(model, "model", None)):
        layers = getattr(owner, "layers", None)
        if isinstance(layers, nn.ModuleList):
            return layers
    raise ValueError(f"{type(model).__name__} has neither .layers nor .base_model.layers (a ModuleList of decoder "
                     "blocks to checkpoint/shard)")
