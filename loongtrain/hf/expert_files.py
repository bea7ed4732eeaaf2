"""Per-expert tensors of MoE checkpoint files -> the fused expert tensors of transformers' models.

Qwen3-MoE and Mixtral checkpoints (the Hub's, and what ``save_pretrained`` writes) store each expert's
projections apart (``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight``; Mixtral:
``block_sparse_moe.experts.{e}.w1/w3/w2.weight`` and ``block_sparse_moe.gate.weight``); transformers >= 5
builds the experts fused: ``mlp.experts.gate_up_proj [E, 2 ffn, dim]`` (each expert's gate rows, then its up
rows) and ``mlp.experts.down_proj [E, dim, ffn]``. :func:`expert_plan` maps a file's names onto the model's;
:func:`fuse_tensors` / :func:`fuse_shapes` apply it to tensors or to their shapes (weights checked before any is
read). Files already fused (gpt-oss, loongtrain's export) pass unchanged.

Kimi-Linear's checkpoints (the Hub's, and what ``save_pretrained`` writes) also name every MLP
``block_sparse_moe.*`` (the model: ``mlp.*``), keep its KDA forget gate's tensors on the attention
(``self_attn.f_a_proj``, ``f_b_proj``, ``dt_bias``, ``A_log``; the model: ``self_attn.forget_gate.*``) and its short
convolution as three (``self_attn.q_conv1d``, ``k_conv1d``, ``v_conv1d``; the model: their concatenation
``self_attn.conv1d.weight``), as transformers' own conversion reads them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import TypeVar

import torch

T = TypeVar("T")

#: (a per-expert tensor's name, its projection -> role): role "gate", "up" or "down"
_PER_EXPERT = (
    (re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"),
     {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}),
    (re.compile(r"^(?P<prefix>.*)\.block_sparse_moe\.experts\.(?P<e>\d+)\.(?P<proj>w1|w3|w2)\.weight$"),
     {"w1": "gate", "w3": "up", "w2": "down"}),
)
#: (a file's name, the model's): Mixtral's router and Kimi-Linear's MLPs, routers, shared experts and forget gates
_RENAMED = ((re.compile(r"\.block_sparse_moe\.(?!experts\.\d)"), ".mlp."),
            (re.compile(r"\.self_attn\.(?=f_a_proj\.|f_b_proj\.|dt_bias$|A_log$)"), ".self_attn.forget_gate."))
#: Kimi-Linear's three short convolutions, concatenated (q, k, v) into the model's one
_CONCATENATED = (re.compile(r"^(?P<prefix>.*\.self_attn)\.(?P<part>q|k|v)_conv1d\.weight$"), ("q", "k", "v"),
                 "{prefix}.conv1d.weight")

#: a fused tensor's recipe: ("gate_up", [[gate_0, up_0], ...]), ("down", [[down_0], ...]), ("rename", [[name]]) or
#: ("concat", [[part_0, part_1, ...]])
Plan = dict[str, tuple[str, list[list[str]]]]


def expert_plan(names: Iterable[str]) -> Plan:
    """The model's name -> how to build it from the file's ``names``, for every per-expert or renamed tensor;
    ValueError when an expert or a half of one is missing."""
    found: dict[str, dict[int, dict[str, str]]] = {}
    convs: dict[str, dict[str, str]] = {}
    plan: Plan = {}
    for name in names:
        conv = _CONCATENATED[0].match(name)
        if conv:
            convs.setdefault(conv["prefix"], {})[conv["part"]] = name
            continue
        renamed = name
        for pattern, replacement in _RENAMED:
            renamed = pattern.sub(replacement, renamed)
        if renamed != name and not any(pattern.match(name) for pattern, _ in _PER_EXPERT):
            plan[renamed] = ("rename", [[name]])
            continue
        for pattern, roles in _PER_EXPERT:
            match = pattern.match(name)
            if match:
                prefix = match["prefix"] if pattern is _PER_EXPERT[0][0] else f"{match['prefix']}.mlp.experts"
                found.setdefault(prefix, {}).setdefault(int(match["e"]), {})[roles[match["proj"]]] = name
                break
    for prefix, experts in found.items():
        missing = [e for e in range(max(experts) + 1) if set(experts.get(e, {})) != {"gate", "up", "down"}]
        if missing:
            raise ValueError(f"the weight files hold {prefix}.N tensors but not gate, up and down of expert(s) "
                             f"{missing[:8]}")
        order = range(len(experts))
        plan[f"{prefix}.gate_up_proj"] = ("gate_up", [[experts[e]["gate"], experts[e]["up"]] for e in order])
        plan[f"{prefix}.down_proj"] = ("down", [[experts[e]["down"]] for e in order])
    for prefix, parts in convs.items():
        if set(parts) != set(_CONCATENATED[1]):
            raise ValueError(f"the weight files hold {sorted(parts.values())} but not all of {prefix}'s q/k/v "
                             f"convolutions")
        plan[_CONCATENATED[2].format(prefix=prefix)] = ("concat", [[parts[p] for p in _CONCATENATED[1]]])
    return plan


def _apply(state: dict[str, T], combine: Callable[[str, list[list[T]]], T]) -> dict[str, T]:
    plan = expert_plan(state)
    if not plan:
        return state
    used = {name for _, sources in plan.values() for group in sources for name in group}
    out = {name: value for name, value in state.items() if name not in used}
    for target, (how, sources) in plan.items():
        out[target] = combine(how, [[state[name] for name in group] for group in sources])
    return out


def fuse_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (a checkpoint's tensors) with per-expert tensors fused into the model's."""
    return _apply(state, fuse)


def fuse(how: str, parts: list[list[torch.Tensor]]) -> torch.Tensor:
    """One fused tensor from its recipe's parts (:data:`Plan`)."""
    if how == "rename":
        return parts[0][0]
    if how == "concat":
        return torch.cat(parts[0], dim=0)
    if how == "gate_up":
        return torch.stack([torch.cat(pair, dim=0) for pair in parts])
    return torch.stack([group[0] for group in parts])


def fuse_shapes(shapes: dict[str, torch.Size]) -> dict[str, torch.Size]:
    """``shapes`` (a checkpoint's, from the headers) with per-expert entries replaced by the fused shapes."""

    def shape(how: str, parts: list[list[torch.Size]]) -> torch.Size:
        if how == "rename":
            return parts[0][0]
        if how == "concat":
            if len({tuple(p[1:]) for p in parts[0]}) > 1:
                raise ValueError(f"the convolutions to concatenate differ in shape: {[tuple(p) for p in parts[0]]}")
            return torch.Size([sum(p[0] for p in parts[0]), *parts[0][0][1:]])
        first = parts[0]
        if how == "gate_up":
            if any(tuple(p[0]) != tuple(p[1]) for p in parts) or len({tuple(p[0]) for p in parts}) > 1:
                raise ValueError(f"the experts' gate/up weights differ in shape: {[tuple(s) for s in parts[0]]}")
            return torch.Size([len(parts), 2 * first[0][0], first[0][1]])
        if len({tuple(p[0]) for p in parts}) > 1:
            raise ValueError("the experts' down weights differ in shape")
        return torch.Size([len(parts), *first[0]])

    return _apply(shapes, shape)
