"""RMSNorm as one autograd function that keeps only its input and the per-token scale (docs/memory.md).

``y = (x * rstd).to(x.dtype) * weight`` with ``rstd = 1 / sqrt(mean(x**2) + eps)`` over the last dim, the
statistics in float32 for 16-bit inputs (float64 stays float64). Written with plain ops, autograd would keep
the float32 upcast of ``x`` and the normalised values for the backward: ``4 + 2`` bytes per element for a
bf16 input, three times the input itself, in every norm of every layer and in the final norm. This
function saves ``x`` (which its caller usually keeps anyway: the block's input, the residual stream) and
``rstd`` (one float32 per token), and rebuilds the normalised values in the backward. The forward is
bit-identical to the plain ops; the gradients are the same math (exact to rounding, 1e-15 in float64).

Both directions run over chunks of at most :data:`CHUNK_ELEMS` elements (whole rows, i.e. tokens), so the
float32 temporaries of a norm over a long sequence (the upcast, the normalised values, the scaled gradient:
16 bytes per element for a bf16 input of ``[1M, 4096]`` each) exist for one chunk, not the whole input.
The forward and the input's gradient are row-wise, so chunks give the same bits; the weight's gradient is
summed over the chunks in float32 (float64 for float64 weights), which rounds once at the end instead of
once for the whole sum (the same bits when the input is one chunk).
"""

from __future__ import annotations

from typing import Any

import torch

Tensor = torch.Tensor

#: elements of one chunk of the norm (forward and backward): 32M elements, 128 MiB per float32 temporary
CHUNK_ELEMS = 1 << 25


def _stats_dtype(x: Tensor, stats_dtype: torch.dtype | None) -> torch.dtype:
    if stats_dtype is not None:
        return stats_dtype
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


def rms_norm_forward(x: Tensor, weight: Tensor, eps: float,
                     stats_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """``(y, rstd)``: the norm's output and the per-token scale ``rstd [..., 1]`` (statistics dtype), which
    with ``x`` is all :func:`rms_norm_backward` needs. Row-wise: a slice of tokens gives the same bits."""
    xf = x.to(_stats_dtype(x, stats_dtype))
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * rstd).to(x.dtype) * weight, rstd


def rms_norm_backward(grad: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, need_x: bool = True,
                      need_weight: bool = True, weight_grad_dtype: torch.dtype | None = None,
                      ) -> tuple[Tensor | None, Tensor | None]:
    """``(dx, dweight)`` for the output gradient ``grad``: ``dx = rstd * (g' - n * mean(g' * n))`` with
    ``n = x * rstd`` and ``g' = g * weight`` (rounded to ``x``'s dtype, as autograd's cast does, then in the
    statistics dtype; ``dx`` cast to ``x``'s), ``dweight = sum over tokens of g * n.to(x.dtype)`` (in
    ``weight_grad_dtype``, default weight's: a caller summing slices asks for float32). ``None`` for what is
    not needed."""
    normed = x.to(rstd.dtype) * rstd
    grad_x = grad_w = None
    if need_weight:
        out_dtype = torch.promote_types(x.dtype, weight.dtype)
        per_token = grad.to(out_dtype) * normed.to(x.dtype).to(out_dtype)
        grad_w = per_token.reshape(-1, per_token.shape[-1]).sum(0).to(weight_grad_dtype or weight.dtype)
    if need_x:
        g = (grad * weight).to(x.dtype).to(rstd.dtype)
        grad_x = (rstd * (g - normed * (g * normed).mean(-1, keepdim=True))).to(x.dtype)
    return grad_x, grad_w


def row_chunks(rows: int, row_elems: int, chunk_elems: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` of ``rows`` rows of ``row_elems`` elements, at most ``chunk_elems`` elements (and at least
    one row) a chunk; one empty chunk for no rows. The chunking of the norms, RoPE and the fused q/k/v norm."""
    step = max(1, chunk_elems // max(1, row_elems))
    return [(lo, min(rows, lo + step)) for lo in range(0, rows, step)] or [(0, 0)]


def _row_chunks(x: Tensor, chunk_elems: int) -> list[tuple[int, int]]:
    return row_chunks(x.numel() // max(1, x.shape[-1]), x.shape[-1], chunk_elems)


def chunked_forward(x: Tensor, weight: Tensor, eps: float, stats_dtype: torch.dtype | None,
                    chunk_elems: int = CHUNK_ELEMS) -> tuple[Tensor, Tensor]:
    """:func:`rms_norm_forward` over chunks of rows (module docstring): the same bits."""
    chunks = _row_chunks(x, chunk_elems)
    if len(chunks) == 1:
        return rms_norm_forward(x, weight, eps, stats_dtype)
    rows = x.reshape(-1, x.shape[-1])
    y = x.new_empty(rows.shape, dtype=torch.promote_types(x.dtype, weight.dtype))
    rstd = x.new_empty((rows.shape[0], 1), dtype=_stats_dtype(x, stats_dtype))
    for lo, hi in chunks:
        y[lo:hi], rstd[lo:hi] = rms_norm_forward(rows[lo:hi], weight, eps, stats_dtype)
    return y.view(*x.shape[:-1], -1), rstd.view(*x.shape[:-1], 1)


def chunked_backward(grad: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, need_x: bool, need_weight: bool,
                     chunk_elems: int = CHUNK_ELEMS) -> tuple[Tensor | None, Tensor | None]:
    """:func:`rms_norm_backward` over chunks of rows (module docstring): ``dx`` the same bits, ``dweight``
    summed over the chunks in float32 (float64 for float64 weights) and cast to the weight's dtype."""
    chunks = _row_chunks(x, chunk_elems)
    if len(chunks) == 1:
        return rms_norm_backward(grad, x, weight, rstd, need_x, need_weight)
    d = x.shape[-1]
    rows, grads, scales = x.reshape(-1, d), grad.reshape(-1, grad.shape[-1]), rstd.reshape(-1, 1)
    grad_x = torch.empty_like(rows) if need_x else None
    acc = torch.promote_types(torch.float32, weight.dtype)
    grad_w = torch.zeros(d, dtype=acc, device=x.device) if need_weight else None
    for lo, hi in chunks:
        gx, gw = rms_norm_backward(grads[lo:hi], rows[lo:hi], weight, scales[lo:hi], need_x, need_weight,
                                   weight_grad_dtype=acc)
        if grad_x is not None:
            grad_x[lo:hi] = gx
        if grad_w is not None:
            grad_w += gw
    return (None if grad_x is None else grad_x.view(x.shape),
            None if grad_w is None else grad_w.to(weight.dtype))


class _RMSNorm(torch.autograd.Function):
    """Forward: ``(x [..., D], weight [D], eps, stats_dtype, chunk_elems) -> y`` (:func:`chunked_forward`);
    saves ``x``, ``weight`` and ``rstd``. Backward: :func:`chunked_backward`."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float, stats_dtype: torch.dtype | None,
                chunk_elems: int) -> Tensor:
        y, rstd = chunked_forward(x, weight, eps, stats_dtype, chunk_elems)
        ctx.save_for_backward(x, weight, rstd)
        ctx.chunk_elems = chunk_elems
        return y

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None, None, None]:
        x, weight, rstd = ctx.saved_tensors
        grad_x, grad_w = chunked_backward(grad, x, weight, rstd, ctx.needs_input_grad[0], ctx.needs_input_grad[1],
                                          ctx.chunk_elems)
        return grad_x, grad_w, None, None, None


def rms_norm(x: Tensor, weight: Tensor, eps: float, stats_dtype: torch.dtype | None = None,
             chunk_elems: int = CHUNK_ELEMS) -> Tensor:
    """``(x * rstd).to(x.dtype) * weight`` (module docstring); ``stats_dtype``: the statistics' dtype (default
    float32 for 16-bit inputs, else ``x``'s; Hugging Face's Llama-family norms always use float32). The plain
    ops when nothing needs a gradient; ``chunk_elems``: the chunk size of both directions (module docstring)."""
    if not torch.is_grad_enabled() or not (x.requires_grad or weight.requires_grad):
        return chunked_forward(x, weight, eps, stats_dtype, chunk_elems)[0]
    return _RMSNorm.apply(x, weight, eps, stats_dtype, chunk_elems)
