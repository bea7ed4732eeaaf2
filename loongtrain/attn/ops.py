"""The 2D-Attention communication/compute steps as ``torch.library`` custom ops.

Being custom ops (not plain autograd Functions) lets selective recompute save their
outputs (``CheckpointPolicy.MUST_SAVE`` on ``torch.ops.loongtrain.*``), so a recompute pass re-runs
neither attention nor any of its communication (selective recompute; docs/attention.md#kernels). Process
groups travel as their registered names, a context ring as the key of its registered :class:`Ring`.
To ``torch.compile`` they are opaque nodes (docs/compile.md): the ring backward is an op of its own,
document boundaries and chunk orders are CPU int64 tensors (data, not constants of a graph), and the
fake implementations' shapes depend on q/k/v alone. Autocast is off inside the ops: the ring computes in the
dtypes it is given, forward and backward alike (docs/kernels.md#autocast).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from loongtrain.attn.masking import AttnMask, unflatten_cu_seqlens
from loongtrain.attn.ring import Ring, RingCall, ring_backward_packed, ring_forward
from loongtrain.attn.ring_step import KVBlock
from loongtrain.attn.sinks import sinks_grad
from loongtrain.model.local_attention import normalize_cu_seqlens
from loongtrain.parallel.comm import all_to_all, all_to_all_pieces, all_to_all_result, resolve_group
from loongtrain.parallel.mesh import Mesh
from loongtrain.parallel.step_memo import LastCall
from loongtrain.parallel.zigzag import check_chunk_order

Tensor = torch.Tensor


@torch.library.custom_op("loongtrain::head_all_to_all", mutates_args=())
def head_all_to_all(x: Tensor, group: str, scatter_dim: int, gather_dim: int) -> Tensor:
    """Forward: all-to-all over the head group, scattering ``scatter_dim`` and gathering ``gather_dim``.
    Backward: the same all-to-all with the two dims swapped."""
    out = all_to_all(x, resolve_group(group), scatter_dim, gather_dim)
    return out.clone() if out is x else out  # a group of one: an op's output may not alias its input


@head_all_to_all.register_fake
def _(x: Tensor, group: str, scatter_dim: int, gather_dim: int) -> Tensor:
    # the real result's strides too: the same layout steps on an empty received buffer (a view of it where
    # the pieces allow, e.g. batch 1: not always contiguous; inductor asserts the strides)
    n = torch.distributed.get_world_size(resolve_group(group))
    if n == 1:
        return torch.empty_like(x)
    return all_to_all_result(torch.empty_like(all_to_all_pieces(x, n, scatter_dim)), gather_dim)


def _a2a_setup(ctx, inputs, output) -> None:
    _, ctx.group, ctx.scatter_dim, ctx.gather_dim = inputs


def _a2a_backward(ctx, grad: Tensor):
    return head_all_to_all(grad.contiguous(), ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


head_all_to_all.register_autograd(_a2a_backward, setup_context=_a2a_setup)


_RINGS: dict[str, Ring] = {}  # ring_key -> Ring, filled by ring_key (process groups are per process too)


def _ring_groups(ring: Ring) -> tuple:
    return ring.inner_group, ring.outer_group, ring.inner_grad_group, ring.outer_grad_group


def ring_key(mesh: Mesh) -> str:
    """Register this rank's context ring (ranks, position, inner_ring, its four process groups) once per
    mesh and return the key the ``ring_attention`` op finds it by (like torch, which resolves process
    groups by name)."""
    groups = (mesh.inner_group, mesh.outer_group, mesh.inner_grad_group, mesh.outer_grad_group)
    names = ",".join(g.group_name if g is not None else "-" for g in groups)
    key = f"{mesh.rank}:{mesh.inner_ring}:{','.join(map(str, mesh.ring_ranks))}:{names}"
    ring = _RINGS.get(key)
    if ring is None or any(a is not b for a, b in zip(_ring_groups(ring), groups)):  # a group was remade
        _RINGS[key] = Ring(tuple(mesh.ring_ranks), mesh.cp_rank, mesh.inner_ring, *groups)
    return key


_MASKS: LastCall[AttnMask] = LastCall()  # the step's mask: every layer passes the same boundary tensors


def _mask(causal: bool, cu_seqlens: Tensor | None, sliding_window: int | None, chunk_order: Tensor | None,
          q: Tensor, cp: int) -> AttnMask:
    """The mask of one op call, from its tensor arguments (host-side int64 values; checked here too, since a
    compiled block reaches the op without :func:`loongtrain.attention`'s value checks); the same object for
    every call of a step that passes the same tensors (:class:`~loongtrain.parallel.step_memo.LastCall`)."""
    return _MASKS(_read_mask, causal, cu_seqlens, sliding_window, chunk_order, q.shape[0], q.shape[1] * cp, cp)


def _read_mask(causal: bool, cu_seqlens: Tensor | None, sliding_window: int | None, chunk_order: Tensor | None,
               batch: int, seq: int, cp: int) -> AttnMask:
    documents = None
    if cu_seqlens is not None:
        flat = [int(x) for x in cu_seqlens.tolist()]
        if not flat or flat[0] != 0:
            raise ValueError(f"cu_seqlens rows must each start at 0 (flash-attn convention); got {flat[:16]}")
        documents = normalize_cu_seqlens(unflatten_cu_seqlens(flat), batch, seq)
    order = None
    if chunk_order is not None:
        order = tuple(int(x) for x in chunk_order.tolist())
        check_chunk_order(order, seq, 1, cp)  # hp | S/cp already holds: the shards have equal shapes
    return AttnMask(causal, sliding_window, documents, chunk_order=order)


def as_index_tensor(values: Sequence[int] | Tensor | None) -> Tensor | None:
    """``cu_seqlens`` (flattened) or ``chunk_order`` as the ops take them: a CPU int64 tensor (None stays None).

    As tensors they are data to a compiled block, not constants: a new document mix or chunk order reuses
    the compiled graph instead of recompiling it (docs/compile.md)."""
    if values is None or isinstance(values, Tensor):
        return values if values is None else values.to(device="cpu", dtype=torch.int64)
    return torch.tensor(list(values), dtype=torch.int64)


@torch.library.custom_op("loongtrain::ring_attention", mutates_args=())
def ring_attention(
    q: Tensor, k: Tensor, v: Tensor, ring: str, causal: bool, scale: float, cu_seqlens: Tensor | None,
    sliding_window: int | None, chunk_order: Tensor | None, sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Forward: zigzag (double-)ring attention of ``q [B, S_c, H, D]`` against the K ``[B, S_c, Hkv, D]`` and V
    ``[B, S_c, Hkv, Dv]`` of every member of the ring registered as ``ring`` (:func:`ring_key`); returns out
    ``[B, S_c, H, Dv]`` and
    lse ``[B, H, S_c]``. ``cu_seqlens``: each batch row's document boundaries, rows concatenated (each starts
    at 0; None: one document), a CPU int64 tensor (:func:`as_index_tensor`); ``sliding_window``: Mistral's
    window (None: none); ``chunk_order``: the tokens' layout (None: zigzag), a CPU int64 tensor; ``sinks``:
    ``[H]`` attention sinks of these heads (None: none), folded in once after the last merge (out and lse
    include them). Backward: :func:`ring_attention_backward` (ring backward, K/V re-circulated and dK/dV
    returned to their owners) and, for ``sinks``, this rank's rows' share of their gradient (no
    communication: the sequence ranks' shares sum in the gradient sync); lse is not differentiable
    (docs/attention.md#attention-sinks)."""
    mask = _mask(causal, cu_seqlens, sliding_window, chunk_order, q, len(_RINGS[ring].ranks))
    with torch.autocast(q.device.type, enabled=False):  # the kernels and fp32 merges run in the dtypes given
        out, lse = ring_forward(_bhsd(q), _bhsd(k), _bhsd(v), _RINGS[ring], RingCall(mask, scale), sinks=sinks)
    return out.transpose(1, 2).contiguous(), lse


@ring_attention.register_fake
def _(q, k, v, ring, causal, scale, cu_seqlens, sliding_window, chunk_order, sinks=None):
    # shapes depend on q and v's head dim alone, whatever the documents, window or chunk order
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty((*q.shape[:3], v.shape[3])), q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=acc)


@torch.library.custom_op("loongtrain::ring_attention_backward", mutates_args=())
def ring_attention_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, ring: str, causal: bool,
    scale: float, cu_seqlens: Tensor | None, sliding_window: int | None, chunk_order: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """Forward: dq ``[B, S_c, H, D]`` and dK/dV as one flat block (K's gradient ``[B, Hkv, S_c, D]`` then V's
    ``[B, Hkv, S_c, Dv]``, :class:`~loongtrain.attn.ring_step.KVBlock`; input dtypes) of :func:`ring_attention`
    for ``dout``, K/V re-circulated round the ring and dK/dV returned to their owners. An op of its own, so a
    compiled block's backward calls it as one opaque node. Backward: none (no double backward)."""
    mask = _mask(causal, cu_seqlens, sliding_window, chunk_order, q, len(_RINGS[ring].ranks))
    with torch.autocast(q.device.type, enabled=False):  # as the forward: the dtypes given
        dq, dkv = ring_backward_packed(_bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse, _RINGS[ring],
                                       RingCall(mask, scale))
    return dq.transpose(1, 2), dkv


@ring_attention_backward.register_fake
def _(dout, q, k, v, out, lse, ring, causal, scale, cu_seqlens, sliding_window, chunk_order):
    # the real dq is [B, S_c, H, D] storage (attn/step.BackwardStep, attn/ring.whole_backward), dK/dV one flat
    # block (dK [B, Hkv, S_c, D] then dV [B, Hkv, S_c, Dv]): the same here
    return q.new_empty(q.shape), k.new_empty(k.numel() + v.numel())


def _bhsd(x: Tensor) -> Tensor:
    """``[B, S, H, D] -> [B, H, S, D]`` as a view (K/V are copied once when stacked into a ring block;
    the kernels take strided views)."""
    return x.transpose(1, 2)


def _ring_setup(ctx, inputs, output) -> None:
    q, k, v, ring, causal, scale, cu_seqlens, sliding_window, chunk_order, *rest = inputs
    sinks = rest[0] if rest else None
    out, lse = output
    # tensors saved as such (compile traces it)
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, chunk_order, sinks)
    ctx.args = (ring, causal, scale, sliding_window)
    ctx.mark_non_differentiable(lse)


def _ring_backward(ctx, dout: Tensor, _dlse: Tensor | None):
    q, k, v, out, lse, cu_seqlens, chunk_order, sinks = ctx.saved_tensors
    ring, causal, scale, sliding_window = ctx.args
    dout = dout.contiguous()
    dq, dkv = ring_attention_backward(dout, q, k, v, out, lse, ring, causal, scale, cu_seqlens,
                                      sliding_window, chunk_order)
    dsinks = None
    if sinks is not None and ctx.needs_input_grad[9]:  # out and lse include the sinks: dq, dk, dv as they are
        dsinks = sinks_grad(_bhsd(dout), _bhsd(out), lse, sinks)
    dk, dv = KVBlock.of(_bhsd(k), _bhsd(v)).split(dkv)  # [B, Hkv, S_c, ·] storage seen as k's and v's shapes
    return (dq, dk.transpose(1, 2), dv.transpose(1, 2)) + (None,) * 6 + (dsinks,)


ring_attention.register_autograd(_ring_backward, setup_context=_ring_setup)
