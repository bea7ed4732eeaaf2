"""``loongtrain.linear_attention``: the delta-rule layers (Gated DeltaNet, KDA) over a
:class:`~loongtrain.parallel.mesh.Mesh` (docs/linear-attention.md).

Per rank::

    q, k [B, S/sp, Hk, Dk], v [B, S/sp, Hv, Dv], g, beta       local zigzag shards, before the short convolution
      -> the head group's all-to-all (as 2D-Attention's; one per dtype)
    [B, S/cp, Hk/hp | Hv/hp, ...]                              the rank's runs of whole chunks, its heads
      -> the convolution, each run's halo gathered from the run before it (``halo``)
      -> each run's recurrence from a zero state, and its transition
      -> the runs' state pairs gathered (``state``), each run's initial state composed in sequence order
    out [B, S/cp, Hv/hp, Dv] -> all-to-all back -> [B, S/sp, Hv, Dv]

What the ranks exchange over the context group does not depend on the sequence length.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from loongtrain.attn import ops as attn_ops
from loongtrain.attn.linear.kernels import run_kernel
from loongtrain.attn.linear.layout import RunLayout, document_masks, local_positions
from loongtrain.attn.linear.ops import context_all_gather
from loongtrain.model.delta_rule import compute_dtype, l2_normalize, short_conv
from loongtrain.model.local_attention import CuSeqlens, normalize_cu_seqlens
from loongtrain.parallel.agreement import agree_on_linear_attention
from loongtrain.parallel.config import ParallelConfig, effective_kv_heads, validate_parallel
from loongtrain.parallel.mesh import Mesh, single_process_mesh
from loongtrain.parallel.step_memo import LastCall
from loongtrain.parallel.zigzag import check_chunk_order

Tensor = torch.Tensor


def linear_attention(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, mesh: Mesh | None, *,
                     conv_weight: Tensor | None = None, cu_seqlens: CuSeqlens | None = None,
                     chunk_order: Sequence[int] | None = None) -> Tensor:
    """The gated delta rule (docs/linear-attention.md) of the replica's full sequence, from this rank's shards.

    ``q, k [B, S/sp, Hk, Dk]`` and ``v [B, S/sp, Hv, Dv]`` (``Hv`` a multiple of ``Hk``: value head ``m`` reads key
    head ``m // (Hv/Hk)``) before the short convolution; ``g`` the log-decay, ``[B, S/sp, Hv]`` (a gate per head:
    Gated DeltaNet) or ``[B, S/sp, Hv, Dk]`` (a gate per key channel: KDA; ``Hk == Hv``); ``beta [B, S/sp, Hv]``.
    ``conv_weight [2*Hk*Dk + Hv*Dv, K]``: the depthwise causal convolution (no bias) over the channels of
    ``cat(q, k, v)``, then SiLU (None: no convolution). q and k are L2-normalised per head and q scaled by
    ``1/sqrt(Dk)`` (the convention of every delta-rule layer loongtrain runs). ``cu_seqlens`` (packed documents of
    the full sequence) and ``chunk_order`` (the layout the tokens were sharded with) as for
    :func:`loongtrain.attention`: each document starts from a zero state and a zero convolution halo. Returns
    ``[B, S/sp, Hv, Dv]`` in v's dtype; fp64 runs in fp64, every lower precision in fp32 (the ``fla`` kernels on
    CUDA where they run)."""
    mesh = mesh or single_process_mesh()
    agree_on_linear_attention(mesh, dict(q=q, k=k, v=v, g=g, beta=beta, conv_weight=conv_weight),
                              dict(documents=cu_seqlens, chunk_order=chunk_order))
    validate_linear_inputs(q, k, v, g, beta, mesh, conv_weight=conv_weight)
    batch, seq, num_key_heads, key_dim = q.shape
    num_value_heads, value_dim = v.shape[2], v.shape[3]
    seq_len, hp = seq * mesh.sp, mesh.hp
    taps = conv_weight.shape[1] if conv_weight is not None else 1
    layout, starts, visible = _MASKS(_masks, cu_seqlens, chunk_order, batch, seq_len, hp, mesh.cp, mesh.cp_rank,
                                     taps)  # [B, S/cp] and [B, S/cp, taps] in local order
    entering = effective_kv_heads(num_value_heads, num_key_heads, hp)
    if entering > num_key_heads:  # each head rank needs its value heads' key head: replicate (grads sum back)
        q, k = (x.repeat_interleave(entering // num_key_heads, dim=2) for x in (q, k))
    q, k, v, g, beta = _scatter_heads((q, k, v, g, beta), mesh)  # [B, S/cp, local heads * ...]
    local_keys, local_values = entering // hp, num_value_heads // hp
    runs = _local_runs(layout, mesh.cp_rank)  # (offset, length) of each run in local order
    mixed = torch.cat([q, k, v], dim=-1)  # [B, S/cp, C]
    if conv_weight is not None:
        channels = _local_channels(num_key_heads, entering, key_dim, num_value_heads, value_dim, mesh.hp_rank, hp)
        channels = channels.to(q.device)
        halo = _halo(mixed, runs, layout, mesh, taps)  # [B, slots, taps - 1, C]
        weight, visible = conv_weight[channels], visible.to(q.device)
        mixed = torch.cat([short_conv(torch.cat([halo[:, s], mixed[:, o:o + n]], dim=1), weight, None,
                                      visible[:, o:o + n], "silu") for s, (o, n) in enumerate(runs)], dim=1)
    q, k, v = mixed.split([local_keys * key_dim, local_keys * key_dim, local_values * value_dim], dim=-1)
    q, k = (x.unflatten(-1, (local_keys, key_dim)) for x in (q, k))
    v = v.unflatten(-1, (local_values, value_dim))
    q, k = (l2_normalize(x.to(compute_dtype(x.dtype))) for x in (q, k))
    if local_values > local_keys:  # grouped value heads: value head m reads key head m // (values / keys)
        q, k = (x.repeat_interleave(local_values // local_keys, dim=2) for x in (q, k))
    if g.shape[-1] != local_values:  # a gate per channel
        g = g.unflatten(-1, (local_values, key_dim))
    out = _recurrence((q, k, v, g, beta), None if starts is None else starts.to(q.device), runs, layout, mesh,
                      key_dim ** -0.5)
    out = out.to(v.dtype)  # [B, S/cp, Hv/hp, Dv] in local order
    if hp > 1:
        out = attn_ops.head_all_to_all(out.contiguous(), mesh.hp_group.group_name, 1, 2)
    return out


def validate_linear_inputs(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, mesh: Mesh, *,
                           conv_weight: Tensor | None = None) -> None:
    """Raise ValueError (before any communication) unless the tensors of a :func:`linear_attention` call fit each
    other and ``mesh``, naming the offending shape."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 4 or not t.is_floating_point():
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"linear attention: {name} must be a floating [batch, seq, heads, head_dim] tensor; "
                             f"got {got}")
    if q.shape != k.shape or q.dtype != k.dtype or v.dtype != q.dtype or v.shape[:2] != q.shape[:2]:
        raise ValueError(f"linear attention: q {tuple(q.shape)} and k {tuple(k.shape)} must be equal, v "
                         f"{tuple(v.shape)} of the same batch and length, all of one dtype ({q.dtype}, {k.dtype}, "
                         f"{v.dtype})")
    batch, seq, hk, dk = q.shape
    hv = v.shape[2]
    if hv % hk:
        raise ValueError(f"linear attention: {hv} value heads must be a multiple of the {hk} key heads")
    gate_shapes = ((batch, seq, hv), (batch, seq, hv, dk))
    if not isinstance(g, Tensor) or tuple(g.shape) not in gate_shapes or not g.is_floating_point():
        raise ValueError(f"linear attention: g must be [batch, seq, value heads] (a gate per head) or [batch, seq, "
                         f"value heads, key dim] (a gate per channel), {gate_shapes}; got "
                         f"{tuple(g.shape) if isinstance(g, Tensor) else type(g).__name__}")
    if g.dim() == 4 and hv != hk:
        raise ValueError(f"linear attention: a gate per channel (KDA) needs as many key heads as value heads; got "
                         f"{hk} and {hv}")
    if not isinstance(beta, Tensor) or tuple(beta.shape) != (batch, seq, hv):
        raise ValueError(f"linear attention: beta must be [batch, seq, value heads] = {(batch, seq, hv)}; got "
                         f"{tuple(beta.shape) if isinstance(beta, Tensor) else type(beta).__name__}")
    channels = 2 * hk * dk + hv * v.shape[3]
    if conv_weight is not None and (conv_weight.dim() != 2 or conv_weight.shape[0] != channels
                                    or conv_weight.shape[1] < 1):
        raise ValueError(f"linear attention: conv_weight must be [channels of cat(q, k, v) = {channels}, kernel "
                         f"size]; got {tuple(conv_weight.shape)}")
    try:
        effective_kv_heads(hv, hk, mesh.hp)
    except ValueError as exc:
        raise ValueError(f"linear attention ({hv} value heads as num_heads, {hk} key heads as num_kv_heads): "
                         f"{exc}") from None
    validate_parallel(ParallelConfig.from_layout(mesh.layout), seq_len=seq * mesh.sp)


_MASKS: LastCall[tuple[RunLayout, Tensor | None, Tensor]] = LastCall()


def _masks(cu_seqlens: CuSeqlens | None, chunk_order: Sequence[int] | Tensor | None, batch: int, seq_len: int,
           hp: int, cp: int, cp_rank: int, taps: int) -> tuple[RunLayout, Tensor | None, Tensor]:
    """The rank's runs, document starts and convolution visibility (once per step: layers share the objects)."""
    rows = normalize_cu_seqlens(cu_seqlens, batch, seq_len)
    order = None
    if chunk_order is not None:
        order = tuple(int(x) for x in (chunk_order.tolist() if isinstance(chunk_order, Tensor) else chunk_order))
        check_chunk_order(order, seq_len, hp, cp)
    layout = RunLayout(seq_len, cp, order)
    starts, visible = document_masks(rows, batch, local_positions(layout, cp_rank), taps)
    return layout, starts, visible


def _scatter_heads(tensors: Sequence[Tensor], mesh: Mesh) -> list[Tensor]:
    """``[B, S/sp, heads, ...]`` each -> ``[B, S/cp, heads/hp * ...]``: one all-to-all per dtype over the head
    group (heads split contiguously, the sequence gathered in head-rank order)."""
    batch, seq = tensors[0].shape[:2]
    parts = [t.reshape(batch, seq, mesh.hp, -1) for t in tensors]
    if mesh.hp == 1:
        return [p.squeeze(2) for p in parts]
    out: list[Tensor | None] = [None] * len(parts)
    for dtype in dict.fromkeys(p.dtype for p in parts):
        mine = [i for i, p in enumerate(parts) if p.dtype == dtype]
        widths = [parts[i].shape[-1] for i in mine]
        packed = torch.cat([parts[i] for i in mine], dim=3)
        gathered = attn_ops.head_all_to_all(packed, mesh.hp_group.group_name, 2, 1).squeeze(2)
        for i, piece in zip(mine, gathered.split(widths, dim=-1)):
            out[i] = piece
    return out  # type: ignore[return-value]


def _local_runs(layout: RunLayout, cp_rank: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of each of the rank's runs in its local token order (runs are contiguous there)."""
    runs, offset = [], 0
    for _, length in layout.runs(cp_rank):
        runs.append((offset, length))
        offset += length
    return runs


def _local_channels(num_key_heads: int, entering: int, key_dim: int, num_value_heads: int, value_dim: int,
                    hp_rank: int, hp: int) -> Tensor:
    """The channels of ``cat(q, k, v)`` this head rank holds after the all-to-all, in its order."""
    per_rank = entering // hp
    keys = [(h * num_key_heads) // entering for h in range(hp_rank * per_rank, (hp_rank + 1) * per_rank)]
    values = range(hp_rank * num_value_heads // hp, (hp_rank + 1) * num_value_heads // hp)
    key_channels = [c for h in keys for c in range(h * key_dim, (h + 1) * key_dim)]
    offset = num_key_heads * key_dim
    value_channels = [2 * offset + c for h in values for c in range(h * value_dim, (h + 1) * value_dim)]
    return torch.tensor(key_channels + [offset + c for c in key_channels] + value_channels, dtype=torch.int64)


def _halo(mixed: Tensor, runs: list[tuple[int, int]], layout: RunLayout, mesh: Mesh, taps: int) -> Tensor:
    """``[B, slots, taps - 1, C]``: the inputs before each run's first token, from the runs of every context
    rank (one gather of every rank's run tails, each aligned to its run's end); zeros before the sequence."""
    width = taps - 1
    batch, _, channels = mixed.shape
    tails = mixed.new_zeros(batch, layout.slots, width, channels)
    for s, (offset, length) in enumerate(runs):
        kept = min(width, length)
        tails[:, s, width - kept:] = mixed[:, offset + length - kept: offset + length]
    if mesh.cp > 1:
        gathered = context_all_gather(tails, mesh.cp_group.group_name, "halo")
        tails = gathered[_group_to_ring(mesh)].transpose(0, 1)  # [B, cp, slots, width, C] in cp_rank order
    flat = torch.cat([tails.reshape(batch, -1, channels), tails.new_zeros(batch, 1, channels)], dim=1)
    return flat[:, layout.halo_index(mesh.cp_rank, taps).to(mixed.device)]


def _group_to_ring(mesh: Mesh) -> Tensor:
    """Indices that reorder a gather over ``cp_group`` (sorted global ranks) into cp_rank order."""
    ring = mesh.ring_ranks
    ordered = sorted(ring)
    return torch.tensor([ordered.index(r) for r in ring], dtype=torch.int64)


def _recurrence(inputs: tuple[Tensor, ...], starts: Tensor | None, runs: list[tuple[int, int]], layout: RunLayout,
                mesh: Mesh, scale: float) -> Tensor:
    """The output ``[B, S/cp, H, Dv]`` of every run from its exact initial state (``inputs``: q, k, v, g, beta).
    Each run is computed from a zero state together with its transition (the value width widened by ``Dk`` columns
    that start as the identity: their final state is the transition, their output the queries read through it);
    the runs' pairs are gathered over the context group and composed in sequence order."""
    q, k, v, g, beta = inputs
    batch, dk, dv = q.shape[0], k.shape[-1], v.shape[-1]
    if not layout.any_state:  # one run from position 0: nothing to compose
        return run_kernel(q, k, v, g, beta, starts, None, scale)[0]
    heads = v.shape[2]
    v = torch.cat([v, v.new_zeros((*v.shape[:-1], dk))], dim=-1)
    identity = torch.eye(dk, dtype=compute_dtype(v.dtype), device=v.device)
    outs, finals = _by_length(q, k, v, g, beta, starts, runs, identity, scale)
    final = torch.stack(finals + [finals[0].new_zeros(finals[0].shape)] * (layout.slots - len(runs)), dim=1)
    pairs = final.unsqueeze(0)  # [cp, B, slots, H, Dk, Dv + Dk]: written state, transition
    if mesh.cp > 1:
        pairs = context_all_gather(final, mesh.cp_group.group_name, "state")[_group_to_ring(mesh)]
    state = final.new_zeros(batch, heads, dk, dv)
    initial: dict[int, Tensor] = {}
    for c, s in layout.sequence:
        if c == mesh.cp_rank:
            initial[s] = state
            if len(initial) == len(runs):
                break
        state = pairs[c, :, s, ..., dv:] @ state + pairs[c, :, s, ..., :dv]
    return torch.cat([out[..., :dv] + torch.einsum("bthk,bhkv->bthv", out[..., dv:], initial[s])
                      for s, out in enumerate(outs)], dim=1)


def _by_length(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, starts: Tensor | None,
               runs: list[tuple[int, int]], identity: Tensor, scale: float) -> tuple[list[Tensor], list[Tensor]]:
    """Each run's widened output ``[B, L, H, Dv + Dk]`` and final state ``[B, H, Dk, Dv + Dk]`` from ``[0 | I]``,
    one kernel call per distinct run length (the runs of that length batched; nothing padded)."""
    outs: list[Tensor | None] = [None] * len(runs)
    finals: list[Tensor | None] = [None] * len(runs)
    batch, heads, dk = q.shape[0], v.shape[2], identity.shape[0]
    for length in sorted({n for _, n in runs}):
        chosen = [i for i, (_, n) in enumerate(runs) if n == length]
        offsets = [runs[i][0] for i in chosen]
        picked = [None if x is None else torch.cat([x[:, o:o + length] for o in offsets])
                  for x in (q, k, v, g, beta, starts)]
        initial = torch.cat([identity.new_zeros(dk, v.shape[-1] - dk), identity], dim=-1)
        out, final = run_kernel(*picked, initial.expand(len(chosen) * batch, heads, dk, -1), scale)
        for j, i in enumerate(chosen):
            outs[i], finals[i] = out[j * batch:(j + 1) * batch], final[j * batch:(j + 1) * batch]
    return outs, finals  # type: ignore[return-value]
