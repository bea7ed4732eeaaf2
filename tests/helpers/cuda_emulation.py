"""A CPU emulation of torch 2.13's CUDA attention ops, for testing the wrappers in
``loongtrain.attn.cuda_kernels`` without a GPU (docs/testing.md).

Every call is bound against the real op's schema (``torch.ops.aten.<op>.default._schema``: argument
count, order, keyword-only arguments, argument kinds), then checked the way the CUDA op checks its
inputs, then computed with plain math in the op's own layout conventions:

- flash (FA2): fp16/bf16, unit last-dim stride, head dim a multiple of 8 and <= 256, KV heads dividing
  the query heads (GQA native), causal mask aligned bottom-right; lse ``[B, H, S]`` fp32, which the
  backward reads as a contiguous buffer whatever strides the tensor has; rng state uint64 ``[2]``;
- memory-efficient: fp16/bf16/fp32, equal head counts (its backward allocates dK/dV with the query's
  head count), causal top-left; lse fp32 ``[B, H, ceil(S/32)*32]`` with ``+inf`` padding, which the
  backward requires back in that layout; seed/offset int64 scalars;
- cuDNN: fp16/bf16, GQA native, head dim a multiple of 8 and <= 128; lse ``[B, H, S, 1]``; the
  backward requires dO in O's strides;
- flash varlen (``_flash_attention_forward/attn_backward`` with ``cum_seq_q/k``; FA2's ``mha_varlen_fwd/bwd``):
  packed q ``[Tq, H, D]``, k/v ``[Tk, Hkv, D]``, ``cum_seq_*`` int32 contiguous ``[n + 1]`` from 0 to the
  row count, ``max_q/max_k`` at least every sequence's length; sequence ``i`` attends alone, causal
  aligned bottom-right (a query row that sees no key: out 0, lse ``+inf``); lse fp32 ``[H, Tq]``, which the
  backward reads as a dense buffer (it makes dO and O contiguous itself);
- cuDNN ragged (``_cudnn_attention_forward/_backward`` with ``cum_seq_q/k``, the op behind nested jagged
  tensors): the same packed layout and ``cum_seq_*`` rules, GQA native, head dim a multiple of 8 and <= 128,
  causal aligned top-left per sequence; lse fp32 ``[Tq, H, 1]``; the backward requires dO in O's strides.

Outputs have the layouts the CUDA ops give (``[B, S, H, D]`` storage seen as ``[B, H, S, D]``).
``allow_fp64`` admits fp64 inputs (with an fp64 lse), which the real ops reject, so that the wrappers'
plumbing can be checked at fp64 precision; ``fault`` plants one named bug so tests can show that the checks catch it.
"""

from __future__ import annotations

import math

import torch

from tests.helpers.emulation_math import (
    attn_backward,
    attn_forward,
    bind,
    fa2_window,
    like_op,
    lse_dtype,
    math_dtype,
    to_bhsd,
    to_bshd,
    window_backward,
    window_forward,
)

Tensor = torch.Tensor

FAULTS = (
    "efficient_lse_padding_in_front",  # the forward puts the lse padding before the rows
    "flash_lse_sequence_major",  # the forward writes lse in [B, S, H] order into a [B, H, S] tensor
    "flash_backward_reads_value_as_key",  # the backward binds key and value in swapped order
    "varlen_lse_token_major",  # the varlen forward writes lse in [Tq, H] order into the [H, Tq] tensor
    "varlen_cum_seq_swapped",  # cum_seq_q and cum_seq_k arrive swapped (as a wrapper passing them wrongly)
    "varlen_cudnn_lse_head_major",  # cuDNN's ragged forward writes lse in [H, Tq] order into its [Tq, H, 1]
)
VARLEN_FAULTS = tuple(f for f in FAULTS if f.startswith("varlen"))
_HALF = (torch.float16, torch.bfloat16)




# ---------------------------------------------------------------- the ops


class EmulatedAten:
    """Stands in for ``torch.ops.aten`` in ``loongtrain.attn.cuda_kernels`` (other ops pass through)."""

    def __init__(self, allow_fp64: bool = True, fault: str | None = None):
        assert fault is None or fault in FAULTS, fault
        self.allow_fp64, self.fault = allow_fp64, fault
        self.calls: list[str] = []

    def __getattr__(self, name: str):
        return getattr(torch.ops.aten, name)

    # ------------------------------------------------ shared checks

    def _bind(self, op: str, args: tuple, kwargs: dict) -> dict:
        """The call bound to ``op``'s schema (:func:`~tests.helpers.emulation_math.bind`), recorded in ``calls``."""
        bound = bind(op, args, kwargs)
        self.calls.append(op)
        return bound

    def _dtypes(self, dtypes: tuple[torch.dtype, ...]) -> tuple[torch.dtype, ...]:
        return (*dtypes, torch.float64) if self.allow_fp64 else dtypes

    def _check_qkv(self, op: str, q: Tensor, k: Tensor, v: Tensor, dtypes, gqa: bool) -> None:
        for name, t in (("query", q), ("key", k), ("value", v)):
            assert t.dim() == 4, f"{op}: {name} must be 4-D"
            assert t.dtype == q.dtype, f"{op}: {name} dtype {t.dtype} != query dtype {q.dtype}"
            assert t.device == q.device, f"{op}: {name} on another device"
            assert t.stride(-1) == 1, f"{op}: {name} must have contiguous last dimension"
        assert q.dtype in self._dtypes(dtypes), f"{op}: dtype {q.dtype} not supported"
        assert k.shape == v.shape, f"{op}: key {tuple(k.shape)} and value {tuple(v.shape)} differ"
        assert q.shape[0] == k.shape[0] and q.shape[3] == k.shape[3], f"{op}: batch or head dim differ"
        if gqa:
            assert q.shape[1] % k.shape[1] == 0, f"{op}: {q.shape[1]} heads not a multiple of {k.shape[1]}"
        else:
            assert q.shape[1] == k.shape[1], f"{op}: needs equal head counts, got {q.shape[1]} and {k.shape[1]}"

    @staticmethod
    def _check_like(op: str, name: str, t: Tensor, ref: Tensor) -> None:
        assert t.shape == ref.shape and t.dtype == ref.dtype, f"{op}: {name} {tuple(t.shape)} {t.dtype}"
        assert t.stride(-1) == 1, f"{op}: {name} must have contiguous last dimension"

    @staticmethod
    def _check_lse(op: str, lse: Tensor, shape: tuple[int, ...], q: Tensor) -> None:
        want = lse_dtype(q.dtype)
        assert lse.dtype == want, f"{op}: logsumexp must be {want}, got {lse.dtype}"
        assert tuple(lse.shape) == shape, f"{op}: logsumexp {tuple(lse.shape)}, expected {shape}"

    # ------------------------------------------------ flash (FA2)

    def _scaled_dot_product_flash_attention(self, *args, **kwargs):
        op = "_scaled_dot_product_flash_attention"
        a = self._bind(op, args, kwargs)
        q, k, v = a["query"], a["key"], a["value"]
        self._check_qkv(op, q, k, v, _HALF, gqa=True)
        assert q.shape[3] % 8 == 0 and q.shape[3] <= 256, f"{op}: head dim {q.shape[3]}"
        assert a["dropout_p"] == 0.0 and not a["return_debug_mask"], f"{op}: emulation has no dropout"
        scale = _scale(a, q.shape[-1])
        out, lse = attn_forward(q, k, v, a["is_causal"], scale, bottom_right=True)
        b, h, s = lse.shape
        if self.fault == "flash_lse_sequence_major":
            lse = lse.transpose(1, 2).contiguous().view(b, h, s)
        rng_state = torch.zeros(2, dtype=torch.uint64)
        unused = torch.zeros((), dtype=torch.uint64)
        return (to_bshd(out, q.dtype), lse.contiguous(), None, None, q.shape[2], k.shape[2],
                rng_state, unused, torch.empty(0, dtype=q.dtype))

    def _scaled_dot_product_flash_attention_backward(self, *args, **kwargs):
        op = "_scaled_dot_product_flash_attention_backward"
        a = self._bind(op, args, kwargs)
        q, k, v = a["query"], a["key"], a["value"]
        if self.fault == "flash_backward_reads_value_as_key":
            k, v = v, k
        self._check_qkv(op, q, k, v, _HALF, gqa=True)
        for name in ("grad_out", "out"):
            self._check_like(op, name, a[name], q)
        lse = a["logsumexp"]
        b, h, s = q.shape[:3]
        self._check_lse(op, lse, (b, h, s), q)
        lse = lse.as_strided((b, h, s), (h * s, s, 1), lse.storage_offset())  # read as a dense buffer
        assert a["cum_seq_q"] is None and a["cum_seq_k"] is None, f"{op}: emulation is dense only"
        assert (a["max_q"], a["max_k"]) == (q.shape[2], k.shape[2]), f"{op}: max_q/max_k"
        assert a["philox_seed"].dtype == torch.uint64 and a["philox_seed"].shape == (2,), f"{op}: rng state"
        assert a["dropout_p"] == 0.0, f"{op}: emulation has no dropout"
        scale = _scale(a, q.shape[-1])
        dq, dk, dv = attn_backward(a["grad_out"], q, k, v, a["out"], lse, a["is_causal"], scale, bottom_right=True)
        return to_bshd(dq, q.dtype), to_bshd(dk, k.dtype), to_bshd(dv, v.dtype)

    # ------------------------------------------------ flash (FA2), variable length

    def _check_varlen(self, op: str, a: dict, max_head_dim: int = 256) -> tuple[list[int], list[int]]:
        """The packed-layout rules of ``mha_varlen_fwd/bwd`` (and cuDNN's ragged layout); returns the sequence
        bounds (q, k)."""
        q, k, v = a["query"], a["key"], a["value"]
        if self.fault == "varlen_cum_seq_swapped":
            a["cum_seq_q"], a["cum_seq_k"] = a["cum_seq_k"], a["cum_seq_q"]
        for name, t in (("query", q), ("key", k), ("value", v)):
            assert t.dim() == 3, f"{op}: varlen {name} must be [total, heads, head_dim]"
            assert t.dtype == q.dtype and t.stride(-1) == 1, f"{op}: {name} dtype or last-dim stride"
        assert q.dtype in self._dtypes(_HALF), f"{op}: dtype {q.dtype} not supported"
        assert k.shape == v.shape and q.shape[2] == k.shape[2], f"{op}: key/value/head dim shapes"
        assert q.shape[1] % k.shape[1] == 0, f"{op}: {q.shape[1]} heads not a multiple of {k.shape[1]}"
        assert q.shape[2] % 8 == 0 and q.shape[2] <= max_head_dim, f"{op}: head dim {q.shape[2]}"
        assert a["dropout_p"] == 0.0, f"{op}: emulation has no dropout"
        bounds = []
        for name, total, longest in (("cum_seq_q", q.shape[0], a["max_q"]), ("cum_seq_k", k.shape[0], a["max_k"])):
            cu = a[name]
            assert cu is not None, f"{op}: emulation is varlen only ({name} missing)"
            assert cu.dtype == torch.int32 and cu.dim() == 1 and cu.is_contiguous(), f"{op}: {name} int32 contiguous"
            cu = cu.tolist()
            assert len(cu) >= 2, f"{op}: {name} needs at least one sequence"
            lengths = [e - s for s, e in zip(cu, cu[1:])]
            assert cu[0] == 0 and min(lengths) >= 0, f"{op}: {name} must start at 0 and not decrease"
            assert cu[-1] == total, f"{op}: {name} ends at {cu[-1]}, rows {total} (rows past it are not written)"
            assert longest >= max(lengths), f"{op}: max length {longest} < a sequence of {max(lengths)}"
            bounds.append(cu)
        assert len(bounds[0]) == len(bounds[1]) >= 2, f"{op}: cum_seq_q and cum_seq_k sizes differ"
        return bounds[0], bounds[1]

    @staticmethod
    def _sequences(cu_q: list[int], cu_k: list[int]):
        return [(slice(a, b), slice(c, d)) for a, b, c, d in zip(cu_q, cu_q[1:], cu_k, cu_k[1:])]

    def _flash_dense_or_varlen(self, op: str, a: dict) -> tuple[list[tuple[slice, slice]], int, int, bool]:
        """The sequences of a ``_flash_attention_*`` call: ``[(query rows, key rows)]`` of the packed tensors (a dense
        call's ``[B, S, H, D]`` batch rows are packed as sequences of ``S``), the lengths FA2 reads its window
        against (the longest), and whether it is packed (``cum_seq_q`` given)."""
        if a["cum_seq_q"] is not None:
            cu_q, cu_k = self._check_varlen(op, a)
            return self._sequences(cu_q, cu_k), a["max_q"], a["max_k"], True
        assert a["cum_seq_k"] is None, f"{op}: cum_seq_k without cum_seq_q"
        q, k, v = a["query"], a["key"], a["value"]
        self._check_qkv(op, *(t.transpose(1, 2) for t in (q, k, v)), _HALF, gqa=True)  # [B, S, H, D] as given
        assert q.shape[3] % 8 == 0 and q.shape[3] <= 256, f"{op}: head dim {q.shape[3]}"
        assert a["dropout_p"] == 0.0, f"{op}: emulation has no dropout"
        assert (a["max_q"], a["max_k"]) == (q.shape[1], k.shape[1]), f"{op}: max_q/max_k"
        sq, sk = q.shape[1], k.shape[1]
        return [(slice(i * sq, (i + 1) * sq), slice(i * sk, (i + 1) * sk)) for i in range(q.shape[0])], sq, sk, False

    def _fa2_window(self, a: dict, rows: int, cols: int) -> tuple[int, int]:
        for name in ("window_size_left", "window_size_right"):
            assert a[name] is None or (isinstance(a[name], int) and a[name] >= -1), f"{name}={a[name]}"
        return fa2_window(a["window_size_left"], a["window_size_right"], a["is_causal"], rows, cols)

    def _flash_attention_forward(self, *args, **kwargs):
        op = "_flash_attention_forward"
        a = self._bind(op, args, kwargs)
        seqs, rows, cols, packed = self._flash_dense_or_varlen(op, a)
        assert not a["return_debug_mask"] and a["seqused_k"] is None and a["alibi_slopes"] is None, op
        assert a["block_table"] is None and a["num_splits"] is None, f"{op}: emulation has no paged or split KV"
        left, right = self._fa2_window(a, rows, cols)
        q, k, v = (a[n] if packed else a[n].flatten(0, 1) for n in ("query", "key", "value"))
        scale = _scale(a, q.shape[-1])
        out = torch.zeros(q.shape, dtype=q.dtype)
        lse = torch.full((q.shape[1], q.shape[0]), float("inf"), dtype=lse_dtype(q.dtype))
        for rows_, cols_ in seqs:
            o, m = window_forward(*(to_bhsd(t[s]) for t, s in ((q, rows_), (k, cols_), (v, cols_))), scale, left, right)
            out[rows_] = o[0].transpose(0, 1).to(q.dtype)
            lse[:, rows_] = m[0]
        if self.fault == "varlen_lse_token_major":
            lse = lse.t().contiguous().view(lse.shape)
        if not packed:  # [B, S, H, D] out, [B, H, S] lse
            b = a["query"].shape[0]
            out, lse = out.view(a["query"].shape), lse.view(lse.shape[0], b, -1).transpose(0, 1).contiguous()
        rng_state, unused = torch.zeros(2, dtype=torch.uint64), torch.zeros((), dtype=torch.uint64)
        return out, lse, rng_state, unused, torch.empty(0, dtype=q.dtype)

    def _flash_attention_backward(self, *args, **kwargs):
        op = "_flash_attention_backward"
        a = self._bind(op, args, kwargs)
        seqs, rows, cols, packed = self._flash_dense_or_varlen(op, a)
        left, right = self._fa2_window(a, rows, cols)
        q, k, v, dout, out = (a[n] if packed else a[n].flatten(0, 1)
                              for n in ("query", "key", "value", "grad_out", "out"))
        for name, t in (("grad_out", dout), ("out", out)):
            assert t.shape == q.shape and t.dtype == q.dtype, f"{op}: {name}"
        lse = a["logsumexp"]
        if packed:
            self._check_lse(op, lse, (q.shape[1], q.shape[0]), q)
            lse = lse.as_strided(lse.shape, (q.shape[0], 1), lse.storage_offset())  # read as a dense buffer
        else:
            b, s = a["query"].shape[:2]
            self._check_lse(op, lse, (b, q.shape[1], s), q)
            lse = lse.as_strided(lse.shape, (q.shape[1] * s, s, 1), lse.storage_offset()).transpose(0, 1).flatten(1)
        assert a["rng_state"].dtype == torch.uint64 and a["rng_state"].shape == (2,), f"{op}: rng state"
        scale = _scale(a, q.shape[-1])
        dq, dk, dv = (torch.zeros(t.shape, dtype=math_dtype(q.dtype)) for t in (q, k, v))
        for rows_, cols_ in seqs:
            grads = window_backward(to_bhsd(dout[rows_]), to_bhsd(q[rows_]), to_bhsd(k[cols_]), to_bhsd(v[cols_]),
                                    to_bhsd(out[rows_]), lse[None, :, rows_], scale, left, right)
            for full, part, s in zip((dq, dk, dv), grads, (rows_, cols_, cols_)):
                full[s] = part[0].transpose(0, 1)
        grads = (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype))
        return grads if packed else tuple(g.view(a[n].shape) for g, n in zip(grads, ("query", "key", "value")))

    # ------------------------------------------------ cuDNN, ragged (variable length)

    def _cudnn_attention_forward(self, *args, **kwargs):
        op = "_cudnn_attention_forward"
        a = self._bind(op, args, kwargs)
        cu_q, cu_k = self._check_varlen(op, a, max_head_dim=128)
        assert a["attn_bias"] is None and a["compute_log_sumexp"], f"{op}: no bias; training needs the logsumexp"
        assert not a["return_debug_mask"], f"{op}: emulation has no debug mask"
        q, k, v = a["query"], a["key"], a["value"]
        scale = _scale(a, q.shape[-1])
        out = torch.zeros(q.shape, dtype=q.dtype)
        lse = torch.zeros((q.shape[0], q.shape[1]), dtype=lse_dtype(q.dtype))
        for rows, cols in self._sequences(cu_q, cu_k):
            o, m = attn_forward(*(to_bhsd(t[s]) for t, s in ((q, rows), (k, cols), (v, cols))), a["is_causal"], scale,
                                bottom_right=False)
            out[rows] = o[0].transpose(0, 1).to(q.dtype)
            lse[rows] = m[0].t()
        if self.fault == "varlen_cudnn_lse_head_major":
            lse = lse.t().contiguous().view(lse.shape)
        seed, offset = torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)
        return (out, lse.unsqueeze(-1).contiguous(), a["cum_seq_q"], a["cum_seq_k"], a["max_q"], a["max_k"], seed,
                offset, None)

    def _cudnn_attention_backward(self, *args, **kwargs):
        op = "_cudnn_attention_backward"
        a = self._bind(op, args, kwargs)
        cu_q, cu_k = self._check_varlen(op, a, max_head_dim=128)
        q, k, v = a["query"], a["key"], a["value"]
        for name in ("grad_out", "out"):
            assert a[name].shape == q.shape and a[name].dtype == q.dtype, f"{op}: {name}"
        assert a["grad_out"].stride() == a["out"].stride(), f"{op}: dO must have O's strides"
        assert a["attn_bias"] is None, f"{op}: emulation has no bias"
        lse = a["logsumexp"]
        self._check_lse(op, lse, (q.shape[0], q.shape[1], 1), q)
        assert lse.is_contiguous(), f"{op}: logsumexp must be the forward's contiguous [Tq, H, 1]"
        scale = _scale(a, q.shape[-1])
        dq, dk, dv = (torch.zeros(t.shape, dtype=math_dtype(q.dtype)) for t in (q, k, v))
        for rows, cols in self._sequences(cu_q, cu_k):
            grads = attn_backward(to_bhsd(a["grad_out"][rows]), to_bhsd(q[rows]), to_bhsd(k[cols]), to_bhsd(v[cols]),
                                  to_bhsd(a["out"][rows]), lse[rows, :, 0].t()[None], a["is_causal"], scale,
                                  bottom_right=False)
            for full, part, s in zip((dq, dk, dv), grads, (rows, cols, cols)):
                full[s] = part[0].transpose(0, 1)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)

    # ------------------------------------------------ memory-efficient

    def _scaled_dot_product_efficient_attention(self, *args, **kwargs):
        op = "_scaled_dot_product_efficient_attention"
        a = self._bind(op, args, kwargs)
        q, k, v = a["query"], a["key"], a["value"]
        self._check_qkv(op, q, k, v, (*_HALF, torch.float32), gqa=False)
        assert a["attn_bias"] is None and a["dropout_p"] == 0.0, f"{op}: emulation has no bias or dropout"
        scale = _scale(a, q.shape[-1])
        out, lse = attn_forward(q, k, v, a["is_causal"], scale, bottom_right=False)
        b, h, s = lse.shape
        padded_len = math.ceil(s / 32) * 32 if a["compute_log_sumexp"] else 0
        padded = torch.full((b, h, padded_len), float("inf"), dtype=lse.dtype)
        if padded_len:
            rows = slice(padded_len - s, None) if self.fault == "efficient_lse_padding_in_front" else slice(0, s)
            padded[:, :, rows] = lse
        seed, offset = torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)
        return to_bshd(out, q.dtype), padded, seed, offset

    def _scaled_dot_product_efficient_attention_backward(self, *args, **kwargs):
        op = "_scaled_dot_product_efficient_attention_backward"
        a = self._bind(op, args, kwargs)
        q, k, v = a["query"], a["key"], a["value"]
        self._check_qkv(op, q, k, v, (*_HALF, torch.float32), gqa=False)
        self._check_like(op, "grad_out_", a["grad_out_"], q)
        self._check_like(op, "out", a["out"], q)
        b, h, s = q.shape[:3]
        lse = a["logsumexp"]
        self._check_lse(op, lse, (b, h, math.ceil(s / 32) * 32), q)
        assert lse.stride(-1) == 1, f"{op}: logsumexp must have contiguous last dimension"
        lse = lse[:, :, lse.shape[2] - s:] if self.fault == "efficient_lse_padding_in_front" else lse[:, :, :s]
        mask = list(a["grad_input_mask"])
        assert len(mask) == 4 and mask[:3] == [True] * 3, f"{op}: grad_input_mask {mask}"
        assert a["attn_bias"] is None and not mask[3], f"{op}: emulation has no bias"
        assert a["dropout_p"] == 0.0, f"{op}: emulation has no dropout"
        scale = _scale(a, q.shape[-1])
        dq, dk, dv = attn_backward(a["grad_out_"], q, k, v, a["out"], lse, a["is_causal"], scale, bottom_right=False)
        return to_bshd(dq, q.dtype), to_bshd(dk, k.dtype), to_bshd(dv, v.dtype), None

    # ------------------------------------------------ cuDNN

    def _scaled_dot_product_cudnn_attention(self, *args, **kwargs):
        op = "_scaled_dot_product_cudnn_attention"
        a = self._bind(op, args, kwargs)
        q, k, v = a["query"], a["key"], a["value"]
        self._check_qkv(op, q, k, v, _HALF, gqa=True)
        assert q.shape[3] % 8 == 0 and q.shape[3] <= 128, f"{op}: head dim {q.shape[3]}"
        assert a["attn_bias"] is None and a["dropout_p"] == 0.0, f"{op}: emulation has no bias or dropout"
        assert a["compute_log_sumexp"], f"{op}: training needs the logsumexp"
        scale = _scale(a, q.shape[-1])
        out, lse = attn_forward(q, k, v, a["is_causal"], scale, bottom_right=False)
        seed, offset = torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)
        return (like_op(out, q), lse.unsqueeze(-1).contiguous(), None, None, q.shape[2], k.shape[2],
                seed, offset, None)

    def _scaled_dot_product_cudnn_attention_backward(self, *args, **kwargs):
        op = "_scaled_dot_product_cudnn_attention_backward"
        a = self._bind(op, args, kwargs)
        q, k, v = a["query"], a["key"], a["value"]
        self._check_qkv(op, q, k, v, _HALF, gqa=True)
        self._check_like(op, "grad_out", a["grad_out"], q)
        self._check_like(op, "out", a["out"], q)
        assert a["grad_out"].stride() == a["out"].stride(), f"{op}: dO must have O's strides"
        b, h, s = q.shape[:3]
        self._check_lse(op, a["logsumexp"], (b, h, s, 1), q)
        assert a["attn_bias"] is None and a["cum_seq_q"] is None and a["cum_seq_k"] is None, f"{op}: dense only"
        assert (a["max_q"], a["max_k"]) == (q.shape[2], k.shape[2]), f"{op}: max_q/max_k"
        assert a["dropout_p"] == 0.0, f"{op}: emulation has no dropout"
        scale = _scale(a, q.shape[-1])
        lse = a["logsumexp"].squeeze(-1)
        dq, dk, dv = attn_backward(a["grad_out"], q, k, v, a["out"], lse, a["is_causal"], scale, bottom_right=False)
        return like_op(dq, q), like_op(dk, k), like_op(dv, v)


def _scale(a: dict, head_dim: int) -> float:
    """The call's ``scale``, or the ops' default ``1/sqrt(head_dim)``."""
    return a["scale"] if a["scale"] is not None else head_dim ** -0.5


def install(monkeypatch, **options) -> EmulatedAten:
    """Make ``loongtrain.attn.cuda_kernels``' CUDA wrappers call an :class:`EmulatedAten` for the rest of the
    test (``monkeypatch``: pytest's fixture); any kernel or ring code path then runs them on CPU tensors."""
    from loongtrain.attn import cuda_kernels

    ops = EmulatedAten(**options)
    monkeypatch.setattr(cuda_kernels, "_aten", ops)
    return ops
