"""Hugging Face mixture-of-experts blocks run by loongtrain's MoE code (docs/moe-and-gpt-oss.md#mixture-of-experts).

:func:`bind_moe` replaces the ``forward`` of every sparse block of an HF causal LM (Qwen3-MoE's, Qwen3-Next's
and Mixtral's ``*SparseMoeBlock``, gpt-oss's ``GptOssMLP``, DeepSeek-V3's ``DeepseekV3MoE``, Kimi-Linear's
``KimiLinearMoE``) on the instance with :func:`loongtrain.model.moe.moe_forward` over the block's own parameters
plus, where the block has them, its shared experts (HF's own MLP module, token-wise; Qwen3-Next's scaled by
``sigmoid(shared_expert_gate(x))``), so that parameter names, loading, sharding and export are unchanged, and
records the router's statistics of every forward in one :class:`~loongtrain.model.moe.RouterStats` per model
(:func:`router_stats`) for the load-balancing loss of the families HF trains with one.

:func:`moe_layout` reads the experts' layout from an HF config (which layers are sparse, how many experts,
top-k): the planner's shape of the model and the launcher's checks use it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from loongtrain.model.moe import (
    CLAMPED_SWIGLU,
    SIGMOID_GROUP_TOPK,
    SILU,
    TOPK_SOFTMAX,
    ExpertWeights,
    MoESpec,
    RouterStats,
    moe_forward,
)

#: the attribute of a bound model that holds its :class:`RouterStats`
STATS_ATTR = "_loongtrain_router_stats"
#: HF's sparse block classes -> the name of their router submodule
SPARSE_BLOCKS = {"Qwen3MoeSparseMoeBlock": "gate", "MixtralSparseMoeBlock": "gate", "GptOssMLP": "router",
                 "Qwen3NextSparseMoeBlock": "gate", "DeepseekV3MoE": "gate", "KimiLinearMoE": "gate"}
#: the sparse blocks with shared experts -> (the shared MLP's attribute, its sigmoid gate's attribute or None)
SHARED_EXPERTS = {"DeepseekV3MoE": ("shared_experts", None), "KimiLinearMoE": ("shared_experts", None),
                  "Qwen3NextSparseMoeBlock": ("shared_expert", "shared_expert_gate")}
#: the sparse blocks routed by DeepSeek-V3's rule (sigmoid scores, groups, score-correction bias)
_GROUP_ROUTED = ("DeepseekV3MoE", "KimiLinearMoE")
#: the config.json ``model_type`` of each MoE family
MOE_MODEL_TYPES = ("qwen3_moe", "qwen3_next", "mixtral", "gpt_oss", "deepseek_v3", "kimi_linear")
#: the families whose HF model trains with no load-balancing loss: DeepSeek-V3's and Kimi's balance by the
#: score-correction bias, whose update rule is not part of the HF model (nor of loongtrain's)
_NO_AUX_LOSS = ("deepseek_v3", "kimi_linear")


@dataclass(frozen=True)
class MoELayout:
    """Where the experts of an HF model are: ``layers`` (indices of the sparse layers), ``num_experts``,
    ``top_k`` (experts per token), ``ffn_dim`` (one expert's width), ``aux_loss_coef`` and
    ``output_router_logits`` (whether the load-balancing loss is part of the training loss, as in HF),
    ``shared_ffn_dim`` (the width of the shared experts every token runs through, 0: none) and ``load_balancing``
    (whether HF defines a load-balancing loss for the family at all: not DeepSeek-V3's or Kimi's)."""

    layers: tuple[int, ...]
    num_experts: int
    top_k: int
    ffn_dim: int
    aux_loss_coef: float
    output_router_logits: bool
    shared_ffn_dim: int = 0
    load_balancing: bool = True


def moe_layout(hf_config: Any) -> MoELayout | None:
    """The :class:`MoELayout` of an HF config (object), None for a dense family; ValueError for experts or a
    top-k that do not fit (naming the values)."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in MOE_MODEL_TYPES:
        return None
    layers_total, shared = int(hf_config.num_hidden_layers), 0
    if model_type in ("qwen3_moe", "qwen3_next"):
        experts, ffn = int(hf_config.num_experts), int(hf_config.moe_intermediate_size)
        step, dense = int(hf_config.decoder_sparse_step), set(hf_config.mlp_only_layers or [])
        layers = tuple(i for i in range(layers_total) if i not in dense and experts > 0 and (i + 1) % step == 0)
        shared = int(getattr(hf_config, "shared_expert_intermediate_size", 0) or 0)
    elif model_type == "deepseek_v3":
        experts, ffn = int(hf_config.n_routed_experts), int(hf_config.moe_intermediate_size)
        layers = tuple(range(int(hf_config.first_k_dense_replace or 0), layers_total))
        shared = ffn * int(hf_config.n_shared_experts or 0)
    elif model_type == "kimi_linear":
        experts, ffn = int(hf_config.num_local_experts), int(hf_config.moe_intermediate_size)
        layers = tuple(i for i, kind in enumerate(hf_config.mlp_layer_types) if kind == "sparse")
        shared = ffn * int(hf_config.n_shared_experts or 0)
    else:
        experts, ffn = int(hf_config.num_local_experts), int(hf_config.intermediate_size)
        layers = tuple(range(layers_total))
    top_k = int(hf_config.num_experts_per_tok)
    if experts < 1 or not 1 <= top_k <= experts:
        raise ValueError(f"{model_type}: num_experts_per_tok={top_k} must be between 1 and the number of experts "
                         f"({experts}) in config.json")
    if model_type in _NO_AUX_LOSS:
        _check_groups(hf_config, experts, top_k)
        return MoELayout(layers, experts, top_k, ffn, 0.0, False, shared, load_balancing=False)
    return MoELayout(layers, experts, top_k, ffn, float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0),
                     bool(getattr(hf_config, "output_router_logits", False)), shared)


def _check_groups(hf_config: Any, experts: int, top_k: int) -> None:
    """ValueError unless DeepSeek-V3's expert groups fit (:class:`~loongtrain.model.moe.MoESpec`'s rule), naming
    config.json's values."""
    groups, kept = int(hf_config.n_group or 1), int(hf_config.topk_group or 1)
    try:
        MoESpec(experts, top_k, routing=SIGMOID_GROUP_TOPK, num_groups=groups, top_groups=kept)
    except ValueError as exc:
        raise ValueError(f"n_group={groups}, topk_group={kept}, num_experts_per_tok={top_k}, {experts} routed "
                         f"experts: {exc}") from None


def block_spec(block: nn.Module, config: Any) -> MoESpec:
    """The :class:`MoESpec` of one HF sparse block (its class and the model's config); ValueError for what the
    MoE code does not compute (an activation other than SiLU, Mixtral's router jitter)."""
    kind = _sparse_kind(block)
    if kind == "GptOssMLP":
        experts = block.experts
        return MoESpec(experts.num_experts, block.router.top_k, routing=TOPK_SOFTMAX, activation=CLAMPED_SWIGLU,
                       swiglu_alpha=float(experts.alpha), swiglu_limit=float(experts.limit), interleaved=True,
                       transposed=True)
    act = getattr(config, "hidden_act", SILU)
    if act != SILU:
        raise ValueError(f"{kind}: hidden_act={act!r} has no loongtrain MoE equivalent (needs {SILU!r})")
    if kind == "MixtralSparseMoeBlock" and float(getattr(block, "jitter_noise", 0.0) or 0.0) > 0:
        raise ValueError(f"router_jitter_noise={block.jitter_noise!r} has no loongtrain MoE equivalent (needs 0)")
    gate = block.gate
    if kind in _GROUP_ROUTED:
        return MoESpec(gate.num_experts, gate.top_k, routing=SIGMOID_GROUP_TOPK,
                       normalize_top_k=bool(gate.norm_topk_prob), num_groups=int(gate.num_group),
                       top_groups=int(gate.topk_group), routed_scaling=float(gate.routed_scaling_factor))
    renormalizes = kind in ("Qwen3MoeSparseMoeBlock", "Qwen3NextSparseMoeBlock")
    normalize = bool(getattr(config, "norm_topk_prob", True)) if renormalizes else True
    return MoESpec(gate.num_experts, gate.top_k, normalize_top_k=normalize)


def block_weights(block: nn.Module) -> ExpertWeights:
    """The block's tensors as :class:`ExpertWeights` (read at every call: FSDP2 swaps them in and out)."""
    router, experts = getattr(block, SPARSE_BLOCKS[_sparse_kind(block)]), block.experts
    return ExpertWeights(router.weight, experts.gate_up_proj, experts.down_proj,
                         router_bias=getattr(router, "bias", None),
                         gate_up_bias=getattr(experts, "gate_up_proj_bias", None),
                         down_bias=getattr(experts, "down_proj_bias", None),
                         score_bias=getattr(router, "e_score_correction_bias", None))


def bind_moe(model: nn.Module, grouped: bool | None = None) -> RouterStats | None:
    """Run every HF sparse block of ``model`` through :func:`~loongtrain.model.moe.moe_forward` (binding again
    rebinds); returns the model's :class:`RouterStats` (None without sparse blocks). ``grouped``: as
    ``moe_forward``'s (None: grouped GEMMs where the device supports them). HF's own ``router_logits`` are no
    longer recorded: call the model with ``output_router_logits=False`` (:func:`loongtrain.hf.build.
    hf_hidden_and_head` does) and take the load-balancing loss from the stats (loongtrain/loss/router.py)."""
    blocks = [m for m in model.modules() if _sparse_kind(m) is not None]
    if not blocks:
        return None
    stats = router_stats(model) or RouterStats()
    for block in blocks:
        spec = block_spec(block, model.config)
        tuple_out = _sparse_kind(block) == "GptOssMLP"  # its decoder layer unpacks (hidden, router scores)
        # a router statistic only where HF defines a load-balancing loss over it (softmax routers)
        recorded = stats if spec.routing != SIGMOID_GROUP_TOPK else None
        block.forward = functools.partial(_sparse_forward, block, spec, recorded, grouped, tuple_out)
    model.__dict__[STATS_ATTR] = stats
    return stats


def router_stats(model: nn.Module) -> RouterStats | None:
    """The :class:`RouterStats` :func:`bind_moe` gave ``model`` (None if it has none)."""
    return model.__dict__.get(STATS_ATTR)


def _sparse_forward(block: nn.Module, spec: MoESpec, stats: RouterStats | None, grouped: bool | None,
                    tuple_out: bool, hidden_states: Any) -> Any:
    out = moe_forward(hidden_states, block_weights(block), spec, stats, grouped=grouped)
    shared = SHARED_EXPERTS.get(_sparse_kind(block))
    if shared is not None:  # every token through the shared MLP (HF's module), gated by a sigmoid where one is
        expert, gate = shared
        extra = getattr(block, expert)(hidden_states)
        out = out + (extra if gate is None else torch.sigmoid(getattr(block, gate)(hidden_states)) * extra)
    return (out, None) if tuple_out else out


def _sparse_kind(module: nn.Module) -> str | None:
    """The HF sparse block class ``module`` is (by name along its MRO: FSDP2 subclasses it), or None."""
    for cls in type(module).__mro__:
        if cls.__name__ in SPARSE_BLOCKS:
            return cls.__name__
    return None
