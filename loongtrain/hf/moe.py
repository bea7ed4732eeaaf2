"""Hugging Face mixture-of-experts blocks run by loongtrain's MoE code (docs/moe-and-gpt-oss.md#mixture-of-experts).

:func:`bind_moe` replaces the ``forward`` of every sparse block of an HF causal LM (Qwen3-MoE's and
Mixtral's ``*SparseMoeBlock``, gpt-oss's ``GptOssMLP``) on the instance with
:func:`loongtrain.model.moe.moe_forward` over the block's own parameters, so that parameter names,
loading, sharding and export are unchanged, and records the router's statistics of every forward in one
:class:`~loongtrain.model.moe.RouterStats` per model (:func:`router_stats`) for the load-balancing loss.

:func:`moe_layout` reads the experts' layout from an HF config (which layers are sparse, how many experts,
top-k): the planner's shape of the model and the launcher's checks use it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from torch import nn

from loongtrain.model.moe import CLAMPED_SWIGLU, SILU, TOPK_SOFTMAX, ExpertWeights, MoESpec, RouterStats, moe_forward

#: the attribute of a bound model that holds its :class:`RouterStats`
STATS_ATTR = "_loongtrain_router_stats"
#: HF's sparse block classes -> the name of their router submodule
SPARSE_BLOCKS = {"Qwen3MoeSparseMoeBlock": "gate", "MixtralSparseMoeBlock": "gate", "GptOssMLP": "router"}
#: the config.json ``model_type`` of each MoE family
MOE_MODEL_TYPES = ("qwen3_moe", "mixtral", "gpt_oss")


@dataclass(frozen=True)
class MoELayout:
    """Where the experts of an HF model are: ``layers`` (indices of the sparse layers), ``num_experts``,
    ``top_k`` (experts per token), ``ffn_dim`` (one expert's width), ``aux_loss_coef`` and
    ``output_router_logits`` (whether the load-balancing loss is part of the training loss, as in HF)."""

    layers: tuple[int, ...]
    num_experts: int
    top_k: int
    ffn_dim: int
    aux_loss_coef: float
    output_router_logits: bool


def moe_layout(hf_config: Any) -> MoELayout | None:
    """The :class:`MoELayout` of an HF config (object), None for a dense family; ValueError for experts or a
    top-k that do not fit (naming the values)."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in MOE_MODEL_TYPES:
        return None
    layers_total = int(hf_config.num_hidden_layers)
    if model_type == "qwen3_moe":
        experts, ffn = int(hf_config.num_experts), int(hf_config.moe_intermediate_size)
        step, dense = int(hf_config.decoder_sparse_step), set(hf_config.mlp_only_layers or [])
        layers = tuple(i for i in range(layers_total) if i not in dense and experts > 0 and (i + 1) % step == 0)
    else:
        experts, ffn = int(hf_config.num_local_experts), int(hf_config.intermediate_size)
        layers = tuple(range(layers_total))
    top_k = int(hf_config.num_experts_per_tok)
    if experts < 1 or not 1 <= top_k <= experts:
        raise ValueError(f"{model_type}: num_experts_per_tok={top_k} must be between 1 and the number of experts "
                         f"({experts}) in config.json")
    return MoELayout(layers, experts, top_k, ffn, float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0),
                     bool(getattr(hf_config, "output_router_logits", False)))


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
    normalize = bool(getattr(config, "norm_topk_prob", True)) if kind == "Qwen3MoeSparseMoeBlock" else True
    return MoESpec(block.gate.num_experts, block.gate.top_k, normalize_top_k=normalize)


def block_weights(block: nn.Module) -> ExpertWeights:
    """The block's tensors as :class:`ExpertWeights` (read at every call: FSDP2 swaps them in and out)."""
    router, experts = getattr(block, SPARSE_BLOCKS[_sparse_kind(block)]), block.experts
    return ExpertWeights(router.weight, experts.gate_up_proj, experts.down_proj,
                         router_bias=getattr(router, "bias", None),
                         gate_up_bias=getattr(experts, "gate_up_proj_bias", None),
                         down_bias=getattr(experts, "down_proj_bias", None))


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
        block.forward = functools.partial(_sparse_forward, block, spec, stats, grouped, tuple_out)
    model.__dict__[STATS_ATTR] = stats
    return stats


def router_stats(model: nn.Module) -> RouterStats | None:
    """The :class:`RouterStats` :func:`bind_moe` gave ``model`` (None if it has none)."""
    return model.__dict__.get(STATS_ATTR)


def _sparse_forward(block: nn.Module, spec: MoESpec, stats: RouterStats, grouped: bool | None, tuple_out: bool,
                    hidden_states: Any) -> Any:
    out = moe_forward(hidden_states, block_weights(block), spec, stats, grouped=grouped)
    return (out, None) if tuple_out else out


def _sparse_kind(module: nn.Module) -> str | None:
    """The HF sparse block class ``module`` is (by name along its MRO: FSDP2 subclasses it), or None."""
    for cls in type(module).__mro__:
        if cls.__name__ in SPARSE_BLOCKS:
            return cls.__name__
    return None
