"""Whether an HF causal LM's layers match what 2D-Attention runs exactly, by structure (docs/hf-models.md#families).

2D-Attention replaces the attention core of every layer and feeds each rank its zigzag shard with global
position ids; that is exact when everything else is token-wise. :func:`structure_mismatch` checks this on the
built model (the meta device is enough) and names the first thing that differs:

- a causal LM (an output embedding) whose ``base_model.layers`` is a ModuleList of decoder layers;
- every layer's ``self_attn`` is causal and calls transformers' attention interface (``ALL_ATTENTION_FUNCTIONS``:
  the core loongtrain replaces), holds no parameter of its own but gpt-oss's ``sinks``, and no submodule but
  projections, norms and rotary embeddings; or the layer's token mixer (``linear_attn`` or ``self_attn``) is a
  linear-attention block loongtrain runs (:data:`loongtrain.hf.linear.LINEAR_BLOCKS`: a depthwise causal SiLU
  convolution, its own projections and norms);
- every other module of a layer is token-wise: linear layers, norms, activations, dropout, or a sparse MoE
  block loongtrain runs (:data:`loongtrain.hf.moe.SPARSE_BLOCKS`);
- the config asks for nothing the core does not compute: ``layer_types`` only ``sliding_attention`` /
  ``full_attention`` / ``linear_attention``, no attention logit soft-capping, no chunked attention.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from loongtrain.hf.linear import linear_block_mismatch, linear_kind
from loongtrain.hf.moe import SPARSE_BLOCKS

#: the kinds of attention layer the core computes (HF's ``layer_types`` names)
ATTENTION_LAYER_TYPES = ("sliding_attention", "full_attention", "linear_attention")
#: config entries that change attention in ways the core does not compute, with the value that is a no-op
_ATTENTION_CONFIG = {"attn_logit_softcapping": None, "attention_chunk_size": None}
_TOKEN_WISE = (nn.Linear, nn.Dropout, nn.Identity)
_ACTIVATION_MODULES = ("torch.nn.modules.activation", "transformers.activations")


def structure_mismatch(model: nn.Module) -> str | None:
    """What in ``model`` (an HF causal LM, possibly on the meta device) 2D-Attention cannot run exactly, as one
    phrase naming the module, class or config entry; None when its layers match (module docstring)."""
    name = type(model).__name__
    layers = getattr(getattr(model, "base_model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        return f"{name} has no decoder layers at base_model.layers"
    if getattr(model, "get_output_embeddings", lambda: None)() is None:
        return f"{name} has no output embedding (an LM head): it is not a causal LM"
    config = getattr(model, "config", None)
    found = _config_mismatch(config) if config is not None else None
    if found:
        return found
    for i, layer in enumerate(layers):
        found = _layer_mismatch(layer, f"layer {i}")
        if found:
            return found
    return None


def _config_mismatch(config: Any) -> str | None:
    for key, no_op in _ATTENTION_CONFIG.items():
        value = getattr(config, key, no_op)
        if value != no_op:
            return f"config {key}={value!r} (2D-Attention computes plain softmax attention; needs {no_op!r})"
    for i, kind in enumerate(getattr(config, "layer_types", None) or []):
        if kind not in ATTENTION_LAYER_TYPES:
            return f"config layer_types[{i}]={kind!r} (2D-Attention runs {list(ATTENTION_LAYER_TYPES)})"
    return None


def _layer_mismatch(layer: nn.Module, where: str) -> str | None:
    name, attn = next(((n, getattr(layer, n)) for n in ("self_attn", "linear_attn")
                       if isinstance(getattr(layer, n, None), nn.Module)), (None, None))
    if attn is None:
        return f"{where} ({type(layer).__name__}) has no self_attn (or linear_attn) module"
    if linear_kind(attn) is not None:
        found = linear_block_mismatch(attn)
        found = found and f"{where} {name} ({type(attn).__name__}) {found}"
    else:
        found = _attention_mismatch(attn, f"{where} {name} ({type(attn).__name__})")
    if found:
        return found
    for sub, module in _modules(layer, skip=attn):
        if next(module.children(), None) is None and not _token_wise(module):
            return f"{where} {sub} ({type(module).__name__}) is not a token-wise layer"
        own = [n for n, _ in module.named_parameters(recurse=False)]
        if own and next(module.children(), None) is not None and sub and not isinstance(module, nn.Linear):
            return f"{where} {sub} ({type(module).__name__}) holds parameters {own} outside its layers"
    return None


def _attention_mismatch(attn: nn.Module, where: str) -> str | None:
    if getattr(attn, "is_causal", True) is not True:
        return f"{where} is not causal"
    forward = inspect.unwrap(type(attn).forward)
    names = getattr(getattr(forward, "__code__", None), "co_names", ())
    if "ALL_ATTENTION_FUNCTIONS" not in names:
        return f"{where} does not call transformers' attention interface (ALL_ATTENTION_FUNCTIONS)"
    own = [n for n, _ in attn.named_parameters(recurse=False) if n != "sinks"]
    if own:
        return f"{where} holds parameters {own} (only gpt-oss's 'sinks' has a loongtrain equivalent)"
    for sub, module in _modules(attn):
        if sub and next(module.children(), None) is None and not (
                _token_wise(module) or type(module).__name__.endswith("RotaryEmbedding")):
            return f"{where} {sub} ({type(module).__name__}) is not a projection, norm or rotary embedding"
    return None


def _modules(root: nn.Module, skip: nn.Module | None = None, prefix: str = ""):
    """``(name, module)`` of ``root`` and below, not descending into a linear layer (an adapted one holds its
    adapters: still a projection), a sparse MoE block loongtrain runs, or ``skip``."""
    yield prefix, root
    if isinstance(root, nn.Linear) or (prefix and type(root).__name__ in SPARSE_BLOCKS):
        return
    for name, child in root.named_children():
        if child is not skip:
            yield from _modules(child, None, f"{prefix}.{name}" if prefix else name)


def _token_wise(module: nn.Module) -> bool:
    """A leaf module that acts on each token alone: linear, dropout, identity, a norm over the hidden dim, an
    activation."""
    cls = type(module)
    return (isinstance(module, _TOKEN_WISE) or cls.__name__.endswith(("Norm", "RMSNorm", "LayerNorm"))
            or cls.__module__ in _ACTIVATION_MODULES or cls.__module__.startswith("torch.nn.modules.activation"))
