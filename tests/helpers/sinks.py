"""Attention sinks (gpt-oss): an unsharded eager reference and the per-rank body of the distributed test."""

from __future__ import annotations

import itertools
import random

import torch
import torch.distributed as dist

import loongtrain
from loongtrain.attn.masking import AttnMask, dense_mask

Tensor = torch.Tensor


def sinks_reference(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, visible: Tensor) -> Tensor:
    """HF gpt-oss's eager attention, written out: ``q [B, S, H, D]``, ``k, v [B, S, Hkv, D]``, ``sinks [H]``,
    ``visible [B, S, S]`` (bool); ``softmax([q k^T / sqrt(D), sink])`` without the sink's column, times v."""
    batch, seq, heads, head_dim = q.shape
    group = heads // k.shape[2]
    k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    scores = torch.einsum("bihd,bjhd->bhij", q, k) * head_dim ** -0.5
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    logits = torch.cat([scores, sinks.view(1, heads, 1, 1).expand(batch, heads, seq, 1)], dim=-1)
    probs = torch.softmax(logits, dim=-1)[..., :-1]
    return torch.einsum("bhij,bjhd->bihd", probs, v)


def _documents(seq: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    rows = [[0], [0]]
    for row in rows:
        while row[-1] < seq:
            row.append(min(seq, row[-1] + rng.randint(1, seq // 2)))
    return rows


def check_sinks(rank: int, world_size: int, configs: list[dict], heads: list[tuple[int, int]],
                windows: list[int | None], tol: float, dtype_name: str = "float64") -> int:
    """Per config x heads x window x documents x causal: ``loongtrain.attention(..., sinks=)`` on this rank's
    shards equals :func:`sinks_reference` of the whole sequence (fp64 math on the same inputs rounded to
    ``dtype_name``), out and dq, dk, dv shards, and the sinks' gradient summed over the sequence ranks equals the
    reference's."""
    dtype = getattr(torch, dtype_name)
    checked = 0
    for cfg in configs:
        mesh = loongtrain.init_mesh(**cfg)
        seq = 12 * mesh.hp * mesh.cp
        for (num_heads, num_kv_heads), window, documents, causal in itertools.product(
                heads, windows, (False, True), (True, False)):
            if mesh.hp > num_kv_heads and mesh.hp % num_kv_heads:
                continue
            g = torch.Generator().manual_seed(11 + mesh.dp_rank)
            q = torch.randn(2, seq, num_heads, 8, generator=g, dtype=torch.float64)
            k, v = (torch.randn(2, seq, num_kv_heads, 8, generator=g, dtype=torch.float64) for _ in range(2))
            dout = torch.randn(2, seq, num_heads, 8, generator=g, dtype=torch.float64)
            sinks = torch.randn(num_heads, generator=g, dtype=torch.float64)
            q, k, v, dout, sinks = (t.to(dtype).double() for t in (q, k, v, dout, sinks))  # the inputs' rounding
            docs = _documents(seq, seq) if documents else None
            mask = AttnMask(causal, window, tuple(tuple(r) for r in docs) if docs else None)
            visible = torch.stack([dense_mask(seq, mask, b) for b in range(2)])
            leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
            out = sinks_reference(*leaves, visible)
            want = (out.detach(), *torch.autograd.grad(out, leaves, dout))

            qs, ks, vs = (loongtrain.shard_sequence(t.to(dtype), mesh, 1).requires_grad_() for t in (q, k, v))
            local_sinks = sinks.to(dtype).requires_grad_()
            cu = [torch.tensor(r) for r in docs] if docs else None
            got_out = loongtrain.attention(qs, ks, vs, mesh, causal=causal, cu_seqlens=cu, sliding_window=window,
                                           sinks=local_sinks)
            grads = torch.autograd.grad(got_out, (qs, ks, vs, local_sinks),
                                        loongtrain.shard_sequence(dout.to(dtype), mesh, 1))
            dsinks = grads[3].double()
            if mesh.sp_group is not None:
                dist.all_reduce(dsinks, group=mesh.sp_group)
            errs = [(a.double() - loongtrain.shard_sequence(b, mesh, 1)).abs().max().item()
                    for a, b in zip((got_out.detach(), *grads[:3]), want[:4])]
            errs.append((dsinks - want[4]).abs().max().item())
            assert max(errs) < tol, (cfg, num_heads, num_kv_heads, window, documents, causal, errs)
            assert want[4].abs().max() > 1e-3  # the sinks matter in this case
            checked += 1
    return checked
