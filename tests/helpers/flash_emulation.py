"""CPU stand-ins for FlashAttention 3 (``flash_attn_interface``) and 4 (``flash_attn.cute.interface``), for testing
loongtrain/attn/flash_kernels.py without a GPU (docs/testing.md#the-cuda-emulation).

Each function has the real one's parameters (names, order, defaults: the flash-attention repository's
``hopper/flash_attn_interface.py`` and ``flash_attn/cute/interface.py``), so a call with a wrong keyword fails as it
would there; it checks its inputs as the library does (fp16/bf16, unit last stride, ``[B, S, H, D]`` or packed
``[T, H, D]`` with int32 ``cu_seqlens``, GQA, lse shapes) and computes in fp32 (fp64 with ``allow_fp64``) with the
window read as each library reads it (FA3: a bound at or past the length minus one is dropped; FA4: ``None`` is
unbounded; both: causal means a right bound of 0, bottom-right aligned). FA3's backward writes into the ``dq``,
``dk``, ``dv`` it is given and returns ``softmax_d``; FA4's returns ``(dq, dk, dv)``."""

from __future__ import annotations

import importlib.machinery
import sys
import types

import torch

from tests.helpers.emulation_math import math_dtype, to_bhsd, window_backward, window_forward

Tensor = torch.Tensor
_HALF = (torch.float16, torch.bfloat16)


class FlashEmulation:
    """Both libraries' entry points over plain math; ``calls`` records each call's function name."""

    def __init__(self, allow_fp64: bool = False) -> None:
        self.allow_fp64 = allow_fp64
        self.calls: list[str] = []

    # ------------------------------------------------ shared

    def _check(self, name: str, q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor | None, cu_k: Tensor | None) -> None:
        dtypes = (*_HALF, torch.float64) if self.allow_fp64 else _HALF
        assert q.dtype in dtypes, f"{name}: dtype {q.dtype}"
        for label, t in (("q", q), ("k", k), ("v", v)):
            assert t.stride(-1) == 1 and t.dtype == q.dtype, f"{name}: {label} last-dim stride or dtype"
            assert t.dim() == (3 if cu_q is not None else 4), f"{name}: {label} {tuple(t.shape)}"
        assert k.shape == v.shape and q.shape[-1] == k.shape[-1] and q.shape[-2] % k.shape[-2] == 0, name
        assert (cu_q is None) == (cu_k is None), f"{name}: cu_seqlens_q and cu_seqlens_k together"
        for cu, total in ((cu_q, q.shape[0]), (cu_k, k.shape[0])):
            if cu is not None:
                assert cu.dtype == torch.int32 and cu.dim() == 1 and int(cu[0]) == 0 and int(cu[-1]) == total, name

    @staticmethod
    def _sequences(q: Tensor, k: Tensor, cu_q: Tensor | None, cu_k: Tensor | None) -> list[tuple[slice, slice]]:
        if cu_q is None:
            sq, sk = q.shape[1], k.shape[1]
            return [(slice(b * sq, (b + 1) * sq), slice(b * sk, (b + 1) * sk)) for b in range(q.shape[0])]
        a, b = cu_q.tolist(), cu_k.tolist()
        return [(slice(x, y), slice(z, w)) for x, y, z, w in zip(a, a[1:], b, b[1:])]

    def _forward(self, q, k, v, cu_q, cu_k, scale, left, right) -> tuple[Tensor, Tensor]:
        packed = cu_q is not None
        qf, kf, vf = (t if packed else t.flatten(0, 1) for t in (q, k, v))
        scale = scale if scale is not None else q.shape[-1] ** -0.5
        out = torch.zeros(qf.shape, dtype=q.dtype)
        lse = torch.full((qf.shape[1], qf.shape[0]), float("inf"), dtype=math_dtype(q.dtype))
        for rows, cols in self._sequences(q, k, cu_q, cu_k):
            o, m = window_forward(to_bhsd(qf[rows]), to_bhsd(kf[cols]), to_bhsd(vf[cols]), scale, left, right)
            out[rows], lse[:, rows] = o[0].transpose(0, 1).to(q.dtype), m[0]
        if packed:
            return out, lse
        return out.view(q.shape), lse.view(lse.shape[0], q.shape[0], -1).transpose(0, 1).contiguous()

    def _backward(self, dout, q, k, v, out, lse, cu_q, cu_k, scale, left, right) -> tuple[Tensor, Tensor, Tensor]:
        packed = cu_q is not None
        want = (q.shape[1], q.shape[0]) if packed else (q.shape[0], q.shape[2], q.shape[1])
        assert tuple(lse.shape) == want and lse.dtype == math_dtype(q.dtype) and lse.is_contiguous(), "lse"
        for label, t in (("dout", dout), ("out", out)):
            assert t.shape == q.shape and t.dtype == q.dtype and t.stride(-1) == 1, label
        flat = [t if packed else t.flatten(0, 1) for t in (dout, q, k, v, out)]
        lse = lse if packed else lse.transpose(0, 1).flatten(1)
        scale = scale if scale is not None else q.shape[-1] ** -0.5
        grads = [torch.zeros(t.shape, dtype=math_dtype(q.dtype)) for t in flat[1:4]]
        for rows, cols in self._sequences(q, k, cu_q, cu_k):
            parts = window_backward(*(to_bhsd(t[s]) for t, s in zip(flat, (rows, rows, cols, cols, rows))),
                                    lse[None, :, rows], scale, left, right)
            for full, part, s in zip(grads, parts, (rows, cols, cols)):
                full[s] = part[0].transpose(0, 1)
        return tuple(g.to(q.dtype).view(t.shape) for g, t in zip(grads, (q, k, v)))

    @staticmethod
    def _lengths(q, k, cu_q, cu_k, max_q, max_k) -> tuple[int, int]:
        if cu_q is None:
            return q.shape[1], k.shape[1]
        assert max_q is not None and max_k is not None, "max_seqlen_q/k with cu_seqlens"
        return max_q, max_k

    # ------------------------------------------------ FA3 (flash_attn_interface)

    @staticmethod
    def _fa3_window(left: int, right: int, causal: bool, rows: int, cols: int) -> tuple[int, int]:
        left = -1 if left >= cols - 1 else left
        right = -1 if right >= rows - 1 else right
        return (left, 0) if causal else (left, right)

    def fa3_forward(self, q, k, v, k_new=None, v_new=None, qv=None, out_=None, cu_seqlens_q=None, cu_seqlens_k=None,
                    cu_seqlens_k_new=None, seqused_q=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None,
                    page_table=None, kv_batch_idx=None, leftpad_k=None, rotary_cos=None, rotary_sin=None,
                    seqlens_rotary=None, q_descale=None, k_descale=None, v_descale=None, softmax_scale=None,
                    causal=False, window_size_left=-1, window_size_right=-1, attention_chunk=0, softcap=0.0,
                    rotary_interleaved=True, scheduler_metadata=None, num_splits=1, pack_gqa=None, sm_margin=0):
        self.calls.append("fa3_forward")
        assert all(x is None for x in (k_new, v_new, qv, out_, cu_seqlens_k_new, seqused_q, seqused_k, page_table))
        self._check("fa3_forward", q, k, v, cu_seqlens_q, cu_seqlens_k)
        rows, cols = self._lengths(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        left, right = self._fa3_window(window_size_left, window_size_right, causal, rows, cols)
        out, lse = self._forward(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, left, right)
        return out, lse, torch.tensor([]), torch.tensor([])

    def fa3_backward(self, dout, q, k, v, out, softmax_lse, cu_seqlens_q=None, cu_seqlens_k=None, sequed_q=None,
                     sequed_k=None, max_seqlen_q=None, max_seqlen_k=None, dq=None, dk=None, dv=None,
                     softmax_scale=None, is_causal=False, window_size_left=-1, window_size_right=-1, softcap=0.0,
                     deterministic=False, sm_margin=0):
        self.calls.append("fa3_backward")
        self._check("fa3_backward", q, k, v, cu_seqlens_q, cu_seqlens_k)
        rows, cols = self._lengths(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
        left, right = self._fa3_window(window_size_left, window_size_right, is_causal, rows, cols)
        grads = self._backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, softmax_scale, left, right)
        for given, g in zip((dq, dk, dv), grads):
            assert given is not None and given.shape == g.shape and given.is_contiguous(), "dq, dk, dv are written"
            given.copy_(g)
        return torch.empty(0)  # softmax_d

    # ------------------------------------------------ FA4 (flash_attn.cute.interface)

    @staticmethod
    def _fa4_window(left: int | None, right: int | None, causal: bool) -> tuple[int, int]:
        for bound in (left, right):
            assert bound is None or (isinstance(bound, int) and bound >= 0), f"window bound {bound}"
        if causal:
            right = 0
        return (-1 if left is None else left), (-1 if right is None else right)

    def fa4_fwd(self, q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
                max_seqlen_q=None, max_seqlen_k=None, min_seqlen_k=None, page_table=None, softmax_scale=None,
                causal=False, softcap=None, window_size_left=None, window_size_right=None, learnable_sink=None,
                tile_mn=None, mma_pv_is_rs=None, intra_wg_overlap=None, num_threads=384, num_splits=1, pack_gqa=None,
                _arch=None, score_mod=None, mask_mod=None, block_sparse_tensors=None, return_lse=False, out=None,
                lse=None, aux_tensors=None, aux_scalars=None, q_descale=None, k_descale=None, v_descale=None,
                gather_kv_indices=None, scheduler_metadata=None, seqlen_k_per_split=None,
                disable_scheduler_metadata=False):
        self.calls.append("fa4_fwd")
        assert qv is None and learnable_sink is None and out is None and lse is None and page_table is None
        self._check("fa4_fwd", q, k, v, cu_seqlens_q, cu_seqlens_k)
        left, right = self._fa4_window(window_size_left, window_size_right, causal)
        o, m = self._forward(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, left, right)
        return o, (m if return_lse else None), None, None

    def fa4_bwd(self, q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0, window_size_left=None,
                window_size_right=None, m_block_size=64, n_block_size=128, num_threads=256, pack_gqa=False,
                num_stages_Q=2, num_stages_dO=2, SdP_swapAB=False, dKV_swapAB=False, dQ_swapAB=False,  # noqa: N803
                AtomLayoutMSdP=2, AtomLayoutNdKV=2, AtomLayoutMdQ=2, V_in_regs=False,  # noqa: N803
                cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None, max_seqlen_q=None,
                max_seqlen_k=None, deterministic=False, dq=None, dk=None, dv=None, score_mod=None,
                score_mod_bwd=None, mask_mod=None, aux_tensors=None, aux_scalars=None, block_sparse_tensors=None,
                dlse=None, learnable_sink=None):
        self.calls.append("fa4_bwd")
        self._check("fa4_bwd", q, k, v, cu_seqlens_q, cu_seqlens_k)
        left, right = self._fa4_window(window_size_left, window_size_right, causal)
        return self._backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, softmax_scale, left, right)


def _module(name: str, **functions) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    module.__dict__.update(functions)
    return module


def install_flash(monkeypatch, which: tuple[str, ...] = ("cuda_fa3", "cuda_fa4"), allow_fp64: bool = False
                  ) -> FlashEmulation:
    """Make the modules of ``which`` (``cuda_fa3``, ``cuda_fa4``) importable for the rest of the test, backed by one
    :class:`FlashEmulation` (``monkeypatch``: pytest's fixture)."""
    emulation = FlashEmulation(allow_fp64)
    if "cuda_fa3" in which:
        monkeypatch.setitem(sys.modules, "flash_attn_interface", _module(
            "flash_attn_interface", _flash_attn_forward=emulation.fa3_forward,
            _flash_attn_backward=emulation.fa3_backward))
    if "cuda_fa4" in which:
        for name in ("flash_attn", "flash_attn.cute"):
            monkeypatch.setitem(sys.modules, name, _module(name))
        monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", _module(
            "flash_attn.cute.interface", _flash_attn_fwd=emulation.fa4_fwd, _flash_attn_bwd=emulation.fa4_bwd))
    return emulation
