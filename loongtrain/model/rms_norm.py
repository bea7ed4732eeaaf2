"""RMSNorm as one autograd function that keeps only its input and the per-token scale (docs/design.md §7).

``y = (x * rstd).to(x.dtype) * weight`` with ``rstd = 1 / sqrt(mean(x**2) + eps)`` over the last dim, the
statistics in float32 for 16-bit inputs (float64 stays float64). Written with plain ops, autograd would keep
the float32 upcast of ``x`` and the normalised values for the backward: ``4 + 2`` bytes per element for a
bf16 input, three times the input itself, in every norm of every layer and in the final norm. This
function saves ``x`` (which its caller usually keeps anyway: the block's input, the residual stream) and
``rstd`` (one float32 per token), and rebuilds the normalised values in the backward. The forward is
bit-identical to the plain ops; the gradients are the same math (exact to rounding, 1e-15 in float64).
"""

from __future__ import annotations

from typing import Any

import torch

Tensor = torch.Tensor


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


class _RMSNorm(torch.autograd.Function):
    """Forward: ``(x [..., D], weight [D], eps, stats_dtype) -> y`` (:func:`rms_norm_forward`); saves ``x``,
    ``weight`` and ``rstd``. Backward: :func:`rms_norm_backward`."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float, stats_dtype: torch.dtype | None) -> Tensor:
        y, rstd = rms_norm_forward(x, weight, eps, stats_dtype)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None, None]:
        x, weight, rstd = ctx.saved_tensors
        grad_x, grad_w = rms_norm_backward(grad, x, weight, rstd, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        return grad_x, grad_w, None, None


def rms_norm(x: Tensor, weight: Tensor, eps: float, stats_dtype: torch.dtype | None = None) -> Tensor:
    """``(x * rstd).to(x.dtype) * weight`` (module docstring); ``stats_dtype``: the statistics' dtype (default
    float32 for 16-bit inputs, else ``x``'s; Hugging Face's Llama-family norms always use float32). The plain
    ops when nothing needs a gradient."""
    if not torch.is_grad_enabled() or not (x.requires_grad or weight.requires_grad):
        return rms_norm_forward(x, weight, eps, stats_dtype)[0]
    return _RMSNorm.apply(x, weight, eps, stats_dtype)
