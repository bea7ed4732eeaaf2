"""The attention's input norm fused into its q/k/v projections: the norm's output is never kept (docs/memory.md).

In a pre-norm block ``q, k, v = Wq n, Wk n, Wv n`` with ``n = rmsnorm(x)``; autograd keeps ``n`` (``[t, dim]``
in the compute dtype, 8 KiB per token at dim 4096) from the forward (or a checkpoint's recompute) to the
projections' backward, beside the block's input ``x`` that the norm keeps anyway. :func:`fuse_norm_linear`
rewires every decoder block from outside (the model stays plain): the norm becomes the identity
(:class:`FusedNorm`) and each projection computes ``linear(rmsnorm(x))`` as one :class:`NormLinear`
(:class:`FusedProjection`; both mixed into the instance's class, so all blocks share one compiled graph),
which keeps only ``x``, the per-token scale and the weights, and rebuilds ``n`` chunk by chunk in its
backward. The norm's forward runs once per projection (a memory-bound pass, small beside attention at long
sequences); parameter names and checkpoints are unchanged.

Both directions run over chunks of rows (:data:`~loongtrain.model.rms_norm.CHUNK_ELEMS` elements of ``x``),
so the backward's ``n`` and its gradient exist for one chunk; the weight's gradient is the sum of the chunks'
products, accumulated in float32 (float64 for float64 weights): the same bits as ``nn.Linear`` when the input
is one chunk, within rounding otherwise (a matmul over fewer rows may round differently: so may the chunked
forward). Blocks are found by :func:`loongtrain.hf.families.decoder_layers`,
(norm, attention, projections: q/k/v, or MLA's query and latent projections) by :data:`NORM_AND_PROJECTIONS`;
projections that are not plain
``nn.Linear`` and norms that are not RMSNorm (loongtrain's or Hugging Face's Llama family) are left as they
are. A float64 input to a Hugging Face norm takes the stock ops, once, unfused (HF rounds its statistics to
float32 there; loongtrain/hf/norms.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from loongtrain.hf.families import decoder_layers
from loongtrain.hf.norms import LLAMA_RMS_NORMS
from loongtrain.model.llama import RMSNorm
from loongtrain.model.rms_norm import (
    CHUNK_ELEMS,
    chunked_forward,
    rms_norm,
    rms_norm_backward,
    rms_norm_forward,
    row_chunks,
)

Tensor = torch.Tensor

#: attribute names of (the attention's input norm, the attention, the ways its input projections are named):
#: loongtrain's, HF's; q/k/v, or MLA's query and latent projections (with the queries' latent, or without)
NORM_AND_PROJECTIONS = (("attention_norm", "attention", (("wq", "wk", "wv"), ("wq_a", "wkv_a"), ("wq", "wkv_a"))),
                        ("input_layernorm", "self_attn", (("q_proj", "k_proj", "v_proj"),
                                                          ("q_a_proj", "kv_a_proj_with_mqa"),
                                                          ("q_proj", "kv_a_proj_with_mqa"))))


def _accumulate(total: Tensor | None, part: Tensor, chunks: int, acc: torch.dtype) -> Tensor:
    """One chunk's weight (or bias) gradient added to the sum: as it is for one chunk, else in ``acc``."""
    if chunks == 1:
        return part
    return part.to(acc) if total is None else total + part


class NormLinear(torch.autograd.Function):
    """Forward: ``(x [..., D], norm_weight [D], eps, stats_dtype, weight [O, D], bias [O] | None,
    chunk_elems) -> linear(rms_norm(x), weight, bias)``; saves ``x``, the per-token scale and the weights.
    Backward: per chunk of rows, the norm's output rebuilt, ``d weight += dy^T n``, ``dn = dy W``, ``dx``
    through the norm's backward (:func:`~loongtrain.model.rms_norm.rms_norm_backward`)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, norm_weight: Tensor, eps: float, stats_dtype: torch.dtype | None,
                weight: Tensor, bias: Tensor | None, chunk_elems: int) -> Tensor:
        rows = x.reshape(-1, x.shape[-1])
        chunks = row_chunks(rows.shape[0], rows.shape[1], chunk_elems)
        scales = []
        if len(chunks) == 1:
            normed, rstd = rms_norm_forward(rows, norm_weight, eps, stats_dtype)
            out = F.linear(normed, weight, bias)
            scales.append(rstd)
        else:
            out = None  # in the chunks' dtype (under autocast the matmul's, not the inputs')
            for lo, hi in chunks:
                normed, rstd = rms_norm_forward(rows[lo:hi], norm_weight, eps, stats_dtype)
                part = F.linear(normed, weight, bias)
                if out is None:
                    out = part.new_empty((rows.shape[0], part.shape[-1]))
                out[lo:hi] = part
                scales.append(rstd)
        ctx.save_for_backward(x, norm_weight, torch.cat(scales) if len(scales) > 1 else scales[0], weight)
        ctx.eps, ctx.stats_dtype, ctx.chunk_elems, ctx.has_bias = eps, stats_dtype, chunk_elems, bias is not None
        return out.view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Any, ...]:
        x, norm_weight, rstd, weight = ctx.saved_tensors
        need_x, need_nw, _, _, need_w, need_b, _ = ctx.needs_input_grad
        rows, grads = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        chunks = row_chunks(rows.shape[0], rows.shape[1], ctx.chunk_elems)
        acc = torch.promote_types(torch.float32, weight.dtype)
        grad_x = torch.empty_like(rows) if need_x else None
        grad_nw = torch.zeros(norm_weight.shape, dtype=acc, device=x.device) if need_nw else None
        grad_w = grad_b = None
        for lo, hi in chunks:
            g = grads[lo:hi]
            normed, _ = rms_norm_forward(rows[lo:hi], norm_weight, ctx.eps, ctx.stats_dtype)
            if need_w:
                grad_w = _accumulate(grad_w, g.t() @ normed.to(g.dtype), len(chunks), acc)
            if need_b and ctx.has_bias:
                grad_b = _accumulate(grad_b, g.sum(0), len(chunks), acc)
            if need_x or need_nw:
                gx, gnw = rms_norm_backward((g @ weight.to(g.dtype)).to(normed.dtype), rows[lo:hi], norm_weight,
                                            rstd[lo:hi], need_x, need_nw)
                if grad_x is not None:
                    grad_x[lo:hi] = gx
                if grad_nw is not None:
                    grad_nw += gnw
        return (None if grad_x is None else grad_x.view(x.shape),
                None if grad_nw is None else grad_nw.to(norm_weight.dtype), None, None,
                None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(weight.dtype), None)


def _norm_spec(norm: nn.Module) -> tuple[float, torch.dtype | None, bool] | None:
    """``(eps, stats dtype, Hugging Face's)`` of a norm this module fuses, else None."""
    if isinstance(norm, RMSNorm) and type(norm).forward is RMSNorm.forward:
        return norm.eps, None, False
    if type(norm).__name__ in LLAMA_RMS_NORMS:
        return norm.variance_epsilon, torch.float32, True
    return None


#: set on a norm output the stock ops made (a Hugging Face norm's float64 input): the projections take it as is
NORMED = "_loongtrain_normed"


class FusedProjection:
    """Mixed into a fused q/k/v projection's class (``nn.Linear``): ``forward(x) = linear(rmsnorm(x))`` with the
    norm its block's attention input norm (held outside the module tree, so parameter names are unchanged).
    A class of its own rather than a per-instance ``forward``: every block then runs the same code, and
    ``torch.compile`` reuses one graph for all blocks (docs/compile.md)."""

    def forward(self, x: Tensor) -> Tensor:
        return projection_linear(self, x, self.weight, self.bias)


def is_fused(module: nn.Module) -> bool:
    """Whether ``module`` is a projection whose input norm :func:`fuse_norm_linear` moved into it."""
    return _NORM in module.__dict__


def projection_linear(module: nn.Module, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``linear(input, weight, bias)`` with the input projection ``module`` multiplies: ``x`` itself, or for a
    fused projection ``rmsnorm(x)`` through :class:`NormLinear` (never kept). ``weight`` may be another
    matrix than the module's own over the same input (a LoRA adapter's A: loongtrain/parallelize/lora.py)."""
    if not is_fused(module) or getattr(x, NORMED, False):
        return F.linear(x, weight, bias)
    norm, (eps, stats, _) = module.__dict__[_NORM], module.__dict__[_SPEC]
    if not torch.is_grad_enabled():
        return F.linear(chunked_forward(x, norm.weight, eps, stats)[0], weight, bias)
    return NormLinear.apply(x, norm.weight, eps, stats, weight, bias, CHUNK_ELEMS)


def projection_input(module: nn.Module, x: Tensor) -> Tensor:
    """The input projection ``module`` multiplies, as a tensor of its own: ``x``, or for a fused projection
    ``rmsnorm(x)`` (with autograd: the norm keeps its input and scale), for a caller that must transform it
    before its matmul (a LoRA adapter's dropout)."""
    if not is_fused(module) or getattr(x, NORMED, False):
        return x
    norm, (eps, stats, _) = module.__dict__[_NORM], module.__dict__[_SPEC]
    return rms_norm(x, norm.weight, eps, stats_dtype=stats)


class FusedNorm:
    """Mixed into a fused attention input norm's class: its own forward is the identity (its projections
    normalise), except for a Hugging Face norm's float64 input: HF rounds its statistics to float32 there, so
    only its own ops, once, with the three projections' gradients summed before its backward as unfused, give
    its bits (loongtrain/hf/norms.py)."""

    def forward(self, x: Tensor) -> Tensor:
        if self.__dict__[_SPEC][2] and x.dtype == torch.float64:
            out = super().forward(x)
            setattr(out, NORMED, True)
            return out
        return x


_NORM, _SPEC = "_loongtrain_norm", "_loongtrain_norm_spec"  # plain attributes: not submodules, not state
_CLASSES: dict[tuple[type, type], type] = {}


def mix_in(module: nn.Module, mixin: type, **attrs: Any) -> None:
    """Give ``module`` the class ``(mixin, type(module))`` (one class per pair, as FSDP2 does) and plain
    attributes ``attrs`` (set in ``__dict__``: not registered as submodules)."""
    cls = type(module)
    fused = _CLASSES.get((mixin, cls))
    if fused is None:
        fused = _CLASSES[(mixin, cls)] = type(f"{mixin.__name__}{cls.__name__}", (mixin, cls), {})
    module.__class__ = fused
    module.__dict__.update(attrs)


def fuse_norm_linear(model: nn.Module) -> int:
    """Fuse every block's attention input norm into its q/k/v projections (module docstring); returns the
    number of blocks fused. Idempotent: a fused block (its norm a :class:`FusedNorm`) is left as it is."""
    fused = 0
    for block in decoder_layers(model):
        for norm_name, attn_name, namings in NORM_AND_PROJECTIONS:
            norm, attn = getattr(block, norm_name, None), getattr(block, attn_name, None)
            if not isinstance(norm, nn.Module) or not isinstance(attn, nn.Module):
                continue
            linears = next(([getattr(attn, name) for name in names] for names in namings
                            if all(type(getattr(attn, name, None)) is nn.Linear for name in names)), None)
            spec = _norm_spec(norm)
            if spec is None or isinstance(norm, FusedNorm) or "forward" in norm.__dict__ or linears is None:
                break
            for lin in linears:
                mix_in(lin, FusedProjection, **{_NORM: norm, _SPEC: spec})
            mix_in(norm, FusedNorm, **{_SPEC: spec})
            fused += 1
            break
    return fused
