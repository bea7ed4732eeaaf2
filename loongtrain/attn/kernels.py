"""Local attention kernels returning ``(out, lse)`` with an explicit backward (docs/attention.md#kernels).

All tensors are ``[B, H, S, D]``, possibly non-contiguous (transposed views of ``[B, S, H, D]``, slices
along S); ``lse`` is ``[B, H, S]`` (natural log; fp32, fp64 for the fp64 kernels). Causal masks are
top-left aligned and only used with ``Sq == Sk``. K/V may have fewer heads than Q (GQA, docs/design.md
docs/attention.md#the-gqa-rule); the returned dK/dV have K/V's head count. V's head dim may differ from Q/K's (MLA):
out and dV have V's; the reference takes that as it is, every fused op needs one head dim for all three, so
:func:`for_head_dims` runs those on Q/K and V zero-padded to the wider (:func:`head_dim_padded`, exact).

Kernels and the torch 2.13 ops behind them (schemas: ``torch.ops.aten.<op>.default._schema``):

=================  ==========================================================  ======================
kernel             op (forward / backward)                                       GQA
=================  ==========================================================  ======================
``cpu_flash``      ``_scaled_dot_product_flash_attention_for_cpu[_backward]``    native
``cuda_flash``     ``_scaled_dot_product_flash_attention[_backward]`` (FA2)      native
``cuda_cudnn``     ``_scaled_dot_product_cudnn_attention[_backward]``            native
``cuda_efficient`` ``_scaled_dot_product_efficient_attention[_backward]``        K/V expanded here
``reference``      plain math; materialises the ``Sq x Sk`` score matrix         K/V expanded here
=================  ==========================================================  ======================

The CUDA kernels' wrappers, their variable-length forms and their layouts: :mod:`loongtrain.attn.cuda_kernels`.

Which kernel runs where (capability rules and measurement): :mod:`loongtrain.attn.kernel_choice`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

Tensor = torch.Tensor


class Seqlens(NamedTuple):
    """The packed sequences of a variable-length call (FlashAttention's ``cu_seqlens_q``, ``cu_seqlens_k``,
    ``max_seqlen_q``, ``max_seqlen_k``): sequence ``i`` is q rows ``[cu_q[i], cu_q[i+1])`` against k rows
    ``[cu_k[i], cu_k[i+1])`` (int32, contiguous, ``n + 1`` entries from 0 to the row count); ``max_q``/``max_k``: the
    longest."""

    cu_q: Tensor
    cu_k: Tensor
    max_q: int
    max_k: int


class VarlenMask(NamedTuple):
    """What a variable-length call computes of its sequences: the causal flag (one for all of them), the softmax
    scale, and a window (``(left, right)``, FlashAttention's; None: none; only for a ``Kernel.windowed`` kernel)."""

    causal: bool
    scale: float
    window: tuple[int, int] | None = None


VarlenForward = Callable[[Tensor, Tensor, Tensor, Seqlens, VarlenMask], tuple[Tensor, Tensor]]
VarlenBackward = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Seqlens, VarlenMask],
                          tuple[Tensor, Tensor, Tensor]]


@dataclass(frozen=True)
class Kernel:
    """A local attention kernel: ``forward(q, k, v, causal, scale) -> (out, lse)`` and ``backward(dout, q, k,
    v, out, lse, causal, scale) -> (dq, dk, dv)`` on ``[B, H, S, D]``; optionally the packed variable-length
    form ``varlen_forward(q, k, v, seqlens, mask) -> (out, lse [H, Tq])`` and
    ``varlen_backward(dout, q, k, v, out, lse, seqlens, mask)`` (:class:`Seqlens`, :class:`VarlenMask`; module
    docstring); ``varlen_bottom_right``: whether the varlen op aligns a causal mask bottom-right (a single query row
    then sees every key), else top-left; ``windowed``: the dense ops also take ``window=(left, right)`` and the
    varlen ops a ``VarlenMask.window``, FlashAttention's bottom-right aligned window (row ``r`` of ``Sq`` sees keys
    ``c`` of ``Sk`` with ``-left <= c - r - (Sk - Sq) <= right``, ``-1`` unbounded; with ``causal=False``), so a
    sliding window is one call (:class:`loongtrain.attn.masking.Piece`'s ``band``); ``unequal_head_dims``: whether
    every op takes a V head dim different from Q/K's as it is (else :func:`for_head_dims` pads)."""

    name: str
    forward: Callable[..., tuple[Tensor, Tensor]]
    backward: Callable[..., tuple[Tensor, Tensor, Tensor]]
    varlen_forward: VarlenForward | None = None
    varlen_backward: VarlenBackward | None = None
    varlen_bottom_right: bool = True
    windowed: bool = False
    unequal_head_dims: bool = False


def expand_kv(k: Tensor, num_heads: int) -> Tensor:
    """``[B, Hkv, S, D]`` -> ``[B, num_heads, S, D]``, query head ``h`` reading KV head ``h // group``.
    A view (zero head stride) when ``Hkv == 1``, a copy otherwise."""
    b, num_kv_heads, s, d = k.shape
    if num_kv_heads == num_heads:
        return k
    group = num_heads // num_kv_heads
    return k.unsqueeze(2).expand(b, num_kv_heads, group, s, d).reshape(b, num_heads, s, d)


def dense_layout(x: Tensor) -> Tensor:
    """``x.contiguous()``, spelled so that it also runs on fake CUDA tensors in a CPU-only build."""
    return x if x.is_contiguous() else x.clone(memory_format=torch.contiguous_format)


def reduce_kv_grad(dk: Tensor, num_kv_heads: int) -> Tensor:
    b, h, s, d = dk.shape
    if h == num_kv_heads:
        return dk
    acc = torch.float32 if dk.dtype in (torch.float16, torch.bfloat16) else dk.dtype
    return dk.unflatten(1, (num_kv_heads, h // num_kv_heads)).sum(dim=2, dtype=acc).to(dk.dtype)


# ---------------------------------------------------------------- reference (plain math)


def _scores(q: Tensor, k: Tensor, scale: float, causal: bool, mask: Tensor | None) -> Tensor:
    """``q k^T * scale`` with invisible entries ``-inf`` (top-left causal, and/or an explicit ``[Sq, Sk]`` mask)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        tril = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        mask = tril if mask is None else mask & tril
    return scores if mask is None else scores.masked_fill(~mask, float("-inf"))


def reference_forward(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, mask: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Plain-math attention; ``mask [Sq, Sk]`` (bool, True = visible) restricts it further. Every query
    row must see at least one key."""
    k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    scores = _scores(q, k, scale, causal, mask)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v)
    return out, lse


def reference_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    num_kv_heads = k.shape[1]
    k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    scores = _scores(q, k, scale, causal, mask)
    probs = torch.exp(scores - lse.unsqueeze(-1).to(scores.dtype))
    dv = torch.matmul(probs.transpose(-1, -2), dout)
    dprobs = torch.matmul(dout, v.transpose(-1, -2))
    delta = (dout * out).sum(dim=-1, keepdim=True)
    dscores = probs * (dprobs - delta) * scale
    dq = torch.matmul(dscores, k)
    dk = torch.matmul(dscores.transpose(-1, -2), q)
    return dq, reduce_kv_grad(dk, num_kv_heads), reduce_kv_grad(dv, num_kv_heads)


# ---------------------------------------------------------------- CPU flash op (GQA native)


def _cpu_native_gqa(q: Tensor, k: Tensor) -> bool:
    """The CPU op takes fewer KV heads natively; in fp16/bf16 its in-kernel dK/dV group sum rounds worse than
    expanding and summing the per-head gradients in fp32, so half dtypes expand (a copy, CPU only)."""
    return k.shape[1] == q.shape[1] or q.dtype not in (torch.float16, torch.bfloat16)


def _cpu_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    if not _cpu_native_gqa(q, k):
        k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def _cpu_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    if _cpu_native_gqa(q, k):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale
        )
    num_kv_heads = k.shape[1]
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1]), out, lse, 0.0, causal, scale=scale
    )
    return dq, reduce_kv_grad(dk, num_kv_heads), reduce_kv_grad(dv, num_kv_heads)


REFERENCE = Kernel("reference", reference_forward, reference_backward, unequal_head_dims=True)
CPU_FLASH = Kernel("cpu_flash", _cpu_forward, _cpu_backward)


# ---------------------------------------------------------------- zero-padded head dims


def _widened(x: Tensor, width: int) -> Tensor:
    """``x`` with its last dim zero-padded to ``width`` (``x`` itself when it has that width)."""
    return x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))


def head_dim_padded(kernel: Kernel, multiple: int, name: str) -> Kernel:
    """``kernel`` on q, k, v zero-padded to one head dim, the wider of Q/K's and V's rounded up to ``multiple``:
    exact (zero columns add nothing to ``q . k``, give zero output columns, which are cut off, and receive zero
    gradients), at the cost of the padded copies. Its varlen ops (if any) likewise, a window (``Kernel.windowed``)
    passed on as it is; lse is untouched."""

    def width(q: Tensor, v: Tensor) -> int:
        wide = max(q.shape[-1], v.shape[-1])
        return wide + -wide % multiple

    def forward(q: Tensor, k: Tensor, v: Tensor, *args: object, **window: object) -> tuple[Tensor, Tensor]:
        w = width(q, v)
        out, lse = kernel.forward(_widened(q, w), _widened(k, w), _widened(v, w), *args, **window)
        return out.narrow(-1, 0, v.shape[-1]), lse

    def backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *args: object,
                 **window: object) -> tuple[Tensor, Tensor, Tensor]:
        w = width(q, v)
        dq, dk, dv = kernel.backward(*(_widened(t, w) for t in (dout, q, k, v, out)), lse, *args, **window)
        return dq.narrow(-1, 0, q.shape[-1]), dk.narrow(-1, 0, k.shape[-1]), dv.narrow(-1, 0, v.shape[-1])

    def varlen_forward(q: Tensor, k: Tensor, v: Tensor, seqlens: Seqlens, mask: VarlenMask) -> tuple[Tensor, Tensor]:
        w = width(q, v)
        out, lse = kernel.varlen_forward(_widened(q, w), _widened(k, w), _widened(v, w), seqlens, mask)
        return out.narrow(-1, 0, v.shape[-1]), lse

    def varlen_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, seqlens: Seqlens,
                        mask: VarlenMask) -> tuple[Tensor, Tensor, Tensor]:
        w = width(q, v)
        dq, dk, dv = kernel.varlen_backward(*(_widened(t, w) for t in (dout, q, k, v, out)), lse, seqlens, mask)
        return dq.narrow(-1, 0, q.shape[-1]), dk.narrow(-1, 0, k.shape[-1]), dv.narrow(-1, 0, v.shape[-1])

    varlen = kernel.varlen_forward is not None
    return Kernel(name, forward, backward, varlen_forward if varlen else None, varlen_backward if varlen else None,
                  kernel.varlen_bottom_right, kernel.windowed, unequal_head_dims=True)


@functools.cache
def _equal_widths(kernel: Kernel) -> Kernel:
    return head_dim_padded(kernel, 1, f"{kernel.name}_v_padded")


def for_head_dims(kernel: Kernel, qk_head_dim: int, v_head_dim: int) -> Kernel:
    """``kernel`` for attention whose V head dim is ``v_head_dim`` and Q/K's ``qk_head_dim`` (MLA: 128 and 192):
    ``kernel`` itself when they are equal or it takes them so (``Kernel.unequal_head_dims``), else the same kernel
    on Q/K and V zero-padded to the wider (:func:`head_dim_padded`; the same object on every call)."""
    if qk_head_dim == v_head_dim or kernel.unequal_head_dims:
        return kernel
    return _equal_widths(kernel)
