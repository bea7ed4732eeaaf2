"""What the CPU emulation of the CUDA attention ops (tests/helpers/cuda_emulation.py) is made of: binding a call
to the real op's schema, and plain attention math in fp32 (fp64 in the emulation's fp64 mode), written
here independently of loongtrain."""

from __future__ import annotations

import torch

Tensor = torch.Tensor


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
        check_kind(op_name, p.name, str(p.type), bound[p.name])
    return bound


def check_kind(op_name: str, name: str, kind: str, value: object) -> None:
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


def math_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


lse_dtype = math_dtype  # fp32; fp64 only for the emulation's fp64 mode


def scores(q: Tensor, k: Tensor, causal: bool, scale: float, bottom_right: bool) -> Tensor:
    """[B, Hq, Sq, Sk] scaled scores; query head h reads KV head h // (Hq / Hkv)."""
    group = q.shape[1] // k.shape[1]
    k = k.to(math_dtype(q.dtype))[:, torch.arange(q.shape[1]) // group]
    s = torch.einsum("bhqd,bhkd->bhqk", q.to(k.dtype), k) * scale
    if causal:
        sq, sk = q.shape[2], k.shape[2]
        shift = sk - sq if bottom_right else 0
        allowed = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + shift
        s = s.masked_fill(~allowed, float("-inf"))
    return s


def attn_forward(q, k, v, causal, scale, bottom_right):
    s = scores(q, k, causal, scale, bottom_right)
    lse = torch.logsumexp(s, dim=-1)
    group = q.shape[1] // v.shape[1]
    vv = v.to(s.dtype)[:, torch.arange(q.shape[1]) // group]
    out = torch.einsum("bhqk,bhkd->bhqd", torch.exp(s - lse[..., None]), vv)
    return out, lse


def attn_backward(dout, q, k, v, out, lse, causal, scale, bottom_right):
    """Gradients from the given out and lse (as a kernel would), dK/dV summed onto the KV heads."""
    s = scores(q, k, causal, scale, bottom_right)
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


def to_bshd(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x`` [B, H, S, D] copied into [B, S, H, D] storage, returned as a [B, H, S, D] view."""
    b, h, s, d = x.shape
    return torch.empty(b, s, h, d, dtype=dtype, device=x.device).transpose(1, 2).copy_(x)


def to_bhsd(x: Tensor) -> Tensor:
    """A packed ``[T, H, D]`` sequence as ``[1, H, T, D]``."""
    return x.transpose(0, 1).unsqueeze(0)


def like_op(x: Tensor, ref: Tensor) -> Tensor:
    return torch.empty_like(ref).copy_(x)
