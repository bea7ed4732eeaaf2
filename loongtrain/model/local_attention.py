"""The model's default attention core and the protocol every replacement follows (docs/memory.md).

Each attention module stores its core as a plain attribute ``attention_fn`` and calls it as::

    attention_fn(q, k, v, causal=True)      # q [B, S, H, D], k, v [B, S, Hkv, D] -> [B, S, H, D]

A replacement must accept the same arguments (plus the keyword ``softmax_scale``, default
``1/sqrt(D)``, and, for packed documents, sliding windows or attention sinks, ``cu_seqlens``,
``sliding_window`` and ``sinks``, which the model passes only when set)
and return the same shape; query head ``h`` attends with KV head
``h // (H / Hkv)`` (GQA). Parallelism is applied by swapping the attribute from outside
(``loongtrain.apply_2d_attention``); the model itself never communicates.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


class AttentionFn(Protocol):
    """``(q [B, S, H, D], k, v [B, S, Hkv, D], *, causal, softmax_scale[, cu_seqlens, sliding_window])
    -> [B, S, H, D]``. The two optional keywords are passed only when set (packed documents; a sliding
    window, Mistral's ``i - w < j <= i``), with the meaning of :func:`loongtrain.attention`."""

    def __call__(
        self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True, softmax_scale: float | None = None,
        **masks: Any,
    ) -> Tensor: ...


CuSeqlens = Tensor | Sequence[int] | Sequence[Tensor | Sequence[int]]


def normalize_cu_seqlens(cu_seqlens: CuSeqlens | None, batch: int, seq_len: int) -> tuple[tuple[int, ...], ...] | None:
    """Per-row document boundaries as int tuples, or ValueError naming the value and the rule.

    flash-attn's convention on the **full** sequence of ``seq_len`` tokens: integers that start at 0, end
    at ``seq_len`` and strictly increase. One per batch row: a 1-D tensor (or int sequence) when
    ``batch == 1``, else a list of ``batch`` of them."""
    if cu_seqlens is None:
        return None
    if not isinstance(cu_seqlens, (Tensor, Sequence)) or isinstance(cu_seqlens, (str, bytes)):
        raise ValueError(f"cu_seqlens must be a 1-D integer tensor or a list of ints (one per batch row: a list "
                         f"of them); got {type(cu_seqlens).__name__}")
    single = isinstance(cu_seqlens, Tensor) or all(_is_number(x) for x in cu_seqlens)
    rows = [cu_seqlens] if single else list(cu_seqlens)
    if len(rows) != batch:
        raise ValueError(
            f"cu_seqlens gives {len(rows)} row(s) for a batch of {batch}: pass one 1-D cu_seqlens per batch "
            f"row (a 1-D tensor when batch == 1, else a list of {batch})"
        )
    out = []
    for b, row in enumerate(rows):
        row = _integer_row(row, b)
        where = f"cu_seqlens[{b}]={list(row)}" if len(row) <= 16 else f"cu_seqlens[{b}] (length {len(row)})"
        if len(row) < 2 or row[0] != 0:
            raise ValueError(f"{where} must start at 0 (flash-attn convention: 0 = c_0 < c_1 < ... < c_n = S)")
        if row[-1] != seq_len:
            raise ValueError(f"{where} must end at the full sequence length S={seq_len} (not the local shard's)")
        bad = next((i for i in range(1, len(row)) if row[i] <= row[i - 1]), None)
        if bad is not None:
            raise ValueError(f"{where} must strictly increase; entry {bad} ({row[bad]}) <= entry {bad - 1} "
                             f"({row[bad - 1]})")
        out.append(row)
    return tuple(out)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float, numbers.Number)) and not isinstance(x, Tensor)


def _integer_row(row: Any, b: int) -> tuple[int, ...]:
    """One row of document boundaries as ints; ValueError for floats, bools, the meta device, or
    anything that is not a 1-D integer sequence."""
    if isinstance(row, Tensor):
        if row.dim() != 1 or row.is_floating_point() or row.is_complex() or row.dtype == torch.bool:
            raise ValueError(f"cu_seqlens[{b}] must be a 1-D integer tensor; got {row.dtype} {tuple(row.shape)}")
        if row.device.type == "meta":
            raise ValueError(f"cu_seqlens[{b}] is on the meta device (no values): pass it on the CPU or the "
                             f"inputs' device")
        return tuple(row.tolist())
    if not isinstance(row, Sequence) or isinstance(row, (str, bytes)):
        raise ValueError(f"cu_seqlens[{b}] must be a 1-D integer tensor or a list of ints; got {type(row).__name__}")
    for i, x in enumerate(row):
        if isinstance(x, bool) or not isinstance(x, numbers.Integral):
            raise ValueError(f"cu_seqlens[{b}][{i}] = {x!r} ({type(x).__name__}): document boundaries must be "
                             f"integers")
    return tuple(int(x) for x in row)


def validate_sliding_window(sliding_window: int | None) -> None:
    if sliding_window is not None and (
        isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1
    ):
        raise ValueError(f"sliding_window={sliding_window!r} must be None or an integer >= 1 "
                         f"(query i sees keys j with i - w < j <= i)")


def local_attention(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True, softmax_scale: float | None = None,
    cu_seqlens: CuSeqlens | None = None, sliding_window: int | None = None, chunk_order: object = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Softmax attention over the whole (unsharded) sequence held by this process.

    ``q [B, S, H, D]``, ``k [B, S, Hkv, D]``, ``v [B, S, Hkv, Dv]`` with ``H`` a multiple of ``Hkv`` ->
    ``[B, S, H, Dv]`` (``Dv``: ``D`` but for MLA).
    Causal masking is by index in the given order (the tokens must be in sequence order). With
    ``cu_seqlens`` (packed documents) or ``sliding_window`` the masks are those of
    :func:`loongtrain.attention`: each document runs alone, a window in blocks of queries. ``sinks [H]``:
    a logit per head in each row's softmax denominator (:func:`loongtrain.attention`'s; plain math here).
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"q must be [B, S, H, D], k [B, S, Hkv, D] and v [B, S, Hkv, Dv]; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"num_heads={q.shape[2]} must be a multiple of num_kv_heads={k.shape[2]}")
    if chunk_order is not None:
        raise ValueError(f"chunk_order={chunk_order!r} describes sharded tokens; this attention holds the whole "
                         f"sequence in order (shard with loongtrain.shard_sequence and apply_2d_attention)")
    validate_sliding_window(sliding_window)
    docs = normalize_cu_seqlens(cu_seqlens, q.shape[0], q.shape[1])
    if sinks is not None and (not isinstance(sinks, Tensor) or sinks.shape != (q.shape[2],)):
        raise ValueError(f"sinks must be a tensor [num_heads={q.shape[2]}]; got "
                         f"{tuple(sinks.shape) if isinstance(sinks, Tensor) else type(sinks).__name__}")
    if docs is None and sliding_window is None:
        return _sdpa(q, k, v, causal, softmax_scale, None, sinks)
    rows = []
    for b, bounds in enumerate(docs or [(0, q.shape[1])] * q.shape[0]):
        parts = [_document(q[b : b + 1, s:e], k[b : b + 1, s:e], v[b : b + 1, s:e], causal, softmax_scale,
                           sliding_window, sinks) for s, e in zip(bounds, bounds[1:])]
        rows.append(torch.cat(parts, dim=1))
    return torch.cat(rows, dim=0)


def _sdpa(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float | None, mask: Tensor | None,
          sinks: Tensor | None = None) -> Tensor:
    if sinks is not None:
        return _with_sinks(q, k, v, causal, scale, mask, sinks)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
        is_causal=causal and mask is None, scale=scale, enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)


def _with_sinks(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float | None, mask: Tensor | None,
                sinks: Tensor) -> Tensor:
    """Plain-math attention with a sink logit per head as an extra column of the softmax (gpt-oss's eager form)."""
    heads, head_dim = q.shape[2], q.shape[3]
    k, v = (t.repeat_interleave(heads // t.shape[2], dim=2) for t in (k, v))
    scores = torch.einsum("bihd,bjhd->bhij", q, k) * (scale if scale is not None else head_dim ** -0.5)
    visible = mask
    if causal:
        tril = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device).tril()
        visible = tril if visible is None else visible & tril
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    column = sinks.to(scores.dtype).view(1, heads, 1, 1).expand(*scores.shape[:3], 1)
    probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("bhij,bjhd->bihd", probs.to(v.dtype), v)


def _document(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float | None, window: int | None,
              sinks: Tensor | None = None) -> Tensor:
    """One document alone; a window shorter than it: query blocks against the keys the window reaches."""
    n = q.shape[1]
    if window is None or window >= n:
        return _sdpa(q, k, v, causal, scale, None, sinks)
    block = max(window, 128)
    outs = []
    for a in range(0, n, block):
        b = min(n, a + block)
        k0, k1 = max(0, a - window + 1), (b if causal else min(n, b + window - 1))
        d = torch.arange(k0, k1, device=q.device)[None, :] - torch.arange(a, b, device=q.device)[:, None]
        visible = (d > -window) & (d <= 0 if causal else d < window)
        outs.append(_sdpa(q[:, a:b], k[:, k0:k1], v[:, k0:k1], False, scale, visible, sinks))
    return torch.cat(outs, dim=1)
