"""FlashAttention 3 and 4 as ring kernels where they are installed (docs/attention.md#kernels).

- ``cuda_fa3``: FA3, the Hopper build of the flash-attention repository (module ``flash_attn_interface``):
  ``_flash_attn_forward(q, k, v, ..., softmax_scale, causal, window_size_left, window_size_right, ...) -> (out,
  softmax_lse, out_accum, lse_accum)`` and ``_flash_attn_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q,
  cu_seqlens_k, ..., dq, dk, dv, softmax_scale, is_causal, window_size_left, window_size_right, softcap,
  deterministic, sm_margin)``, which writes into the ``dq``/``dk``/``dv`` it is given;
- ``cuda_fa4``: FA4, ``flash-attn-4`` (the CuTe DSL build, module ``flash_attn.cute.interface``):
  ``_flash_attn_fwd(q, k, v, ..., cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
  window_size_left, window_size_right, ..., return_lse) -> (out, lse, ...)`` and ``_flash_attn_bwd(q, k, v, out,
  dout, lse, softmax_scale, causal, softcap, window_size_left, window_size_right, ..., cu_seqlens_q, cu_seqlens_k,
  ..., max_seqlen_q, max_seqlen_k, deterministic, ...) -> (dq, dk, dv)`` (a window bound ``None``: unbounded).

Both take ``[B, S, H, D]`` (dense) or packed ``[T, H, D]`` (varlen, int32 ``cu_seqlens``) tensors with a unit last
stride, fewer KV heads natively (GQA), and give lse fp32 ``[B, H, S]`` / ``[H, T]``: the ring's ``[B, H, S, D]``
views of ``[B, S, H, D]`` storage go in as their ``[B, S, H, D]`` transposes, no copy. Causal masks and windows are
aligned bottom-right, as FA2's (``Kernel.varlen_bottom_right``, ``Kernel.windowed``). Arguments are passed by
name. Neither is ever the rule's kernel: each is probed in a subprocess and taken only where it measured faster
(:mod:`loongtrain.attn.kernel_choice`). Without a GPU they are tested through an emulation of these signatures
(tests/helpers/flash_emulation.py)."""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

import torch

from loongtrain.attn.kernels import Kernel, Seqlens, Tensor, VarlenMask, dense_layout

#: kernel name -> the module that provides it
MODULES = {"cuda_fa3": "flash_attn_interface", "cuda_fa4": "flash_attn.cute.interface"}


def installed(name: str) -> bool:
    """Whether ``name``'s module (:data:`MODULES`) can be imported here (looked up, not imported)."""
    try:
        return importlib.util.find_spec(MODULES[name]) is not None
    except (ImportError, ValueError):  # a parent package that is missing or cannot load
        return False


def _module(name: str) -> ModuleType:
    return importlib.import_module(MODULES[name])


def _bshd(*xs: Tensor) -> list[Tensor]:
    return [x.transpose(1, 2) for x in xs]


def _bounds(window: tuple[int, int] | None, unbounded: int | None) -> dict:
    """``window_size_left`` / ``window_size_right``; a ``-1`` (FA2's "unbounded") becomes ``unbounded``."""
    left, right = window or (-1, -1)
    return {"window_size_left": unbounded if left < 0 else left,
            "window_size_right": unbounded if right < 0 else right}


def _seqlens(seqlens: Seqlens) -> dict:
    """The packed sequences as both interfaces name them (``cu_seqlens_q``, ..., ``max_seqlen_k``)."""
    return {"cu_seqlens_q": seqlens.cu_q, "cu_seqlens_k": seqlens.cu_k, "max_seqlen_q": seqlens.max_q,
            "max_seqlen_k": seqlens.max_k}


def _deterministic() -> bool:
    return torch.are_deterministic_algorithms_enabled()


# ---------------------------------------------------------------- FA3 (Hopper)


def _fa3_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float,
                 window: tuple[int, int] | None = None) -> tuple[Tensor, Tensor]:
    out, lse, *_ = _module("cuda_fa3")._flash_attn_forward(*_bshd(q, k, v), softmax_scale=scale, causal=causal,
                                                           **_bounds(window, -1))
    return out.transpose(1, 2), lse


def _fa3_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                  scale: float, window: tuple[int, int] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    dout_, q_, k_, v_, out_ = _bshd(dout, q, k, v, out)
    grads = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q_, k_, v_)]
    _module("cuda_fa3")._flash_attn_backward(
        dout_, q_, k_, v_, out_, dense_layout(lse), dq=grads[0], dk=grads[1], dv=grads[2], softmax_scale=scale,
        is_causal=causal, deterministic=_deterministic(), **_bounds(window, -1))
    return tuple(g.transpose(1, 2) for g in grads)


def _fa3_varlen_forward(q: Tensor, k: Tensor, v: Tensor, seqlens: Seqlens,
                        mask: VarlenMask) -> tuple[Tensor, Tensor]:
    out, lse, *_ = _module("cuda_fa3")._flash_attn_forward(
        q, k, v, **_seqlens(seqlens), softmax_scale=mask.scale, causal=mask.causal, **_bounds(mask.window, -1))
    return out, lse


def _fa3_varlen_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, seqlens: Seqlens,
                         mask: VarlenMask) -> tuple[Tensor, Tensor, Tensor]:
    grads = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v)]
    _module("cuda_fa3")._flash_attn_backward(
        dout, q, k, v, out, dense_layout(lse), **_seqlens(seqlens), dq=grads[0], dk=grads[1], dv=grads[2],
        softmax_scale=mask.scale, is_causal=mask.causal, deterministic=_deterministic(), **_bounds(mask.window, -1))
    return tuple(grads)


# ---------------------------------------------------------------- FA4 (CuTe DSL: Hopper, Blackwell)


def _fa4_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float,
                 window: tuple[int, int] | None = None) -> tuple[Tensor, Tensor]:
    out, lse, *_ = _module("cuda_fa4")._flash_attn_fwd(*_bshd(q, k, v), softmax_scale=scale, causal=causal,
                                                       return_lse=True, **_bounds(window, None))
    return out.transpose(1, 2), lse


def _fa4_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                  scale: float, window: tuple[int, int] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    q_, k_, v_, out_, dout_ = _bshd(q, k, v, out, dout)
    grads = _module("cuda_fa4")._flash_attn_bwd(q_, k_, v_, out_, dout_, dense_layout(lse), softmax_scale=scale,
                                                causal=causal, deterministic=_deterministic(),
                                                **_bounds(window, None))
    return tuple(g.transpose(1, 2) for g in grads[:3])


def _fa4_varlen_forward(q: Tensor, k: Tensor, v: Tensor, seqlens: Seqlens,
                        mask: VarlenMask) -> tuple[Tensor, Tensor]:
    out, lse, *_ = _module("cuda_fa4")._flash_attn_fwd(
        q, k, v, **_seqlens(seqlens), softmax_scale=mask.scale, causal=mask.causal, return_lse=True,
        **_bounds(mask.window, None))
    return out, lse


def _fa4_varlen_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, seqlens: Seqlens,
                         mask: VarlenMask) -> tuple[Tensor, Tensor, Tensor]:
    grads = _module("cuda_fa4")._flash_attn_bwd(
        q, k, v, out, dout, dense_layout(lse), softmax_scale=mask.scale, causal=mask.causal, **_seqlens(seqlens),
        deterministic=_deterministic(), **_bounds(mask.window, None))
    return tuple(grads[:3])


CUDA_FA3 = Kernel("cuda_fa3", _fa3_forward, _fa3_backward, _fa3_varlen_forward, _fa3_varlen_backward, windowed=True)
CUDA_FA4 = Kernel("cuda_fa4", _fa4_forward, _fa4_backward, _fa4_varlen_forward, _fa4_varlen_backward, windowed=True)
FLASH_KERNELS = (CUDA_FA3, CUDA_FA4)


def fa3_ok(sm: tuple[int, int], dtype: torch.dtype, head_dim: int) -> bool:
    """FA3's rule: Hopper (sm90), fp16/bf16, head dim a multiple of 8 up to 256, installed."""
    return (sm[0] == 9 and dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0 and head_dim <= 256
            and installed("cuda_fa3"))


def fa4_ok(sm: tuple[int, int], dtype: torch.dtype, head_dim: int) -> bool:
    """FA4's rule: Hopper (head dim up to 256) or Blackwell sm100/sm110 (up to 128, or 256), fp16/bf16, head dim a
    multiple of 8, installed."""
    if dtype not in (torch.float16, torch.bfloat16) or head_dim % 8 or not installed("cuda_fa4"):
        return False
    if sm[0] == 9:
        return head_dim <= 256
    return sm[0] in (10, 11) and (head_dim <= 128 or head_dim == 256)
