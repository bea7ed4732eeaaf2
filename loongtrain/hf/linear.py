"""Hugging Face's linear-attention blocks run by :func:`loongtrain.linear_attention`
(docs/linear-attention.md#hugging-face-models).

:func:`bind_linear_attention` replaces the ``forward`` of every delta-rule block of an HF causal LM on the instance
(Qwen3.5's and Qwen3-Next's ``GatedDeltaNet``, Kimi-Linear's ``KimiLinearDeltaAttention``): its own projections,
norms and parameters around loongtrain's sharded core, so parameter names, loading, sharding and export are
unchanged. The core is the block's ``linear_attention_fn`` (a :class:`MeshLinearAttention`, like the attention
modules' ``attention_fn``). The gates are computed in fp64 for fp64 weights, else in fp32 (HF's ``.float()``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from loongtrain.attn.linear.api import linear_attention
from loongtrain.model.delta_rule import compute_dtype
from loongtrain.parallel.mesh import Mesh

Tensor = torch.Tensor

#: the attribute holding a bound block's core
LINEAR_FN_ATTR = "linear_attention_fn"
#: HF's activation names of the short convolution that loongtrain computes (both are SiLU in transformers)
_SILU = ("silu", "swish")


class MeshLinearAttention:
    """A linear-attention core bound to ``mesh``: calls :func:`loongtrain.linear_attention` on it. A plain object,
    so ``copy.deepcopy`` of a model shares the mesh and its process groups."""

    __slots__ = ("mesh",)

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh

    def __call__(self, *args: Any, **kwargs: Any) -> Tensor:
        return linear_attention(*args, self.mesh, **kwargs)

    def __deepcopy__(self, memo: dict) -> MeshLinearAttention:
        return MeshLinearAttention(self.mesh)

    def __repr__(self) -> str:
        return f"MeshLinearAttention({self.mesh!r})"


def _delta_net_gate(a: Tensor, a_log: Tensor, dt_bias: Tensor) -> Tensor:
    """Gated DeltaNet's log-decay ``-exp(A_log) * softplus(a + dt_bias)`` (per head), in the compute dtype."""
    dtype = compute_dtype(a.dtype)
    return -a_log.to(dtype).exp() * F.softplus(a.to(dtype) + dt_bias.to(dtype))


def _core(module: nn.Module, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
          kwargs: dict[str, Any]) -> Tensor:
    conv = module.conv1d
    return getattr(module, LINEAR_FN_ATTR)(
        q, k, v, g, beta, conv_weight=conv.weight.squeeze(1), cu_seqlens=kwargs.get("cu_seqlens"),
        chunk_order=kwargs.get("chunk_order"))


def _delta_net_output(module: nn.Module, core: Tensor, z: Tensor) -> Tensor:
    batch, seq = core.shape[:2]
    head_dim = core.shape[-1]
    out = module.norm(core.reshape(-1, head_dim), z.reshape(-1, head_dim)).reshape(batch, seq, -1)
    return module.out_proj(out)


def qwen3_5_forward(module: nn.Module, hidden_states: Tensor, cache: Any = None, attention_mask: Any = None,
                    **kwargs: Any) -> Tensor:
    """``Qwen3_5GatedDeltaNet.forward`` with loongtrain's core (a gate per head)."""
    _check_call(module, cache, attention_mask)
    batch, seq, _ = hidden_states.shape
    q, k, v = module.in_proj_qkv(hidden_states).split([module.key_dim, module.key_dim, module.value_dim], dim=-1)
    q, k = (x.reshape(batch, seq, -1, module.head_k_dim) for x in (q, k))
    v = v.reshape(batch, seq, -1, module.head_v_dim)
    g = _delta_net_gate(module.in_proj_a(hidden_states), module.A_log, module.dt_bias)
    core = _core(module, q, k, v, g, module.in_proj_b(hidden_states).sigmoid(), kwargs)
    return _delta_net_output(module, core, module.in_proj_z(hidden_states))


def qwen3_next_forward(module: nn.Module, hidden_states: Tensor, cache: Any = None, attention_mask: Any = None,
                       **kwargs: Any) -> Tensor:
    """``Qwen3NextGatedDeltaNet.forward`` with loongtrain's core: its fused projections reordered by its own
    ``fix_query_key_value_ordering``."""
    _check_call(module, cache, attention_mask)
    q, k, v, z, b, a = module.fix_query_key_value_ordering(module.in_proj_qkvz(hidden_states),
                                                           module.in_proj_ba(hidden_states))
    g = _delta_net_gate(a, module.A_log, module.dt_bias)
    core = _core(module, q, k, v, g, b.sigmoid(), kwargs)
    return _delta_net_output(module, core, z)


def kimi_forward(module: nn.Module, hidden_states: Tensor, cache: Any = None, attention_mask: Any = None,
                 **kwargs: Any) -> Tensor:
    """``KimiLinearDeltaAttention.forward`` with loongtrain's core (KDA: a gate per key channel)."""
    _check_call(module, cache, attention_mask)
    batch, seq, _ = hidden_states.shape
    shape = (batch, seq, -1, module.head_dim)
    q, k, v = (proj(hidden_states).view(shape) for proj in (module.q_proj, module.k_proj, module.v_proj))
    gate = module.forget_gate
    raw = gate.f_b_proj(gate.f_a_proj(hidden_states))
    dtype = compute_dtype(raw.dtype)
    g = -gate.A_log.to(dtype).reshape(-1, 1).exp() * F.softplus(
        (raw.to(dtype) + gate.dt_bias.to(dtype)).view(shape))
    core = _core(module, q, k, v, g, module.b_proj(hidden_states).sigmoid(), kwargs)
    out_gate = module.g_b_proj(module.g_a_proj(hidden_states)).view(shape)
    return module.o_proj(module.o_norm(core, out_gate).reshape(batch, seq, -1))


#: HF's linear-attention block classes -> loongtrain's forward for them
LINEAR_BLOCKS: dict[str, Callable[..., Tensor]] = {
    "Qwen3_5GatedDeltaNet": qwen3_5_forward,
    "Qwen3NextGatedDeltaNet": qwen3_next_forward,
    "KimiLinearDeltaAttention": kimi_forward,
}


def linear_kind(module: nn.Module) -> str | None:
    """The HF linear-attention block class ``module`` is (by name along its MRO), or None."""
    return next((cls.__name__ for cls in type(module).__mro__ if cls.__name__ in LINEAR_BLOCKS), None)


def linear_block_mismatch(module: nn.Module) -> str | None:
    """What in a linear-attention block loongtrain's forward does not compute (one phrase), or None."""
    conv = getattr(module, "conv1d", None)
    if not isinstance(conv, nn.Conv1d):
        return "has no conv1d (nn.Conv1d)"
    taps = conv.kernel_size[0]
    if conv.groups != conv.in_channels or conv.out_channels != conv.in_channels or conv.padding != (taps - 1,) \
            or conv.stride != (1,) or conv.dilation != (1,):
        return f"conv1d {conv} is not a depthwise causal convolution (groups = channels, padding = kernel - 1)"
    if conv.bias is not None:
        return "conv1d has a bias (loongtrain's short convolution has none)"
    activation = getattr(module, "activation", None)
    if activation not in _SILU:
        return f"activation={activation!r} (loongtrain's short convolution runs {list(_SILU)})"
    return None


def bind_linear_attention(model: nn.Module, mesh: Mesh) -> int:
    """Give every linear-attention block of ``model`` loongtrain's forward with a core bound to ``mesh``
    (binding again rebinds); returns how many blocks."""
    count = 0
    for module in model.modules():
        kind = linear_kind(module)
        if kind is None:
            continue
        setattr(module, LINEAR_FN_ATTR, MeshLinearAttention(mesh))
        module.forward = functools.partial(LINEAR_BLOCKS[kind], module)
        count += 1
    return count


def _check_call(module: nn.Module, cache: Any, attention_mask: Any) -> None:
    if cache is not None:
        raise ValueError(f"{type(module).__name__}: loongtrain's linear attention keeps no cache; run with "
                         f"use_cache=False")
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("attention_mask masks some tokens: loongtrain's linear attention does not support "
                         "padding; pack full-length sequences and pass attention_mask=None")
