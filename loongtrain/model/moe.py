"""Mixture-of-experts feed-forward: a router picks ``top_k`` of ``num_experts`` gated MLPs per token
(docs/moe-and-gpt-oss.md#mixture-of-experts), plain PyTorch, no meshes.

Every token runs through every expert it picks (no capacity factor, no dropped tokens), so the block is
token-wise: on a zigzag shard of the sequence it computes exactly what it computes on the whole sequence;
only the router's load-balancing loss needs the whole sequence (:class:`RouterStats`, reduced by
:mod:`loongtrain.loss.router`).

- :func:`route`: router logits -> ``(weights [T, k], experts [T, k])``, by the family's rule
  (:data:`SOFTMAX_TOPK`: Qwen3-MoE / Mixtral; :data:`TOPK_SOFTMAX`: gpt-oss);
- :func:`run_experts`: the tokens sorted by expert and each expert's rows through its MLP, a loop over
  experts, or one grouped GEMM per projection (``torch._grouped_mm``) where :func:`grouped_mm_supported`;
- :func:`moe_forward`: both, on ``[..., dim]``, the router statistics recorded on the way.

The weights keep the layout of the checkpoint they come from (:class:`ExpertWeights`, :class:`MoESpec`),
so a Hugging Face block runs this code on its own parameters (loongtrain/hf/moe.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

Tensor = torch.Tensor

#: softmax over all experts (in float32, as Hugging Face does), then the top k (optionally renormalized)
SOFTMAX_TOPK = "softmax_topk"
#: the top k logits, then a softmax over those k (gpt-oss)
TOPK_SOFTMAX = "topk_softmax"
ROUTINGS = (SOFTMAX_TOPK, TOPK_SOFTMAX)
#: ``silu(gate) * up``
SILU = "silu"
#: gpt-oss: ``gate = min(gate, limit)``, ``up = clamp(up, -limit, limit)``, ``(up + 1) * gate * sigmoid(alpha gate)``
CLAMPED_SWIGLU = "clamped_swiglu"
ACTIVATIONS = (SILU, CLAMPED_SWIGLU)


@dataclass(frozen=True)
class MoESpec:
    """How one family's experts compute. ``interleaved``: the gate/up projection's outputs alternate
    ``[g0, u0, g1, u1, ...]`` (gpt-oss) instead of ``[gates..., ups...]``; ``transposed``: expert weights
    are stored ``[experts, in, out]`` (``x @ w``, gpt-oss) instead of ``[experts, out, in]`` (``x @ w.T``)."""

    num_experts: int
    top_k: int
    routing: str = SOFTMAX_TOPK
    normalize_top_k: bool = True
    activation: str = SILU
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    interleaved: bool = False
    transposed: bool = False

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be at most num_experts={self.num_experts}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing={self.routing!r}; valid choices: {list(ROUTINGS)}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation={self.activation!r}; valid choices: {list(ACTIVATIONS)}")


class ExpertWeights(NamedTuple):
    """The tensors of one MoE block: ``router [E, dim]`` (+ ``router_bias [E]``), ``gate_up`` and ``down``
    ``[E, out, in]`` (or ``[E, in, out]`` with ``MoESpec.transposed``), optional per-expert biases
    ``gate_up_bias [E, 2 ffn]``, ``down_bias [E, dim]``."""

    router: Tensor
    gate_up: Tensor
    down: Tensor
    router_bias: Tensor | None = None
    gate_up_bias: Tensor | None = None
    down_bias: Tensor | None = None


class RouterStats:
    """What the load-balancing loss needs of one forward, summed over its MoE layers, for this rank's tokens:
    ``counts [E]`` (top-k assignments per expert, no gradient), ``probs [E]`` (the sum of each token's
    softmax over all experts, differentiable) and ``rows`` (tokens times layers). :meth:`open` starts a
    forward; :meth:`close` ends it, so that a recomputing backward (activation checkpointing) adds nothing.
    Sums are in float64 for float64 logits, else float32."""

    def __init__(self) -> None:
        self.counts: Tensor | None = None
        self.probs: Tensor | None = None
        self.rows = 0
        self.recording = False

    def open(self) -> None:
        self.counts, self.probs, self.rows, self.recording = None, None, 0, True

    def close(self) -> None:
        self.recording = False

    def add(self, logits: Tensor, experts: Tensor) -> None:
        """Record one layer's router ``logits [T, E]`` and the chosen ``experts [T, k]`` (when recording; computed
        either way, so that a recomputing backward saves the same tensors as the forward did)."""
        dtype = torch.promote_types(logits.dtype, torch.float32)
        probs = torch.softmax(logits.to(dtype), dim=-1).sum(dim=0)
        counts = expert_counts(experts, logits.shape[-1]).to(dtype)
        if not self.recording:
            return
        self.counts = counts if self.counts is None else self.counts + counts
        self.probs = probs if self.probs is None else self.probs + probs
        self.rows += logits.shape[0]


def expert_counts(experts: Tensor, num_experts: int) -> Tensor:
    """``[num_experts]`` int64: how many of ``experts``' entries name each expert (a shape that does not depend
    on the values, unlike ``bincount``'s, so that fake tensors can run it)."""
    flat = experts.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def route(logits: Tensor, spec: MoESpec) -> tuple[Tensor, Tensor]:
    """``(weights [T, k], experts [T, k])`` from router ``logits [T, E]`` by ``spec.routing``; the weights
    in the logits' dtype (:data:`SOFTMAX_TOPK` rounds them through float32, as Hugging Face does)."""
    if spec.routing == TOPK_SOFTMAX:
        top, experts = torch.topk(logits, spec.top_k, dim=-1)
        return torch.softmax(top, dim=-1), experts
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, experts = torch.topk(probs, spec.top_k, dim=-1)
    if spec.normalize_top_k:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype), experts


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype the experts' matmuls run in: autocast's where it is on (as ``F.linear``'s), else ``x``'s."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


def grouped_mm_supported(x: Tensor) -> bool:
    """True where ``torch._grouped_mm`` runs the experts: CUDA devices of compute capability 9.0 or later,
    bfloat16 matmuls (:func:`compute_dtype`) on rows whose width is a multiple of 8 (its 16-byte alignment)."""
    return (x.device.type == "cuda" and compute_dtype(x) == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and torch.cuda.get_device_capability(x.device) >= (9, 0) and x.shape[-1] % 8 == 0)


def moe_forward(x: Tensor, weights: ExpertWeights, spec: MoESpec, stats: RouterStats | None = None,
                grouped: bool | None = None) -> Tensor:
    """The MoE feed-forward of ``x [..., dim]`` (same shape out); ``stats`` records the router's statistics.
    ``grouped``: one grouped GEMM per projection (True), a loop over experts (False), or
    :func:`grouped_mm_supported` (None)."""
    flat = x.reshape(-1, x.shape[-1])
    logits = F.linear(flat, weights.router, weights.router_bias)
    top, experts = route(logits, spec)
    if stats is not None:
        stats.add(logits, experts)
    use_grouped = grouped_mm_supported(flat) if grouped is None else grouped
    return run_experts(flat, top, experts, weights, spec, grouped=use_grouped).reshape(x.shape)


def run_experts(x: Tensor, top: Tensor, experts: Tensor, weights: ExpertWeights, spec: MoESpec, *,
                grouped: bool) -> Tensor:
    """``sum_j top[t, j] * expert[experts[t, j]](x[t])`` for ``x [T, dim]``: the ``T * k`` (token, expert)
    pairs sorted by expert (stable), each expert's rows through its MLP, weighted, put back in token order and
    summed per token."""
    k = spec.top_k
    flat_experts = experts.reshape(-1)
    order = torch.argsort(flat_experts, stable=True)
    tokens = order // k
    rows = x.to(compute_dtype(x))[tokens]  # cast once, then gathered (not k casts of the gathered rows)
    counts = expert_counts(flat_experts, spec.num_experts)
    if grouped:
        out = _grouped_mlp(rows, counts, flat_experts[order], weights, spec)
    else:
        out = _looped_mlp(rows, counts, weights, spec)
    out = out * top.reshape(-1)[order].to(out.dtype)[:, None]
    slots = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    # back in (token, j) order and summed over j: keeps only indices for the backward (an index_add_ would keep
    # its whole source), the sum in x's dtype
    return out[slots].reshape(x.shape[0], k, -1).to(x.dtype).sum(dim=1)


def _looped_mlp(rows: Tensor, counts: Tensor, w: ExpertWeights, spec: MoESpec) -> Tensor:
    """Each expert's contiguous rows through its MLP, one expert at a time (experts without rows skipped)."""
    outs, start = [], 0
    for e, n in enumerate(counts.tolist()):
        if n == 0:
            continue
        part = rows[start:start + n]
        start += n
        h = _project(part, w.gate_up[e], None if w.gate_up_bias is None else w.gate_up_bias[e], spec)
        outs.append(_project(_activate(h, spec), w.down[e], None if w.down_bias is None else w.down_bias[e], spec))
    return torch.cat(outs) if outs else rows.new_zeros(0, w.down.shape[1 if not spec.transposed else 2])


def _grouped_mlp(rows: Tensor, counts: Tensor, sorted_experts: Tensor, w: ExpertWeights, spec: MoESpec) -> Tensor:
    """The same through ``torch._grouped_mm`` (one call per projection; group ``e`` is expert ``e``'s rows), in
    :func:`compute_dtype` (autocast does not cover ``_grouped_mm``: the casts it would make are made here)."""
    offsets = torch.cumsum(counts, dim=0).to(torch.int32)
    dtype = compute_dtype(rows)

    def project(h: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        mat = (weight if spec.transposed else weight.transpose(1, 2)).to(dtype)  # [E, in, out]
        out = torch._grouped_mm(h.to(dtype), mat, offs=offsets)
        return out if bias is None else out + bias.to(dtype)[sorted_experts]

    return project(_activate(project(rows, w.gate_up, w.gate_up_bias), spec), w.down, w.down_bias)


def _project(h: Tensor, weight: Tensor, bias: Tensor | None, spec: MoESpec) -> Tensor:
    if spec.transposed:
        out = h @ weight
        return out if bias is None else out + bias
    return F.linear(h, weight, bias)


def _activate(h: Tensor, spec: MoESpec) -> Tensor:
    """The gated activation of the gate/up projection's output ``h [..., 2 ffn]`` -> ``[..., ffn]``."""
    gate, up = (h[..., ::2], h[..., 1::2]) if spec.interleaved else h.chunk(2, dim=-1)
    if spec.activation == SILU:
        return F.silu(gate) * up
    gate = gate.clamp(max=spec.swiglu_limit)
    up = up.clamp(min=-spec.swiglu_limit, max=spec.swiglu_limit)
    return (up + 1) * (gate * torch.sigmoid(gate * spec.swiglu_alpha))
