"""A CPU emulation of torch 2.13's CUDA attention ops, for testing the wrappers in
``loongtrain.attn.kernels`` without a GPU (docs/design.md §11).

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
  backward requires dO in O's strides.

Outputs have the layouts the CUDA ops give (``[B, S, H, D]`` storage seen as ``[B, H, S, D]``).
``allow_fp64`` admits fp64 inputs (with an fp64 lse), which the real ops reject, so that the wrappers'
plumbing can be checked at fp64 precision; ``fault`` plants one named bug so tests can show that the checks catch it.
"""

from __future__ import annotations

import math

import torch

Tensor = torch.Tensor

FAULTS = (
    "efficient_lse_padding_in_front",  # the forward puts the lse padding before the rows
    "flash_lse_sequence_major",  # the forward writes lse in [B, S, H] order into a [B, H, S] tensor
    "flash_backward_reads_value_as_key",  # the backward binds key and value in swapped order
)
_HALF = (torch.float16, torch.bfloat16)


def bind(op_name: str, args: tuple, kwargs: dict) -> dict:
    """Bind a call of ``torch.ops.aten.<op_name>`` to its schema the way the dispatcher does."""
    schema = getattr(torch.ops.aten, op_name).default._schema
    params = list(schema.arguments)
    positional = [p for p in params if not p.kwarg_only]
    if len(args) > len(positional):
        raise TypeError(f"{op_name}: {len(args)} positional arguments, schema takes {len(positional)}")
    bound = {p.name: a for p, a in zip(positional, args)}
    for name, value in kwargs.items():
        if name not in {p.name for p in params} or name in bound:
            raise TypeError(f"{op_name}: unexpected or repeated keyword {name!r}")
        bound[name] = value
    for p in params:
        if p.name not in bound:
            if not p.has_default_value():
                raise TypeError(f"{op_name}: missing argument {p.name!r}")
            bound[p.name] = p.default_value
        _check_kind(op_name, p.name, str(p.type), bound[p.name])
    return bound


def _check_kind(op_name: str, name: str, kind: str, value: object) -> None:
    optional = kind.startswith("Optional[")
    base = kind[len("Optional["):-1] if optional else kind
    if value is None:
        assert optional or base == "Tensor", f"{op_name}: {name} ({kind}) is None"
        return
    ok = {
        "Tensor": lambda v: isinstance(v, Tensor),
        "float": lambda v: isinstance(v, (float, int)) and not isinstance(v, bool),
        "bool": lambda v: isinstance(v, bool),
        "SymInt": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "List[bool]": lambda v: isinstance(v, (list, tuple)) and all(isinstance(x, bool) for x in v),
    }[base]
    assert ok(value), f"{op_name}: {name} should be {kind}, got {type(value).__name__}"


# ---------------------------------------------------------------- math (independent of loongtrain)


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


_lse_dtype = _math_dtype  # fp32; fp64 only for the emulation's fp64 mode


def _scores(q: Tensor, k: Tensor, causal: bool, scale: float, bottom_right: bool) -> Tensor:
    """[B, Hq, Sq, Sk] scaled scores; query head h reads KV head h // (Hq / Hkv)."""
    group = q.shape[1] // k.shape[1]
    k = k.to(_math_dtype(q.dtype))[:, torch.arange(q.shape[1]) // group]
    s = torch.einsum("bhqd,bhkd->bhqk", q.to(k.dtype), k) * scale
    if causal:
        sq, sk = q.shape[2], k.shape[2]
        shift = sk - sq if bottom_right else 0
        allowed = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + shift
        s = s.masked_fill(~allowed, float("-inf"))
    return s


def _forward(q, k, v, causal, scale, bottom_right):
    s = _scores(q, k, causal, scale, bottom_right)
    lse = torch.logsumexp(s, dim=-1)
    group = q.shape[1] // v.shape[1]
    vv = v.to(s.dtype)[:, torch.arange(q.shape[1]) // group]
    out = torch.einsum("bhqk,bhkd->bhqd", torch.exp(s - lse[..., None]), vv)
    return out, lse


def _backward(dout, q, k, v, out, lse, causal, scale, bottom_right):
    """Gradients from the given out and lse (as a kernel would), dK/dV summed onto the KV heads."""
    s = _scores(q, k, causal, scale, bottom_right)
    p = torch.exp(s - lse.to(s.dtype)[..., None])
    heads = torch.arange(q.shape[1]) // (q.shape[1] // k.shape[1])
    dout, out = dout.to(s.dtype), out.to(s.dtype)
    vv = v.to(s.dtype)[:, heads]
    dp = torch.einsum("bhqd,bhkd->bhqk", dout, vv)
    ds = p * (dp - (dout * out).sum(-1, keepdim=True)) * scale
    dq = torch.einsum("bhqk,bhkd->bhqd", ds, k.to(s.dtype)[:, heads])
    dk_h = torch.einsum("bhqk,bhqd->bhkd", ds, q.to(s.dtype))
    dv_h = torch.einsum("bhqk,bhqd->bhkd", p, dout)
    dk = torch.zeros(k.shape, dtype=s.dtype).index_add_(1, heads, dk_h)
    dv = torch.zeros(v.shape, dtype=s.dtype).index_add_(1, heads, dv_h)
    return dq, dk, dv


def _bshd(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x`` [B, H, S, D] copied into [B, S, H, D] storage, returned as a [B, H, S, D] view."""
    b, h, s, d = x.shape
    return torch.empty(b, s, h, d, dtype=dtype, device=x.device).transpose(1, 2).copy_(x)


def _like(x: Tensor, ref: Tensor) -> Tensor:
    return torch.empty_like(ref).copy_(x)


# ---------------------------------------------------------------- the ops


class EmulatedAten:
    """Stands in for ``torch.ops.aten`` in ``loongtrain.attn.kernels`` (other ops pass through)."""

    def __init__(self, allow_fp64: bool = True, fault: str | None = None):
        assert fault is None or fault in FAULTS, fault
        self.allow_fp64, self.fault = allow_fp64, fault
        self.calls: list[str] = []

    def __getattr__(self, name: str):
        return getattr(torch.ops.aten, name)

    # ------------------------------------------------ shared checks

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
        want = _lse_dtype(q.dtype)
        assert lse.dtype == want, f"{op}: logsumexp must be {want}, got {lse.dtype}"
        assert tuple(lse.shape) == shape, f"{op}: logsumexp {tuple(lse.shape)}, expected {shape}"

    # ------------------------------------------------ flash (FA2)

    def _scaled_dot_product_flash_attention(self, *args, **kwargs):
        op = "_scaled_dot_product_flash_attention"
        a = bind(op, args, kwargs)
        self.calls.append(op)
        q, k, v = a["query"], a["key"], a["value"]
        self._check_qkv(op, q, k, v, _HALF, gqa=True)
        assert q.shape[3] % 8 == 0 and q.shape[3] <= 256, f"{op}: head dim {q.shape[3]}"
        assert a["dropout_p"] == 0.0 and not a["return_debug_mask"], f"{op}: emulation has no dropout"
        scale = a["scale"] if a["scale"] is not None else q.shape[3] ** -0.5
        out, lse = _forward(q, k, v, a["is_causal"], scale, bottom_right=True)
        b, h, s = lse.shape
        if self.fault == "flash_lse_sequence_major":
            lse = lse.transpose(1, 2).contiguous().view(b, h, s)
        rng_state = torch.zeros(2, dtype=torch.uint64)
        unused = torch.zeros((), dtype=torch.uint64)
        return (_bshd(out, q.dtype), lse.contiguous(), None, None, q.shape[2], k.shape[2],
                rng_state, unused, torch.empty(0, dtype=q.dtype))

    def _scaled_dot_product_flash_attention_backward(self, *args, **kwargs):
        op = "_scaled_dot_product_flash_attention_backward"
        a = bind(op, args, kwargs)
        self.calls.append(op)
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
        scale = a["scale"] if a["scale"] is not None else q.shape[3] ** -0.5
        dq, dk, dv = _backward(a["grad_out"], q, k, v, a["out"], lse, a["is_causal"], scale, bottom_right=True)
        return _bshd(dq, q.dtype), _bshd(dk, k.dtype), _bshd(dv, v.dtype)

    # ------------------------------------------------ memory-efficient

    def _scaled_dot_product_efficient_attention(self, *args, **kwargs):
        op = "_scaled_dot_product_efficient_attention"
        a = bind(op, args, kwargs)
        self.calls.append(op)
        q, k, v = a["query"], a["key"], a["value"]
        self._check_qkv(op, q, k, v, (*_HALF, torch.float32), gqa=False)
        assert a["attn_bias"] is None and a["dropout_p"] == 0.0, f"{op}: emulation has no bias or dropout"
        scale = a["scale"] if a["scale"] is not None else q.shape[3] ** -0.5
        out, lse = _forward(q, k, v, a["is_causal"], scale, bottom_right=False)
        b, h, s = lse.shape
        padded_len = math.ceil(s / 32) * 32 if a["compute_log_sumexp"] else 0
        padded = torch.full((b, h, padded_len), float("inf"), dtype=lse.dtype)
        if padded_len:
            rows = slice(padded_len - s, None) if self.fault == "efficient_lse_padding_in_front" else slice(0, s)
            padded[:, :, rows] = lse
        seed, offset = torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)
        return _bshd(out, q.dtype), padded, seed, offset

    def _scaled_dot_product_efficient_attention_backward(self, *args, **kwargs):
        op = "_scaled_dot_product_efficient_attention_backward"
        a = bind(op, args, kwargs)
        self.calls.append(op)
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
        scale = a["scale"] if a["scale"] is not None else q.shape[3] ** -0.5
        dq, dk, dv = _backward(a["grad_out_"], q, k, v, a["out"], lse, a["is_causal"], scale, bottom_right=False)
        return _bshd(dq, q.dtype), _bshd(dk, k.dtype), _bshd(dv, v.dtype), None

    # ------------------------------------------------ cuDNN

    def _scaled_dot_product_cudnn_attention(self, *args, **kwargs):
        op = "_scaled_dot_product_cudnn_attention"
        a = bind(op, args, kwargs)
        self.calls.append(op)
        q, k, v = a["query"], a["key"], a["value"]
        self._check_qkv(op, q, k, v, _HALF, gqa=True)
        assert q.shape[3] % 8 == 0 and q.shape[3] <= 128, f"{op}: head dim {q.shape[3]}"
        assert a["attn_bias"] is None and a["dropout_p"] == 0.0, f"{op}: emulation has no bias or dropout"
        assert a["compute_log_sumexp"], f"{op}: training needs the logsumexp"
        scale = a["scale"] if a["scale"] is not None else q.shape[3] ** -0.5
        out, lse = _forward(q, k, v, a["is_causal"], scale, bottom_right=False)
        seed, offset = torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)
        return (_like(out, q), lse.unsqueeze(-1).contiguous(), None, None, q.shape[2], k.shape[2],
                seed, offset, None)

    def _scaled_dot_product_cudnn_attention_backward(self, *args, **kwargs):
        op = "_scaled_dot_product_cudnn_attention_backward"
        a = bind(op, args, kwargs)
        self.calls.append(op)
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
        scale = a["scale"] if a["scale"] is not None else q.shape[3] ** -0.5
        lse = a["logsumexp"].squeeze(-1)
        dq, dk, dv = _backward(a["grad_out"], q, k, v, a["out"], lse, a["is_causal"], scale, bottom_right=False)
        return _like(dq, q), _like(dk, k), _like(dv, v)


def install(monkeypatch, **options) -> EmulatedAten:
    """Make ``loongtrain.attn.kernels``' CUDA wrappers call an :class:`EmulatedAten` for the rest of the
    test (``monkeypatch``: pytest's fixture); any kernel or ring code path then runs them on CPU tensors."""
    from loongtrain.attn import kernels

    ops = EmulatedAten(**options)
    monkeypatch.setattr(kernels, "_aten", ops)
    return ops
