"""Local attention kernels returning ``(out, lse)`` with an explicit backward (docs/design.md §6).

All tensors are ``[B, H, S, D]``, possibly non-contiguous (transposed views of ``[B, S, H, D]``, slices
along S); ``lse`` is ``[B, H, S]`` (natural log; fp32, fp64 for the fp64 kernels). Causal masks are
top-left aligned and only used with ``Sq == Sk``. K/V may have fewer heads than Q (GQA, docs/design.md
§5); the returned dK/dV have K/V's head count.

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

(``cuda_flash_padded``, ``cuda_efficient_padded``: the same ops on a zero-padded head dim.)

The memory-efficient op needs equal head counts: K/V are broadcast to the query heads (a zero-stride
view for one KV head, a copy otherwise) and dK/dV summed back over each group. Its lse comes padded
along S to a multiple of 32 (``+inf`` in the padding); the forward returns the ``[:S]`` view and the
backward rebuilds that padded layout. The flash backward reads lse as a contiguous ``[B, H, S]``
buffer, so it gets ``lse.contiguous()`` (free when it already is); cuDNN's backward takes dO in O's
layout, so both are made contiguous when their strides differ. No other input is copied: the ops take
strided inputs with a unit last-dim stride. lse is passed on in the dtype given (the ring accumulates it
in fp32 for every dtype but fp64, which only the reference kernel handles on CUDA).

Selection (:func:`select_kernel`, rules in :func:`kernel_candidates`, following torch's own dispatcher
checks): CPU -> ``cpu_flash`` (all float dtypes). NVIDIA CUDA: fp16/bf16 on sm80..sm121 with head dim a
multiple of 8 and <= 256 (not in (192, 224] on sm86-89/sm120-121, where FA2 has no backward) ->
``cuda_flash``; fp32, and fp16/bf16 that flash cannot take -> ``cuda_efficient`` (sm50+, bf16 from sm80,
head dim a multiple of the GEMM alignment: 8 for fp16/bf16, 4 for fp32 from sm80); a head dim that
neither takes as it is -> the same kernel on the head dim zero-padded to a multiple of 8 (``*_padded``,
exact); fp64 (no fused CUDA kernel takes it), ROCm and other devices -> ``reference``. On sm90/sm100
``cuda_cudnn`` is a candidate too, chosen only through the ``measure`` hook of :func:`select_kernel`
(time the candidates on the device, e.g. in a GPU calibration). :func:`bf16_supported` tells whether a
device has native bf16 (for ``--dtype auto``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Tensor = torch.Tensor

# the op namespace the CUDA wrappers call; tests swap in a CPU emulation (tests/cuda_emulation.py)
_aten = torch.ops.aten


@dataclass(frozen=True)
class Kernel:
    name: str
    forward: Callable[[Tensor, Tensor, Tensor, bool, float], tuple[Tensor, Tensor]]
    backward: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, bool, float], tuple[Tensor, Tensor, Tensor]]


def _expand_kv(k: Tensor, num_heads: int) -> Tensor:
    """``[B, Hkv, S, D]`` -> ``[B, num_heads, S, D]``, query head ``h`` reading KV head ``h // group``.
    A view (zero head stride) when ``Hkv == 1``, a copy otherwise."""
    b, num_kv_heads, s, d = k.shape
    if num_kv_heads == num_heads:
        return k
    group = num_heads // num_kv_heads
    return k.unsqueeze(2).expand(b, num_kv_heads, group, s, d).reshape(b, num_heads, s, d)


def _dense(x: Tensor) -> Tensor:
    """``x.contiguous()``, spelled so that it also runs on fake CUDA tensors in a CPU-only build."""
    return x if x.is_contiguous() else x.clone(memory_format=torch.contiguous_format)


def _reduce_kv_grad(dk: Tensor, num_kv_heads: int) -> Tensor:
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
    k, v = _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1])
    scores = _scores(q, k, scale, causal, mask)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v)
    return out, lse


def reference_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    num_kv_heads = k.shape[1]
    k, v = _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1])
    scores = _scores(q, k, scale, causal, mask)
    probs = torch.exp(scores - lse.unsqueeze(-1).to(scores.dtype))
    dv = torch.matmul(probs.transpose(-1, -2), dout)
    dprobs = torch.matmul(dout, v.transpose(-1, -2))
    delta = (dout * out).sum(dim=-1, keepdim=True)
    dscores = probs * (dprobs - delta) * scale
    dq = torch.matmul(dscores, k)
    dk = torch.matmul(dscores.transpose(-1, -2), q)
    return dq, _reduce_kv_grad(dk, num_kv_heads), _reduce_kv_grad(dv, num_kv_heads)


# ---------------------------------------------------------------- CPU flash op (GQA native)


def _cpu_native_gqa(q: Tensor, k: Tensor) -> bool:
    """The CPU op takes fewer KV heads natively; in fp16/bf16 its in-kernel dK/dV group sum rounds worse than
    expanding and summing the per-head gradients in fp32, so half dtypes expand (a copy, CPU only)."""
    return k.shape[1] == q.shape[1] or q.dtype not in (torch.float16, torch.bfloat16)


def _cpu_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    if not _cpu_native_gqa(q, k):
        k, v = _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1])
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
        dout, q, _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1]), out, lse, 0.0, causal, scale=scale
    )
    return dq, _reduce_kv_grad(dk, num_kv_heads), _reduce_kv_grad(dv, num_kv_heads)


# ---------------------------------------------------------------- CUDA: FlashAttention-2 (GQA native)


def _cuda_flash_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    res = _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return res[0], res[1]  # (out, lse [B, H, S] fp32, cum_seq_q, cum_seq_k, max_q, max_k, rng_state, ...)


def _cuda_flash_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    # no dropout: the rng state is not read; shaped as the forward returns it (uint64 [2], uint64 [])
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)
    unused = torch.zeros((), dtype=torch.uint64, device=q.device)
    # cum_seq_q/k undefined (None): dense, not variable-length, batches
    dq, dk, dv = _aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, _dense(lse), None, None, q.shape[2], k.shape[2], 0.0, causal,
        rng_state, unused, scale=scale,
    )
    return dq, dk, dv


# ---------------------------------------------------------------- CUDA: memory-efficient (expands K/V)

_EFFICIENT_LSE_ALIGN = 32  # the op pads lse along S to a multiple of this


def _cuda_efficient_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    k, v = _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1])
    out, lse, _, _ = _aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
    return out, lse.narrow(2, 0, q.shape[2])


def _padded_lse(lse: Tensor) -> Tensor:
    """``[B, H, S]`` -> the efficient forward's layout: ``[B, H, ceil(S/32)*32]``, ``+inf`` padding."""
    s = lse.shape[2]
    padded_len = -(-s // _EFFICIENT_LSE_ALIGN) * _EFFICIENT_LSE_ALIGN
    return torch.nn.functional.pad(lse, (0, padded_len - s), value=float("inf"))


def _cuda_efficient_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    num_kv_heads = k.shape[1]
    k, v = _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1])
    seed = torch.zeros((), dtype=torch.int64, device=q.device)  # no dropout: not read
    offset = torch.zeros((), dtype=torch.int64, device=q.device)
    dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, _padded_lse(lse), seed, offset, 0.0, [True, True, True, False], causal,
        scale=scale,
    )
    return dq, _reduce_kv_grad(dk, num_kv_heads), _reduce_kv_grad(dv, num_kv_heads)


# ---------------------------------------------------------------- CUDA: cuDNN (GQA native)


def _cuda_cudnn_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    res = _aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    return res[0], res[1].squeeze(-1)  # lse comes as [B, H, S, 1]


def _cuda_cudnn_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    if dout.stride() != out.stride():  # cuDNN takes dO in O's layout
        dout, out = _dense(dout), _dense(out)
    seed = torch.zeros((), dtype=torch.int64, device=q.device)  # no dropout: not read
    offset = torch.zeros((), dtype=torch.int64, device=q.device)
    dq, dk, dv = _aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, _dense(lse).unsqueeze(-1), seed, offset, None, None, None,
        q.shape[2], k.shape[2], 0.0, causal, scale=scale,
    )
    return dq, dk, dv


def _head_dim_padded(kernel: Kernel, multiple: int) -> Kernel:
    """``kernel`` on head dims zero-padded to a multiple of ``multiple``: exact (zero columns add nothing
    to ``q . k``, give zero output columns and receive zero gradients), at the cost of padded copies."""

    def pad(x: Tensor) -> Tensor:
        return torch.nn.functional.pad(x, (0, -x.shape[-1] % multiple))

    def forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        out, lse = kernel.forward(pad(q), pad(k), pad(v), causal, scale)
        return out.narrow(-1, 0, v.shape[-1]), lse

    def backward(
        dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        dq, dk, dv = kernel.backward(pad(dout), pad(q), pad(k), pad(v), pad(out), lse, causal, scale)
        return dq.narrow(-1, 0, q.shape[-1]), dk.narrow(-1, 0, k.shape[-1]), dv.narrow(-1, 0, v.shape[-1])

    return Kernel(f"{kernel.name}_padded", forward, backward)


REFERENCE = Kernel("reference", reference_forward, reference_backward)
CPU_FLASH = Kernel("cpu_flash", _cpu_forward, _cpu_backward)
CUDA_FLASH = Kernel("cuda_flash", _cuda_flash_forward, _cuda_flash_backward)
CUDA_EFFICIENT = Kernel("cuda_efficient", _cuda_efficient_forward, _cuda_efficient_backward)
CUDA_CUDNN = Kernel("cuda_cudnn", _cuda_cudnn_forward, _cuda_cudnn_backward)
CUDA_FLASH_PADDED = _head_dim_padded(CUDA_FLASH, 8)
CUDA_EFFICIENT_PADDED = _head_dim_padded(CUDA_EFFICIENT, 8)


# ---------------------------------------------------------------- selection

_HALF = (torch.float16, torch.bfloat16)


def bf16_supported(device: torch.device) -> bool:
    """Whether ``device`` computes bf16 natively (for ``--dtype auto``): CPU yes; CUDA from sm80; else no."""
    device = torch.device(device)
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 0)
    return False


def _flash_ok(sm: tuple[int, int], dtype: torch.dtype, head_dim: int) -> bool:
    if dtype not in _HALF or not ((8, 0) <= sm <= (12, 1)) or head_dim % 8 or head_dim > 256:
        return False
    no_backward = ((8, 6) <= sm <= (8, 9) or sm >= (12, 0)) and 192 < head_dim <= 224
    return torch.backends.cuda.is_flash_attention_available() and not no_backward


def _efficient_alignment(sm: tuple[int, int], dtype: torch.dtype) -> int:
    """The head-dim multiple torch's dispatcher requires of the memory-efficient op (GEMM alignment)."""
    half = dtype in _HALF
    tensor_cores = sm >= (8, 0) or (sm >= (7, 0) and half)
    return max(4 if sm >= (8, 0) else 1, (8 if half else 4) if tensor_cores else 1)


def _efficient_ok(sm: tuple[int, int], dtype: torch.dtype, head_dim: int) -> bool:
    dtypes = (torch.float16, torch.float32, torch.bfloat16) if sm >= (8, 0) else (torch.float16, torch.float32)
    return dtype in dtypes and (5, 0) <= sm <= (12, 1) and head_dim % _efficient_alignment(sm, dtype) == 0


def _cudnn_ok(sm: tuple[int, int], dtype: torch.dtype, head_dim: int) -> bool:
    version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return (
        dtype in _HALF and sm[0] in (9, 10) and head_dim % 8 == 0 and head_dim <= 128
        and version is not None and version >= 90000
    )


def kernel_candidates(device: torch.device, dtype: torch.dtype, head_dim: int) -> list[Kernel]:
    """The kernels that can run attention of this dtype and head dim on ``device``, fastest-expected
    first; ``[REFERENCE]`` when no fused kernel can."""
    device = torch.device(device)
    if device.type == "cpu" and dtype in (torch.float32, torch.float64, *_HALF):
        return [CPU_FLASH]
    if device.type != "cuda" or torch.version.hip is not None or dtype == torch.float64:
        return [REFERENCE]  # fp64: no fused CUDA kernel; ROCm: rules not worked out here
    sm = torch.cuda.get_device_capability(device)
    checks = ((CUDA_FLASH, _flash_ok), (CUDA_CUDNN, _cudnn_ok), (CUDA_EFFICIENT, _efficient_ok))
    exact = [kernel for kernel, ok in checks if ok(sm, dtype, head_dim)]
    padded_dim = -(-head_dim // 8) * 8  # only when no kernel takes the head dim as it is
    padded = [kernel for kernel, ok in ((CUDA_FLASH_PADDED, _flash_ok), (CUDA_EFFICIENT_PADDED, _efficient_ok))
              if ok(sm, dtype, padded_dim)]
    return exact or padded or [REFERENCE]


def select_kernel(
    device: torch.device, dtype: torch.dtype, head_dim: int,
    measure: Callable[[Kernel], float] | None = None,
) -> Kernel:
    """The kernel the ring uses: the first of :func:`kernel_candidates`, except that ``cuda_cudnn`` is
    only taken by measurement. ``measure(kernel) -> seconds`` (the hook for a GPU calibration): the
    fastest candidate."""
    candidates = kernel_candidates(device, dtype, head_dim)
    if measure is not None and len(candidates) > 1:
        return min(candidates, key=measure)
    return next(k for k in candidates if k is not CUDA_CUDNN)  # efficient is eligible wherever cuDNN is
