"""Mixture-of-experts feed-forward: a router picks ``top_k`` of ``num_experts`` gated MLPs per token
(docs/moe-and-gpt-oss.md#mixture-of-experts), plain PyTorch, no meshes.

Every token runs through every expert it picks (no capacity factor, no dropped tokens), so the block is
token-wise: on a zigzag shard of the sequence it computes exactly what it computes on the whole sequence;
only the router's load-balancing loss needs the whole sequence (:class:`RouterStats`, reduced by
:mod:`loongtrain.loss.router`).

- :func:`route`: router logits -> ``(weights [T, k], experts [T, k])``, by the family's rule
  (:data:`SOFTMAX_TOPK`: Qwen3-MoE / Mixtral / Qwen3-Next; :data:`TOPK_SOFTMAX`: gpt-oss;
  :data:`SIGMOID_GROUP_TOPK`: DeepSeek-V3 / Kimi, group-limited with the score-correction bias);
- :func:`run_experts`: the tokens sorted by expert and each expert's rows through its MLP, a loop over
  experts, or one grouped GEMM per projection (``torch._grouped_mm``) where :func:`grouped_mm_supported`;
- :func:`moe_forward`: both, on ``[..., dim]``, the router statistics recorded on the way.

The weights keep the layout of the checkpoint they come from (:class:`ExpertWeights`, :class:`MoESpec`),
so a Hugging Face block runs this code on its own parameters (loongtrain/hf/moe.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

Tensor = torch.Tensor

#: softmax over all experts (in float32, as Hugging Face does), then the top k (optionally renormalized)
SOFTMAX_TOPK = "softmax_topk"
#: the top k logits, then a softmax over those k (gpt-oss)
TOPK_SOFTMAX = "topk_softmax"
#: DeepSeek-V3's (and Kimi's): sigmoid scores of float32 logits; the experts are chosen on scores plus the
#: score-correction bias, only among the ``top_groups`` groups of experts whose two best biased scores sum highest;
#: their unbiased scores, optionally renormalized, times ``routed_scaling``, weight them
SIGMOID_GROUP_TOPK = "sigmoid_group_topk"
ROUTINGS = (SOFTMAX_TOPK, TOPK_SOFTMAX, SIGMOID_GROUP_TOPK)
#: ``silu(gate) * up``
SILU = "silu"
#: gpt-oss: ``gate = min(gate, limit)``, ``up = clamp(up, -limit, limit)``, ``(up + 1) * gate * sigmoid(alpha gate)``
CLAMPED_SWIGLU = "clamped_swiglu"
ACTIVATIONS = (SILU, CLAMPED_SWIGLU)


@dataclass(frozen=True)
class MoESpec:
    """How one family's experts compute. ``interleaved``: the gate/up projection's outputs alternate
    ``[g0, u0, g1, u1, ...]`` (gpt-oss) instead of ``[gates..., ups...]``; ``transposed``: expert weights
    are stored ``[experts, in, out]`` (``x @ w``, gpt-oss) instead of ``[experts, out, in]`` (``x @ w.T``).
    :data:`SIGMOID_GROUP_TOPK` routing: ``num_groups`` groups of experts, ``top_groups`` of them kept per token,
    the weights times ``routed_scaling``."""

    num_experts: int
    top_k: int
    routing: str = SOFTMAX_TOPK
    normalize_top_k: bool = True
    activation: str = SILU
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    interleaved: bool = False
    transposed: bool = False
    num_groups: int = 1
    top_groups: int = 1
    routed_scaling: float = 1.0

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "num_groups", "top_groups"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be at most num_experts={self.num_experts}")
        if self.num_experts % self.num_groups or self.top_groups > self.num_groups:
            raise ValueError(f"num_groups={self.num_groups} must divide num_experts={self.num_experts} and "
                             f"top_groups={self.top_groups} be at most num_groups")
        per_group = self.num_experts // self.num_groups
        if self.num_groups > 1 and (per_group < 2 or self.top_k > self.top_groups * per_group):
            raise ValueError(f"{self.num_groups} groups of {per_group} experts, top_groups={self.top_groups}: each "
                             f"group needs 2 experts (its score is its top two) and the kept groups top_k="
                             f"{self.top_k}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing={self.routing!r}; valid choices: {list(ROUTINGS)}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation={self.activation!r}; valid choices: {list(ACTIVATIONS)}")


class ExpertWeights(NamedTuple):
    """The tensors of one MoE block: ``router [E, dim]`` (+ ``router_bias [E]``), ``gate_up`` and ``down``
    ``[E, out, in]`` (or ``[E, in, out]`` with ``MoESpec.transposed``), optional per-expert biases
    ``gate_up_bias [E, 2 ffn]``, ``down_bias [E, dim]``, and DeepSeek-V3's score-correction bias ``score_bias
    [E]`` (a buffer: it picks the experts, it does not weight them)."""

    router: Tensor
    gate_up: Tensor
    down: Tensor
    router_bias: Tensor | None = None
    gate_up_bias: Tensor | None = None
    down_bias: Tensor | None = None
    score_bias: Tensor | None = None


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


def route(logits: Tensor, spec: MoESpec, score_bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(weights [T, k], experts [T, k])`` from router ``logits [T, E]`` by ``spec.routing``; the weights
    in the logits' dtype (:data:`SOFTMAX_TOPK` rounds them through float32, as Hugging Face does).
    ``score_bias [E]``: :data:`SIGMOID_GROUP_TOPK`'s score-correction bias (None: zeros)."""
    if spec.routing == SIGMOID_GROUP_TOPK:
        return _sigmoid_group_topk(logits, spec, score_bias)
    if spec.routing == TOPK_SOFTMAX:
        top, experts = torch.topk(logits, spec.top_k, dim=-1)
        return torch.softmax(top, dim=-1), experts
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, experts = torch.topk(probs, spec.top_k, dim=-1)
    if spec.normalize_top_k:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype), experts


def _sigmoid_group_topk(logits: Tensor, spec: MoESpec, score_bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """:data:`SIGMOID_GROUP_TOPK` on ``logits [T, E]`` (already in float32, or float64)."""
    scores = torch.sigmoid(logits)
    choice = scores.detach() if score_bias is None else scores.detach() + score_bias.to(scores.dtype)
    if spec.num_groups > 1:  # keep the top_groups groups by the sum of their two best biased scores
        groups = choice.view(-1, spec.num_groups, spec.num_experts // spec.num_groups)
        best = groups.topk(2, dim=-1).values.sum(dim=-1)
        kept = torch.zeros_like(best, dtype=torch.bool).scatter_(1, best.topk(spec.top_groups, dim=-1).indices, True)
        choice = groups.masked_fill(~kept.unsqueeze(-1), float("-inf")).view_as(choice)
    experts = choice.topk(spec.top_k, dim=-1).indices
    top = scores.gather(1, experts)
    if spec.normalize_top_k:
        top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
    return top * spec.routed_scaling, experts


def router_logits(x: Tensor, weights: ExpertWeights, spec: MoESpec) -> Tensor:
    """The router's logits ``[T, E]`` of ``x [T, dim]``: in ``x``'s (autocast's) dtype, or for
    :data:`SIGMOID_GROUP_TOPK` in float32 (float64 for float64 inputs) with autocast off, as Hugging Face keeps
    DeepSeek-V3's router in float32."""
    if spec.routing != SIGMOID_GROUP_TOPK:
        return F.linear(x, weights.router, weights.router_bias)
    dtype = torch.promote_types(x.dtype, torch.float32)
    with torch.autocast(x.device.type, enabled=False):
        bias = None if weights.router_bias is None else weights.router_bias.to(dtype)
        return F.linear(x.to(dtype), weights.router.to(dtype), bias)


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype the experts' matmuls run in: autocast's where it is on (as ``F.linear``'s), else ``x``'s."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


def grouped_mm_supported(x: Tensor, expert_width: int) -> bool:
    """True where ``torch._grouped_mm`` runs the experts: CUDA devices of compute capability 9.0 up to (not
    including) 12.0 (sm120 has no grouped kernel: torch falls back to a loop that synchronises with the host),
    bfloat16 matmuls (:func:`compute_dtype`), rows whose width and the experts' own width (``expert_width``) are
    multiples of 8 (its 16-byte alignment, on every operand)."""
    return (x.device.type == "cuda" and compute_dtype(x) == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and (9, 0) <= torch.cuda.get_device_capability(x.device) < (12, 0) and x.shape[-1] % 8 == 0
            and expert_width % 8 == 0)


def expert_width(weights: ExpertWeights, spec: MoESpec) -> int:
    """One expert's FFN width (``down``'s input width)."""
    return weights.down.shape[1 if spec.transposed else 2]


def moe_forward(x: Tensor, weights: ExpertWeights, spec: MoESpec, stats: RouterStats | None = None,
                grouped: bool | None = None) -> Tensor:
    """The MoE feed-forward of ``x [..., dim]`` (same shape out); ``stats`` records the router's statistics.
    ``grouped``: one grouped GEMM per projection (True), a loop over experts (False), or
    :func:`grouped_mm_supported` (None)."""
    flat = x.reshape(-1, x.shape[-1])
    logits = router_logits(flat, weights, spec)
    top, experts = route(logits, spec, weights.score_bias)
    if stats is not None:
        stats.add(logits, experts)
    use_grouped = grouped_mm_supported(flat, expert_width(weights, spec)) if grouped is None else grouped
    return run_experts(flat, top, experts, weights, spec, grouped=use_grouped).reshape(x.shape)


def run_experts(x: Tensor, top: Tensor, experts: Tensor, weights: ExpertWeights, spec: MoESpec, *,
                grouped: bool) -> Tensor:
    """``sum_j top[t, j] * expert[experts[t, j]](x[t])`` for ``x [T, dim]``: the ``T * k`` (token, expert)
    pairs sorted by expert (stable), each expert's rows through its MLP, weighted, put back in token order and
    summed per token."""
    k = spec.top_k
    flat_experts = experts.reshape(-1)
    order = torch.argsort(flat_experts, stable=True)  # sorted position i holds (token, j) pair order[i]
    tokens = order // k
    rows = _Dispatch.apply(x.to(compute_dtype(x)), tokens)  # cast once, then gathered
    counts = expert_counts(flat_experts, spec.num_experts)
    if grouped:
        out = _grouped_mlp(rows, counts, flat_experts[order], weights, spec)
    else:
        out = _looped_mlp(rows, counts, weights, spec)
    return _Combine.apply(out, top.to(out.dtype), order, tokens).to(x.dtype)


class _Dispatch(torch.autograd.Function):
    """``x[tokens]``: the ``T * k`` rows in expert order. Backward: the rows' gradients added into their tokens'
    (one ``index_add_``, deterministic on CUDA under ``torch.use_deterministic_algorithms``); saves the indices."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, tokens: Tensor) -> Tensor:
        ctx.save_for_backward(tokens)
        ctx.num_tokens = x.shape[0]
        return x.index_select(0, tokens)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        (tokens,) = ctx.saved_tensors
        return grad.new_zeros(ctx.num_tokens, grad.shape[-1]).index_add_(0, tokens, grad), None


class _Combine(torch.autograd.Function):
    """``y[t] = sum_j top[t, j] * expert_j(x[t])`` from the experts' outputs ``out`` in expert order: each row times
    its weight, added into its token (one ``index_add_``). Saves ``out``, the sorted weights and the indices;
    backward: the tokens' gradients gathered once in expert order, ``d out`` (scaled in place) and ``d top``."""

    @staticmethod
    def forward(ctx: Any, out: Tensor, top: Tensor, order: Tensor, tokens: Tensor) -> Tensor:
        weights = top.reshape(-1)[order]
        ctx.save_for_backward(out, weights, order, tokens)
        ctx.top_shape = top.shape
        return out.new_zeros(top.shape[0], out.shape[-1]).index_add_(0, tokens, out * weights.unsqueeze(1))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None, None]:
        out, weights, order, tokens = ctx.saved_tensors
        g = grad.to(out.dtype).index_select(0, tokens)  # each sorted row's token's gradient
        d_weights = (g * out).sum(dim=-1)
        d_top = torch.empty_like(d_weights).scatter_(0, order, d_weights).reshape(ctx.top_shape)
        return g.mul_(weights.unsqueeze(1)), d_top, None, None


def _looped_mlp(rows: Tensor, counts: Tensor, w: ExpertWeights, spec: MoESpec) -> Tensor:
    """Each expert's contiguous rows through its MLP, one expert at a time (experts without rows skipped):
    Qwen3-MoE's and Mixtral's experts by :class:`_LoopedSwiGLU`; others (biases, gpt-oss's layout and activation)
    with autograd over each expert's ops, the rows split and the weights unbound once, so that each backward
    assembles its gradient once (a slice or an index per expert would add a zero-filled full-size gradient)."""
    sizes = counts.tolist()
    if spec.activation == SILU and not (spec.interleaved or spec.transposed or w.gate_up_bias is not None
                                        or w.down_bias is not None):
        dtype = rows.dtype  # the compute dtype (the rows were cast to it: autocast does not enter a Function)
        return _LoopedSwiGLU.apply(rows, w.gate_up.to(dtype), w.down.to(dtype), sizes)
    parts = rows.split(sizes)
    gate_up, down = w.gate_up.unbind(0), w.down.unbind(0)
    gate_up_bias = w.gate_up_bias.unbind(0) if w.gate_up_bias is not None else [None] * len(sizes)
    down_bias = w.down_bias.unbind(0) if w.down_bias is not None else [None] * len(sizes)
    outs = []
    for e, part in enumerate(parts):
        if sizes[e] == 0:
            continue
        h = _activate(_project(part, gate_up[e], gate_up_bias[e], spec), spec)
        outs.append(_project(h, down[e], down_bias[e], spec))
    return torch.cat(outs) if outs else rows.new_zeros(0, w.down.shape[2 if spec.transposed else 1])


class _LoopedSwiGLU(torch.autograd.Function):
    """Expert ``e``'s ``down[e] @ swiglu(gate_up[e] @ row)`` for its contiguous block of ``rows [N, dim]`` (``sizes``
    rows each). Every matmul writes into one preallocated tensor (the outputs, the rows' and the weights'
    gradients), so that nothing is concatenated or stacked; saves the rows, the gate/up outputs and the activation
    (``dim + 3 ffn`` per row; SiLU is recomputed in the backward)."""

    @staticmethod
    def forward(ctx: Any, rows: Tensor, gate_up: Tensor, down: Tensor, sizes: list[int]) -> Tensor:
        n, f = rows.shape[0], down.shape[2]
        h, act, out = rows.new_empty(n, 2 * f), rows.new_empty(n, f), rows.new_empty(n, down.shape[1])
        for e, part in _blocks(sizes):
            torch.mm(rows[part], gate_up[e].t(), out=h[part])
            gate, up = h[part].chunk(2, dim=-1)
            torch.mul(F.silu(gate), up, out=act[part])
            torch.mm(act[part], down[e].t(), out=out[part])
        ctx.save_for_backward(rows, gate_up, down, h, act)
        ctx.sizes = sizes
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:
        rows, gate_up, down, h, act = ctx.saved_tensors
        grad = grad.contiguous()
        d_rows = torch.empty_like(rows)  # every row is written below
        d_gate_up, d_down = torch.empty_like(gate_up), torch.empty_like(down)
        for e, n in enumerate(ctx.sizes):
            if n == 0:  # an expert without rows: no gradient
                d_gate_up[e].zero_()
                d_down[e].zero_()
        for e, part in _blocks(ctx.sizes):
            g = grad[part]
            torch.mm(g.t(), act[part], out=d_down[e])
            d_act = g @ down[e]
            gate, up = h[part].chunk(2, dim=-1)
            sig = torch.sigmoid(gate)
            dh = torch.empty_like(h[part])
            d_g, d_u = dh.chunk(2, dim=-1)
            torch.mul(d_act * up, sig * (1 + gate * (1 - sig)), out=d_g)
            torch.mul(d_act, gate * sig, out=d_u)
            torch.mm(dh.t(), rows[part], out=d_gate_up[e])
            torch.mm(dh, gate_up[e], out=d_rows[part])
        return d_rows, d_gate_up, d_down, None


def _blocks(sizes: list[int]) -> list[tuple[int, slice]]:
    """``(expert, its rows)`` of the experts with rows, in order."""
    out, start = [], 0
    for e, n in enumerate(sizes):
        if n:
            out.append((e, slice(start, start + n)))
        start += n
    return out


def _grouped_mlp(rows: Tensor, counts: Tensor, sorted_experts: Tensor, w: ExpertWeights, spec: MoESpec) -> Tensor:
    """The same through ``torch._grouped_mm`` (one call per projection; group ``e`` is expert ``e``'s rows), in
    :func:`compute_dtype` (autocast does not cover ``_grouped_mm``: the casts it would make are made here)."""
    offsets = torch.cumsum(counts, dim=0).to(torch.int32)
    dtype = compute_dtype(rows)

    def project(h: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        mat = (weight if spec.transposed else weight.transpose(1, 2)).to(dtype)  # [E, in, out]
        out = torch._grouped_mm(h.to(dtype), mat, offs=offsets)
        return out if bias is None else _ExpertBias.apply(out, bias, sorted_experts)

    return project(_activate(project(rows, w.gate_up, w.gate_up_bias), spec), w.down, w.down_bias)


#: rows per step of :class:`_ExpertBias` (its transient: this many rows of the bias, in the compute dtype)
BIAS_CHUNK_ROWS = 8192


class _ExpertBias(torch.autograd.Function):
    """``out[i] += bias[experts[i]]``, in place, :data:`BIAS_CHUNK_ROWS` rows at a time: never a gathered
    ``[rows, width]`` copy of the bias (at gpt-oss's 64K tokens, 4 experts a token, 2 x 2880 wide in bf16: 2.9
    GB). Saves the expert indices. Backward: the gradient passes through as it is; the bias's is the rows'
    gradients summed per expert in fp32 (fp64 for fp64), a chunk at a time, rounded once."""

    @staticmethod
    def forward(ctx: Any, out: Tensor, bias: Tensor, experts: Tensor) -> Tensor:
        ctx.save_for_backward(experts)
        ctx.bias_shape, ctx.bias_dtype = bias.shape, bias.dtype
        b = bias.to(out.dtype)
        for start in range(0, out.shape[0], BIAS_CHUNK_ROWS):
            part = slice(start, start + BIAS_CHUNK_ROWS)
            out[part] += b.index_select(0, experts[part])
        ctx.mark_dirty(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        (experts,) = ctx.saved_tensors
        acc = torch.promote_types(grad.dtype, torch.float32)
        d_bias = grad.new_zeros(ctx.bias_shape, dtype=acc)
        for start in range(0, grad.shape[0], BIAS_CHUNK_ROWS):
            part = slice(start, start + BIAS_CHUNK_ROWS)
            d_bias.index_add_(0, experts[part], grad[part].to(acc))
        return grad, d_bias.to(ctx.bias_dtype), None


def _project(h: Tensor, weight: Tensor, bias: Tensor | None, spec: MoESpec) -> Tensor:
    if spec.transposed:
        out = h @ weight
        return out if bias is None else out + bias
    return F.linear(h, weight, bias)


class _PackedSwiGLU(torch.autograd.Function):
    """``silu(h[..., :f]) * h[..., f:]`` of the packed gate/up output ``h [..., 2f]``. Saves only ``h``; its backward
    writes both halves' gradients into one ``[..., 2f]`` tensor (a chunk's backward would concatenate them)."""

    @staticmethod
    def forward(ctx: Any, h: Tensor) -> Tensor:
        ctx.save_for_backward(h)
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (h,) = ctx.saved_tensors
        gate, up = h.chunk(2, dim=-1)
        sig = torch.sigmoid(gate)
        silu = gate * sig
        dh = torch.empty_like(h)
        d_gate, d_up = dh.chunk(2, dim=-1)
        torch.mul(grad * up, sig * (1 + gate * (1 - sig)), out=d_gate)
        torch.mul(grad, silu, out=d_up)
        return dh


def _activate(h: Tensor, spec: MoESpec) -> Tensor:
    """The gated activation of the gate/up projection's output ``h [..., 2 ffn]`` -> ``[..., ffn]``."""
    if spec.activation == SILU and not spec.interleaved:
        return _PackedSwiGLU.apply(h)
    gate, up = (h[..., ::2], h[..., 1::2]) if spec.interleaved else h.chunk(2, dim=-1)
    if spec.activation == SILU:
        return F.silu(gate) * up
    gate = gate.clamp(max=spec.swiglu_limit)
    up = up.clamp(min=-spec.swiglu_limit, max=spec.swiglu_limit)
    return (up + 1) * (gate * torch.sigmoid(gate * spec.swiglu_alpha))
