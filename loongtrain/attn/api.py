"""``loongtrain.attention``: 2D-Attention over a :class:`~loongtrain.parallel.mesh.Mesh` (docs/attention.md).

Per rank::

    q, k [B, S/sp, H or Hkv, D], v [B, S/sp, Hkv, Dv]   local zigzag shards (shard_sequence)
      -> one all-to-all in the head group (q, k, v packed)
    q [B, S/cp, H/hp, D], k, v [B, S/cp, Hkv', D or Dv]  Hkv' = Hkv/hp, or 1 when KV heads are replicated
      -> zigzag (double-)ring over the context group
    out [B, S/cp, H/hp, Dv]
      -> all-to-all back
    out [B, S/sp, H, Dv]

V's head dim ``Dv`` may differ from Q/K's ``D`` (MLA: 128 and 192; docs/attention.md#mla).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from loongtrain.attn import ops
from loongtrain.attn.masking import flatten_cu_seqlens
from loongtrain.model.local_attention import CuSeqlens, normalize_cu_seqlens, validate_sliding_window
from loongtrain.parallel.agreement import agree_on_attention
from loongtrain.parallel.config import ParallelConfig, validate_parallel
from loongtrain.parallel.mesh import Mesh, single_process_mesh
from loongtrain.parallel.step_memo import LastCall
from loongtrain.parallel.zigzag import check_chunk_order

Tensor = torch.Tensor


def validate_attention_inputs(q: Tensor, k: Tensor, v: Tensor, mesh: Mesh, *,
                              softmax_scale: float | None = None, sinks: Tensor | None = None) -> None:
    """Raise ValueError (before any communication) if q/k/v (and ``softmax_scale``, ``sinks``) cannot run on
    ``mesh``."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a 4-D tensor [batch, seq, heads, head_dim]; got {got}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be floating point; got dtype {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v devices differ: {q.device}, {k.device}, {v.device}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must match in batch, seq and heads (only the head dim may differ: MLA); got "
                         f"{tuple(k.shape)} vs {tuple(v.shape)}")
    (batch, seq, num_heads, head_dim), num_kv_heads = q.shape, k.shape[2]
    sizes = dict(batch=batch, seq=seq, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                 v_head_dim=v.shape[3])
    if min(sizes.values()) < 1:
        raise ValueError(f"q {tuple(q.shape)}, k/v {tuple(k.shape)}: every size must be positive; got {sizes}")
    if softmax_scale is not None and not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale={softmax_scale} must be a positive, finite number (or None)")
    if k.shape[0] != batch or k.shape[1] != seq or k.shape[3] != head_dim:
        raise ValueError(
            f"k shape {tuple(k.shape)} must match q {tuple(q.shape)} in batch, seq and head_dim"
        )
    if sinks is not None:
        validate_sinks(sinks, q)
    # the GQA rule and the sequence-length rule, as everywhere else (docs/attention.md#the-gqa-rule,
    # docs/configuration.md)
    validate_parallel(ParallelConfig.from_layout(mesh.layout), seq_len=seq * mesh.sp,
                      num_heads=num_heads, num_kv_heads=num_kv_heads)


def validate_sinks(sinks: Tensor, q: Tensor) -> None:
    """ValueError unless ``sinks`` is a floating ``[num_heads]`` tensor on q's device (one logit per query head)."""
    if not isinstance(sinks, Tensor):
        raise ValueError(f"sinks must be a tensor [num_heads] (one logit per query head) or None; got "
                         f"{type(sinks).__name__}")
    if sinks.shape != (q.shape[2],) or not sinks.is_floating_point():
        raise ValueError(f"sinks must be a floating tensor [num_heads={q.shape[2]}]; got {sinks.dtype} "
                         f"{tuple(sinks.shape)}")
    if sinks.device != q.device:
        raise ValueError(f"sinks are on {sinks.device}, q on {q.device}")


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mesh: Mesh | None,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    cu_seqlens: CuSeqlens | None = None,
    sliding_window: int | None = None,
    chunk_order: Sequence[int] | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Exact softmax attention of the replica's full sequence, computed from this rank's shards.

    ``q [B, S/sp, H, D]``, ``k [B, S/sp, Hkv, D]``, ``v [B, S/sp, Hkv, Dv]`` are local shards in the layout of
    :func:`loongtrain.shard_sequence`; returns ``[B, S/sp, H, Dv]`` in the same layout, differentiable
    in q, k and v. V's head dim may differ from Q/K's (MLA); ``softmax_scale`` defaults to ``1/sqrt(D)``.
    ``mesh=None`` means a single process (no communication).

    ``cu_seqlens``: document boundaries of the **full** sequence (flash-attn's convention: integers from
    0 to S, strictly increasing), one per batch row (a 1-D tensor when B == 1, else a list), identical on
    every rank of a replica; a token attends only inside its own document (causally when ``causal``,
    bidirectionally when not). ``sliding_window=w`` (Mistral's convention): query ``i`` sees keys ``j``
    with ``i - w < j <= i`` (non-causal: ``|i - j| < w``), with or without documents. Blocks with no
    visible pair are skipped (no kernel call), and a window reaching ``r`` chunks shortens the ring pass
    (single or double ring) to the hops that bring the blocks of the members at most ``r`` ring positions
    away, when that sends fewer than ``cp - 1`` blocks (docs/attention.md#the-ring-schedule). Invalid
    ``cu_seqlens``/``sliding_window`` raise ValueError before any data is exchanged; only the agreement check
    (docs/launching.md: a digest of the arguments exchanged on every call) runs first, so an input that differs
    between ranks raises on every rank instead of hanging the others, however many agreed calls came before.

    ``chunk_order``: the tokens' layout when they were sharded with ``shard_sequence(..., chunk_order=)``
    (e.g. :func:`loongtrain.balanced_chunk_order` for packed documents); default zigzag.

    ``sinks [H]`` (gpt-oss's attention sinks; the whole parameter, identical on every rank): a learned logit
    per query head in every row's softmax denominator, ``softmax([q k^T * scale, sink])`` without the sink's
    column. Each head rank takes its heads' sinks; they are folded in once, after the last ring step's merge
    (docs/attention.md#attention-sinks). Their gradient on a rank is its query rows' share: summed over the
    sequence ranks (as the gradient sync does for every replicated weight) it is the exact gradient.

    Inside a ``torch.compile``-d block (docs/compile.md) the shape checks are traced, while the values of
    ``cu_seqlens`` and ``chunk_order`` are checked by the ops when they run (give them as tensors, or each
    new value is a new graph) and the agreement exchange is skipped.
    """
    mesh = mesh or single_process_mesh()
    compiling = torch.compiler.is_compiling()
    if not compiling:
        # the agreement check (docs/launching.md)
        agree_on_attention(mesh, q, k, v, causal=causal, softmax_scale=softmax_scale, cu_seqlens=cu_seqlens,
                           sliding_window=sliding_window, chunk_order=chunk_order, sinks=sinks)
    # shapes: traced, checked at trace time
    validate_attention_inputs(q, k, v, mesh, softmax_scale=softmax_scale, sinks=sinks)
    validate_sliding_window(sliding_window)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[3])
    if compiling:  # traced inside a compiled block: document boundaries and chunk order are data, not constants
        cu, order = _traced_masks(cu_seqlens, chunk_order)
        key = _ring_key(mesh)
    else:
        cu, order = _MASK_TENSORS(_mask_tensors, cu_seqlens, chunk_order, q.shape[0], q.shape[1] * mesh.sp,
                                  mesh.hp, mesh.cp)  # once per step: every layer passes the same objects
        key = ops.ring_key(mesh)
    num_kv_heads = k.shape[2]
    hp = mesh.hp
    if hp > num_kv_heads:  # each head rank needs exactly one KV head: replicate, grads sum back
        k = k.repeat_interleave(hp // num_kv_heads, dim=2)
        v = v.repeat_interleave(hp // num_kv_heads, dim=2)
    if hp > 1:
        q, k, v = _scatter_heads(q, k, v, mesh)
        if sinks is not None:  # this head rank's heads (the all-to-all's chunk hp_rank of the head dim)
            sinks = sinks.view(hp, -1)[mesh.hp_rank]
    out, _ = ops.ring_attention(q, k, v, key, causal, scale, cu, sliding_window, order, sinks)
    if hp > 1:
        out = ops.head_all_to_all(out, mesh.hp_group.group_name, 1, 2)
    return out


_MASK_TENSORS: LastCall[tuple[Tensor | None, Tensor | None]] = LastCall()


def _mask_tensors(cu_seqlens: CuSeqlens | None, chunk_order: Sequence[int] | Tensor | None, batch: int, seq: int,
                  hp: int, cp: int) -> tuple[Tensor | None, Tensor | None]:
    """The ops' tensors of the document boundaries and the chunk order, checked (ValueError)."""
    docs = normalize_cu_seqlens(cu_seqlens, batch, seq)
    order_ints = _ints(chunk_order)
    if order_ints is not None:
        check_chunk_order(order_ints, seq, hp, cp)
    cu = ops.as_index_tensor(flatten_cu_seqlens(docs)) if docs is not None else None
    return cu, ops.as_index_tensor(order_ints)


def _ints(values: Sequence[int] | Tensor | None) -> tuple[int, ...] | None:
    if values is None:
        return None
    return tuple(int(x) for x in (values.tolist() if isinstance(values, Tensor) else values))


@torch.compiler.assume_constant_result
def _ring_key(mesh: Mesh) -> str:
    """:func:`~loongtrain.attn.ops.ring_key`, run at trace time (host-side; its result is a constant of the graph)."""
    return ops.ring_key(mesh)


def _traced_masks(cu_seqlens: CuSeqlens | None, chunk_order: Sequence[int] | Tensor | None
                  ) -> tuple[Tensor | None, Tensor | None]:
    """The ops' tensor forms of the masks while a compiled block is traced. Tensors stay graph inputs (their
    values are never guarded: :func:`loongtrain.parallelize.compile.compile_blocks` hands blocks tensors); Python
    ints would become constants of the graph (correct, but a new value recompiles). The ops check the
    values when they run (``ops._mask``); the once-per-signature agreement (docs/launching.md) does not run here."""
    cu = None
    if cu_seqlens is not None:
        rows = [cu_seqlens] if isinstance(cu_seqlens, Tensor) and cu_seqlens.dim() == 1 else list(cu_seqlens)
        if rows and not isinstance(rows[0], (Tensor, Sequence)):  # one row given as ints
            rows = [rows]
        cu = torch.cat([r.to(torch.int64) if isinstance(r, Tensor) else torch.tensor(list(r), dtype=torch.int64)
                        for r in rows])
    order = None
    if chunk_order is not None:
        order = (chunk_order.to(torch.int64) if isinstance(chunk_order, Tensor)
                 else torch.tensor(list(chunk_order), dtype=torch.int64))
    return cu, order


def _scatter_heads(q: Tensor, k: Tensor, v: Tensor, mesh: Mesh) -> tuple[Tensor, Tensor, Tensor]:
    """One all-to-all for q, k, v: [B, S/sp, heads, D] -> [B, S/cp, heads/hp, D] each (each its own D)."""
    batch, seq = q.shape[:2]
    hp = mesh.hp
    parts = [t.reshape(batch, seq, hp, -1) for t in (q, k, v)]  # per-destination head groups
    widths = [p.shape[-1] for p in parts]
    packed = torch.cat(parts, dim=3)
    gathered = ops.head_all_to_all(packed, mesh.hp_group.group_name, 2, 1)  # [B, S/cp, 1, sum(widths)]
    seq_c = seq * hp
    return tuple(part.reshape(batch, seq_c, -1, t.shape[3])
                 for part, t in zip(gathered.squeeze(2).split(widths, dim=-1), (q, k, v)))
