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


# ---------------------------------------------------------------- FlashAttention's window, a row block at a time


def window_columns(rows: int, cols: int, left: int, right: int, r0: int, r1: int) -> tuple[int, int]:
    """Columns ``[c0, c1)`` that query rows ``[r0, r1)`` of a ``rows x cols`` call may see under a bottom-right
    aligned window (row ``r`` sees ``r + cols - rows - left <= c <= r + cols - rows + right``; ``-1``: unbounded)."""
    shift = cols - rows
    c0 = 0 if left < 0 else max(0, r0 + shift - left)
    c1 = cols if right < 0 else min(cols, r1 - 1 + shift + right + 1)
    return c0, max(c0, c1)


def _window_scores(q: Tensor, k: Tensor, scale: float, left: int, right: int, r0: int, r1: int, c0: int, c1: int,
                   rows: int, cols: int) -> Tensor:
    """Scaled scores of query rows ``[r0, r1)`` against key columns ``[c0, c1)`` (GQA by index), ``-inf`` outside
    the window, in the math dtype."""
    group = q.shape[1] // k.shape[1]
    dtype = math_dtype(q.dtype)
    kk = k[:, torch.arange(q.shape[1]) // group, c0:c1].to(dtype)
    s = torch.einsum("bhqd,bhkd->bhqk", q[:, :, r0:r1].to(dtype), kk) * scale
    d = torch.arange(c0, c1)[None, :] - torch.arange(r0, r1)[:, None] - (cols - rows)
    visible = torch.ones_like(d, dtype=torch.bool)
    if left >= 0:
        visible &= d >= -left
    if right >= 0:
        visible &= d <= right
    return s.masked_fill(~visible, float("-inf"))


def _block(left: int, right: int) -> int:
    """Query rows per block: about the window's width when it is narrow (few columns outside it), else 512."""
    return 512 if left < 0 or right < 0 else max(64, min(512, left + right + 1))


def window_forward(q: Tensor, k: Tensor, v: Tensor, scale: float, left: int, right: int,
                   block: int | None = None) -> tuple[Tensor, Tensor]:
    """``[B, H, Sq, D]`` attention under a bottom-right window, ``block`` query rows at a time (only the columns
    they may see: a narrow window over a long sequence stays cheap). Rows that see no key: out 0, lse ``+inf``."""
    b, h, rows, d = q.shape
    cols = k.shape[2]
    dtype = math_dtype(q.dtype)
    out = torch.zeros(b, h, rows, v.shape[-1], dtype=dtype)
    lse = torch.full((b, h, rows), float("inf"), dtype=dtype)
    group = h // k.shape[1]
    block = block or _block(left, right)
    for r0 in range(0, rows, block):
        r1 = min(rows, r0 + block)
        c0, c1 = window_columns(rows, cols, left, right, r0, r1)
        if c0 == c1:
            continue
        s = _window_scores(q, k, scale, left, right, r0, r1, c0, c1, rows, cols)
        m = torch.logsumexp(s, dim=-1)
        seen = m > float("-inf")
        vv = v[:, torch.arange(h) // group, c0:c1].to(dtype)
        o = torch.einsum("bhqk,bhkd->bhqd", torch.exp(s - m[..., None]).nan_to_num(0.0), vv)
        out[:, :, r0:r1] = torch.where(seen[..., None], o, 0.0)
        lse[:, :, r0:r1] = torch.where(seen, m, float("inf"))
    return out, lse


def window_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float,
                    left: int, right: int, block: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of :func:`window_forward` from the given out and lse, dK/dV summed onto the KV heads."""
    b, h, rows, d = q.shape
    cols = k.shape[2]
    dtype = math_dtype(q.dtype)
    heads = torch.arange(h) // (h // k.shape[1])
    dq = torch.zeros(q.shape, dtype=dtype)
    dk_h = torch.zeros(b, h, cols, d, dtype=dtype)
    dv_h = torch.zeros(b, h, cols, v.shape[-1], dtype=dtype)
    block = block or _block(left, right)
    for r0 in range(0, rows, block):
        r1 = min(rows, r0 + block)
        c0, c1 = window_columns(rows, cols, left, right, r0, r1)
        if c0 == c1:
            continue
        s = _window_scores(q, k, scale, left, right, r0, r1, c0, c1, rows, cols)
        p = torch.exp(s - lse[:, :, r0:r1, None].to(dtype))
        g, o = dout[:, :, r0:r1].to(dtype), out[:, :, r0:r1].to(dtype)
        dp = torch.einsum("bhqd,bhkd->bhqk", g, v[:, heads, c0:c1].to(dtype))
        ds = p * (dp - (g * o).sum(-1, keepdim=True)) * scale
        dq[:, :, r0:r1] = torch.einsum("bhqk,bhkd->bhqd", ds, k[:, heads, c0:c1].to(dtype))
        dk_h[:, :, c0:c1] += torch.einsum("bhqk,bhqd->bhkd", ds, q[:, :, r0:r1].to(dtype))
        dv_h[:, :, c0:c1] += torch.einsum("bhqk,bhqd->bhkd", p, g)
    dk = torch.zeros(k.shape, dtype=dtype).index_add_(1, heads, dk_h)
    dv = torch.zeros(v.shape, dtype=dtype).index_add_(1, heads, dv_h)
    return dq, dk, dv


def fa2_window(left: int | None, right: int | None, causal: bool, rows: int, cols: int) -> tuple[int, int]:
    """FlashAttention-2's own reading of its arguments (``mha_fwd`` / ``mha_varlen_fwd`` and their parameters;
    ``rows``/``cols``: the call's (longest) query and key lengths): a bound at or past the key length is dropped,
    one query row is never causal, causal means ``right = 0``, and a dropped bound beside a kept one becomes the key
    length. Returns ``(left, right)``, ``-1`` unbounded."""
    left = -1 if left is None else left
    right = -1 if right is None else right
    if left >= cols:
        left = -1
    if right >= cols:
        right = -1
    if rows == 1:
        causal = False
    if causal:
        right = 0
    if left < 0 and right >= 0:
        left = cols
    if left >= 0 and right < 0:
        right = cols
    return left, right
