"""Rotary position embedding (RoPE) on given position ids, split-halves convention (docs/memory.md#rope);
scaled RoPE (linear, YaRN, Llama 3) through :mod:`loongtrain.model.rope_scaling`.

:func:`apply_rope` rotates in the statistics dtype (float32 for 16-bit inputs, float64 for float64), as the
plain ops ``cat([x1*cos - x2*sin, x1*sin + x2*cos])`` would, but as one autograd function over chunks of
tokens: the plain ops' float32 temporaries (the upcast, the four products, the concatenation: about 48
bytes per element of a bf16 ``q``, 3 KiB per token per head of 128) then exist for one chunk of at most
:data:`~loongtrain.model.rms_norm.CHUNK_ELEMS` elements, not for the whole local sequence. Its backward is
the inverse rotation (``sin`` negated), chunked the same way. Both give the plain ops' bits: each element's
arithmetic is the same (the inverse rotation's ``a - (-b)`` is ``a + b`` exactly), and nothing is kept
but ``cos`` and ``sin``, as the plain ops keep.
"""

from __future__ import annotations

from typing import Any

import torch

from loongtrain.model.rms_norm import CHUNK_ELEMS, row_chunks
from loongtrain.model.rope_scaling import RopeScaling, attention_factor, inv_freq

Tensor = torch.Tensor


def rope_cos_sin(
    position_ids: Tensor, head_dim: int, theta: float, dtype: torch.dtype, scaling: RopeScaling | None = None
) -> tuple[Tensor, Tensor]:
    """cos, sin ``[B, S, 1, head_dim/2]`` for arbitrary (non-contiguous) integer positions ``[B, S]``, with the
    inverse frequencies and the cos/sin factor of ``scaling`` (:mod:`loongtrain.model.rope_scaling`).

    Angles (and the factor's product) are computed in float64 so that positions of 1M+ tokens keep full
    precision.
    """
    angles = position_ids.to(torch.float64)[..., None] * inv_freq(head_dim, theta, scaling, position_ids.device)
    cos, sin = angles.cos(), angles.sin()  # [B, S, half]
    factor = attention_factor(scaling)
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    work = torch.float64 if dtype == torch.float64 else torch.float32
    return cos.to(work)[:, :, None, :], sin.to(work)[:, :, None, :]


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    xf = x.to(cos.dtype)
    x1, x2 = xf.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


def _rotate_chunks(x: Tensor, cos: Tensor, sin: Tensor, chunk_elems: int) -> Tensor:
    """:func:`_rotate` over chunks of dim 1 (tokens) of at most ``chunk_elems`` elements."""
    chunks = row_chunks(x.shape[1], x[:, :1].numel(), chunk_elems)
    if len(chunks) == 1:
        return _rotate(x, cos, sin)
    out = torch.empty_like(x)
    for lo, hi in chunks:
        out[:, lo:hi] = _rotate(x[:, lo:hi], cos[:, lo:hi], sin[:, lo:hi])
    return out


class _Rope(torch.autograd.Function):
    """Forward: ``(x [B, S, heads, D], cos, sin [B, S, 1, D/2], chunk_elems) -> x rotated``; saves ``cos``,
    ``sin``. Backward: the gradient rotated back (``-sin``), chunk by chunk."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, cos: Tensor, sin: Tensor, chunk_elems: int) -> Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.chunk_elems = chunk_elems
        return _rotate_chunks(x, cos, sin, chunk_elems)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        cos, sin = ctx.saved_tensors
        return _rotate_chunks(grad, cos, -sin, ctx.chunk_elems), None, None, None


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, chunk_elems: int = CHUNK_ELEMS) -> Tensor:
    """Rotate ``x [B, S, heads, D]`` with the split-halves convention (pairs ``i`` and ``i + D/2``), in
    ``cos``'s dtype, output in ``x``'s (module docstring). ``cos``/``sin`` that need a gradient take the
    plain ops."""
    if cos.requires_grad or sin.requires_grad:
        return _rotate(x, cos, sin)
    if not torch.is_grad_enabled() or not x.requires_grad:
        return _rotate_chunks(x, cos, sin, chunk_elems)
    return _Rope.apply(x, cos, sin, chunk_elems)
