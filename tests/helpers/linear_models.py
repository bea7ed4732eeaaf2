"""Tiny Hugging Face linear-attention hybrids (Qwen3.5, Qwen3-Next, Kimi-Linear) and transformers' own code made
dtype-preserving for fp64 comparisons (docs/linear-attention.md#tests).

transformers computes the delta-rule layers, their gates and its norms in fp32 whatever the input (``.float()``,
``.to(torch.float32)``). :func:`dtype_preserving` takes the source of one of its functions or methods, turns
those casts into fp64 and compiles it in the function's own module namespace: transformers' algorithm, only the
casts changed. :func:`fp64_reference` applies it to a model's norms (both the reference and the sharded copy use
them) and its linear-attention blocks and their torch fallbacks (the reference only: loongtrain replaces those).
"""

from __future__ import annotations

import inspect
import re
import textwrap
import types
from typing import Any

import torch
from torch import nn

Tensor = torch.Tensor

_CASTS = ((".float()", ".double()"), ("torch.float32", "torch.float64"), ("dtype=torch.float)", "dtype=torch.float64)"))
_FALLBACKS = ("torch_chunk_gated_delta_rule", "chunk_kimi_delta_attention", "causal_conv1d_fn", "l2norm")


def dtype_preserving(fn: Any, **replace: Any) -> Any:
    """``fn`` (a function, or a method's function) recompiled from its source with its fp32 casts made fp64, its
    decorators dropped, in a copy of its module's globals updated with ``replace`` (names -> objects)."""
    if isinstance(fn, nn.Module):  # a function the ``kernels`` package wraps in a module: the function it calls
        fn = inspect.getclosurevars(type(fn).forward).nonlocals["func"]
    fn = inspect.unwrap(fn)
    source = textwrap.dedent(inspect.getsource(fn))
    source = re.sub(r"^(@.*\n)+", "", source)  # decorators
    for old, new in _CASTS:
        source = source.replace(old, new)
    namespace = {**fn.__globals__, **replace}
    exec(compile(source, f"<fp64 {fn.__qualname__}>", "exec"), namespace)  # noqa: S102 - transformers' own code
    return namespace[fn.__name__]


def fp64_norms(model: nn.Module) -> nn.Module:
    """Every norm of ``model`` (RMSNorm, gated RMSNorm) computed in its input's dtype (fp64)."""
    for module in model.modules():
        if type(module).__name__.endswith(("RMSNorm", "RMSNormGated")):
            forward = dtype_preserving(type(module).forward)
            module.forward = types.MethodType(forward, module)
    return model


def fp64_reference(model: nn.Module) -> nn.Module:
    """:func:`fp64_norms`, and every linear-attention block's forward (with the torch fallbacks it calls) and
    gate in fp64: transformers' own unsharded computation, dtype-preserving."""
    fp64_norms(model)
    for module in model.modules():
        name = type(module).__name__
        if name.endswith(("GatedDeltaNet", "DeltaAttention")):
            scope = inspect.unwrap(type(module).forward).__globals__
            fallbacks = {f: dtype_preserving(scope[f]) for f in _FALLBACKS if f in scope}
            forward = dtype_preserving(type(module).forward, **fallbacks)
            module.forward = types.MethodType(forward, module)
        elif name.endswith("ForgetGate"):
            module.forward = types.MethodType(dtype_preserving(type(module).forward), module)
    return model


def perturb(model: nn.Module, seed: int) -> nn.Module:
    """1-D parameters moved off HF's ones/zeros initialisation so that they matter."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(0.1 * torch.randn(param.shape, generator=gen, dtype=param.dtype))
    return model


QWEN3_5 = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
               linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
               layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
               max_position_embeddings=256, tie_word_embeddings=False)


def tiny_qwen3_5(seed: int = 3, **overrides: Any) -> nn.Module:
    """A tiny random ``Qwen3_5ForCausalLM`` in fp64: linear and full layers alternating, 2 key heads and 4 value
    heads in the linear layers, GQA in the full ones (sdpa attention: HF's eager softmax runs in fp32)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(**{**QWEN3_5, **overrides}, attn_implementation="sdpa")
    config.architectures = ["Qwen3_5ForCausalLM"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3_5ForCausalLM(config)
    return perturb(model, seed).double()
