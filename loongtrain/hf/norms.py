"""Hugging Face's Llama-family RMSNorms through loongtrain's one-function norm (docs/memory.md).

``LlamaRMSNorm`` and its copies (Mistral, Qwen2, Qwen3, DeepSeek-V3) compute ``weight * (x32 * rsqrt(mean(x32**2) +
eps)).to(x.dtype)`` with ``x32 = x.to(float32)``; as plain ops autograd keeps the float32 upcast and the
normalised values of every norm for the backward. :func:`use_rms_norm_function` gives each such module the
same computation as :func:`loongtrain.model.rms_norm.rms_norm` with float32 statistics (forward bit for bit,
gradients the same math), which keeps only the input and the per-token scale, so a Hugging Face model holds
what the planner models for loongtrain's decoder. Other norms (Gemma's ``(1 + weight)``) are left alone, and a
float64 input (a verification run) takes the stock forward: HF rounds its statistics to float32 there, and
only the same ops round the same way.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from loongtrain.model.rms_norm import rms_norm

#: classes whose forward is exactly Llama's RMSNorm (transformers' "Copied from" family)
LLAMA_RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "DeepseekV3RMSNorm")


def _forward(module: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    if hidden_states.dtype == torch.float64:  # HF's float32 statistics of a float64 input, op for op (tests
        return type(module).forward(module, hidden_states)  # compare against the stock model at 1e-10)
    return rms_norm(hidden_states, module.weight, module.variance_epsilon, stats_dtype=torch.float32)


def use_rms_norm_function(model: nn.Module) -> int:
    """Route every Llama-family RMSNorm of ``model`` through :func:`~loongtrain.model.rms_norm.rms_norm`;
    returns how many. A module whose ``forward`` was already replaced on the instance is left as it is."""
    count = 0
    for module in model.modules():
        if type(module).__name__ in LLAMA_RMS_NORMS and "forward" not in module.__dict__:
            module.forward = types.MethodType(_forward, module)
            count += 1
    return count
