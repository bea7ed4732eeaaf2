"""Local attention kernels returning ``(out, lse)`` with an explicit backward.

All tensors are ``[B, H, S, D]``; ``lse`` is ``[B, H, S]`` (natural log, fp32 for half inputs).
Causal masks are top-left aligned and only used with ``Sq == Sk``. KV heads may be fewer than
query heads (GQA): they are expanded here, locally, never on the wire, and their gradients summed.

Selection (:func:`select_kernel`): CPU -> torch's fused flash op for CPU (all float dtypes);
CUDA fp16/bf16 with head dim <= 256 -> torch's FlashAttention-2 SDPA op; anything else (CUDA fp32/fp64,
other devices) -> the plain-math reference, which materialises the score matrix of one ring block.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Tensor = torch.Tensor


@dataclass(frozen=True)
class Kernel:
    name: str
    forward: Callable[[Tensor, Tensor, Tensor, bool, float], tuple[Tensor, Tensor]]
    backward: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, bool, float], tuple[Tensor, Tensor, Tensor]]


def _expand_kv(k: Tensor, num_heads: int) -> Tensor:
    group = num_heads // k.shape[1]
    return k if group == 1 else k.repeat_interleave(group, dim=1)


def _reduce_kv_grad(dk: Tensor, num_kv_heads: int) -> Tensor:
    b, h, s, d = dk.shape
    if h == num_kv_heads:
        return dk
    return dk.view(b, num_kv_heads, h // num_kv_heads, s, d).sum(dim=2)


# ---------------------------------------------------------------- reference (plain math)


def reference_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    k, v = _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1])
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v)
    return out, lse


def reference_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    num_kv_heads = k.shape[1]
    k, v = _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1])
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.exp(scores - lse.unsqueeze(-1).to(scores.dtype))
    dv = torch.matmul(probs.transpose(-1, -2), dout)
    dprobs = torch.matmul(dout, v.transpose(-1, -2))
    delta = (dout * out).sum(dim=-1, keepdim=True)
    dscores = probs * (dprobs - delta) * scale
    dq = torch.matmul(dscores, k)
    dk = torch.matmul(dscores.transpose(-1, -2), q)
    return dq, _reduce_kv_grad(dk, num_kv_heads), _reduce_kv_grad(dv, num_kv_heads)


# ---------------------------------------------------------------- CPU flash op


def _cpu_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    k, v = _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1])
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def _cpu_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    num_kv_heads = k.shape[1]
    k, v = _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1])
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, scale=scale
    )
    return dq, _reduce_kv_grad(dk, num_kv_heads), _reduce_kv_grad(dv, num_kv_heads)


# ---------------------------------------------------------------- CUDA SDPA ops


def _cuda_flash_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    k, v = _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1])
    res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return res[0], res[1]


def _cuda_flash_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    num_kv_heads = k.shape[1]
    k, v = _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1])
    seq_q, seq_k = q.shape[2], k.shape[2]
    zero = torch.zeros((), dtype=torch.int64, device=q.device)
    # cum_seq_q/k undefined (None): dense, not variable-length, batches
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse.contiguous(), None, None, seq_q, seq_k, 0.0, causal, zero, zero, scale=scale
    )
    return dq, _reduce_kv_grad(dk, num_kv_heads), _reduce_kv_grad(dv, num_kv_heads)


REFERENCE = Kernel("reference", reference_forward, reference_backward)
CPU_FLASH = Kernel("cpu_flash", _cpu_forward, _cpu_backward)
CUDA_FLASH = Kernel("cuda_flash", _cuda_flash_forward, _cuda_flash_backward)
KERNELS = {k.name: k for k in (REFERENCE, CPU_FLASH, CUDA_FLASH)}


def select_kernel(device: torch.device, dtype: torch.dtype, head_dim: int) -> Kernel:
    """The fastest exact kernel for this device, dtype and head dim."""
    if device.type == "cpu" and dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        return CPU_FLASH
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and head_dim <= 256:
        return CUDA_FLASH
    return REFERENCE
