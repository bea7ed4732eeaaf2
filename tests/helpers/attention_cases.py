"""Shared per-rank bodies for the distributed attention tests (importable by spawned workers)."""

from __future__ import annotations

import itertools

import torch

import loongtrain
from loongtrain.attn.kernels import reference_forward
from loongtrain.parallel.config import effective_kv_heads


def factorisations(world_size: int) -> list[tuple[int, int]]:
    """All (hp, cp) with hp*cp dividing world_size."""
    return [(hp, cp) for hp in range(1, world_size + 1) for cp in range(1, world_size + 1)
            if world_size % (hp * cp) == 0]


def full_inputs(seed: int, batch: int, seq: int, num_heads: int, num_kv_heads: int, head_dim: int,
                dtype: torch.dtype, v_head_dim: int | None = None) -> tuple[torch.Tensor, ...]:
    """q, k, v, dout ``[B, S, heads, D]``; v and dout with ``v_head_dim`` when given (MLA)."""
    g = torch.Generator().manual_seed(seed)
    v_head_dim = v_head_dim or head_dim
    q = torch.randn(batch, seq, num_heads, head_dim, generator=g, dtype=torch.float64)
    k = torch.randn(batch, seq, num_kv_heads, head_dim, generator=g, dtype=torch.float64)
    v = torch.randn(batch, seq, num_kv_heads, v_head_dim, generator=g, dtype=torch.float64)
    dout = torch.randn(batch, seq, num_heads, v_head_dim, generator=g, dtype=torch.float64)
    return tuple(t.to(dtype) for t in (q, k, v, dout))


def reference(q, k, v, dout, causal: bool, dtype: torch.dtype):
    """Unsharded attention and its input gradients computed in ``dtype`` with plain math."""
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    scale = q.shape[-1] ** -0.5
    out, _ = reference_forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal, scale)
    out = out.transpose(1, 2)
    grads = torch.autograd.grad(out, (q, k, v), dout.to(dtype))
    return (out.detach(), *grads)


def sharded(mesh, q, k, v, dout, causal: bool):
    """loongtrain.attention on this rank's shards; returns out, dq, dk, dv shards."""
    qs, ks, vs = (loongtrain.shard_sequence(t, mesh, 1).requires_grad_() for t in (q, k, v))
    out = loongtrain.attention(qs, ks, vs, mesh, causal=causal)
    grads = torch.autograd.grad(out, (qs, ks, vs), loongtrain.shard_sequence(dout, mesh, 1))
    return (out.detach(), *grads)


def max_errors(mesh, got, want) -> list[float]:
    return [(g.double() - loongtrain.shard_sequence(w, mesh, 1).double()).abs().max().item()
            for g, w in zip(got, want)]


def gqa_ok(num_heads: int, num_kv_heads: int, hp: int) -> bool:
    """Whether the heads satisfy the GQA rule on ``hp`` head ranks (the library's one rule)."""
    try:
        effective_kv_heads(num_heads, num_kv_heads, hp)
    except ValueError:
        return False
    return True


def check_exact(rank: int, world_size: int, configs: list[dict], heads: list[tuple[int, int]],
                head_dims: list[int], dtype_name: str, tol: float) -> int:
    """For every config x heads x head_dim x causal: sharded == unsharded within ``tol``. A ``head_dims`` entry
    ``(D, Dv)``: Q/K and V head dims (MLA)."""
    dtype = getattr(torch, dtype_name)
    checked = 0
    for cfg in configs:
        mesh = loongtrain.init_mesh(**cfg)
        for (num_heads, num_kv_heads), dims, causal in itertools.product(heads, head_dims, (True, False)):
            if not gqa_ok(num_heads, num_kv_heads, mesh.hp):
                continue
            head_dim, v_head_dim = dims if isinstance(dims, (tuple, list)) else (dims, dims)
            batch, seq = 2, 4 * mesh.hp * mesh.cp
            inputs = full_inputs(100 + mesh.dp_rank, batch, seq, num_heads, num_kv_heads, head_dim, dtype,
                                 v_head_dim)
            want = reference(*inputs, causal, torch.float64)
            got = sharded(mesh, *inputs, causal)
            errs = max_errors(mesh, got, want)
            assert max(errs) < tol, (cfg, num_heads, num_kv_heads, head_dim, causal, dtype_name, errs)
            checked += 1
    return checked


def check_shard_gather(rank: int, world_size: int, configs: list[dict]) -> int:
    """gather_sequence(shard_sequence(x)) == x on every rank, on any dim, and its gradient is exact."""
    for cfg in configs:
        mesh = loongtrain.init_mesh(**cfg)
        seq = 2 * mesh.hp * mesh.cp * 3
        x = torch.randn(2, seq, 3, generator=torch.Generator().manual_seed(mesh.dp_rank), dtype=torch.float64)
        local = loongtrain.shard_sequence(x, mesh, 1)
        assert local.shape == (2, seq // mesh.sp, 3)
        assert torch.equal(loongtrain.gather_sequence(local, mesh, 1), x)
        xt = x.transpose(0, 1).contiguous()
        assert torch.equal(loongtrain.gather_sequence(loongtrain.shard_sequence(xt, mesh, 0), mesh, 0), xt)
        # every rank uses the gathered tensor: d/dx_local of sum_r <w_r, gather(x)> = sum_r w_r, sharded
        local = local.clone().requires_grad_()
        w = torch.full_like(x, float(mesh.sp_rank + 1))
        (grad,) = torch.autograd.grad((loongtrain.gather_sequence(local, mesh, 1) * w).sum(), local)
        total = sum(range(1, mesh.sp + 1))
        assert torch.allclose(grad, torch.full_like(grad, float(total)))
    return len(configs)


def count_comm(rank: int, world_size: int, configs: list[dict], shape: dict, dtype_name: str,
               sliding_window: int | None = None) -> list[dict]:
    """Per config: ops and bytes-by-kind-and-peer this rank sent, forward and forward+backward."""
    from loongtrain.parallel.comm import CommCounter

    dtype = getattr(torch, dtype_name)
    results = []
    for cfg in configs:
        mesh = loongtrain.init_mesh(**cfg)
        q, k, v, dout = full_inputs(0, shape["batch"], shape["seq_len"], shape["num_heads"],
                                    shape["num_kv_heads"], shape["head_dim"], dtype)
        qs, ks, vs = (loongtrain.shard_sequence(t, mesh, 1).requires_grad_() for t in (q, k, v))
        with CommCounter() as fwd:
            out = loongtrain.attention(qs, ks, vs, mesh, sliding_window=sliding_window)
        with CommCounter() as bwd:
            out.backward(loongtrain.shard_sequence(dout, mesh, 1))
        results.append({"fwd": fwd, "bwd": bwd})
    return results


def check_documents(rank: int, world_size: int, configs: list[dict], heads: list[tuple[int, int]],
                    windows: list, tol: float, balanced: bool = False, head_dims: tuple[int, int] = (8, 8)) -> int:
    """loongtrain.attention with cu_seqlens / sliding_window equals the dense masked reference (fp64);
    ``balanced``: tokens laid out by balanced_chunk_order (shard/gather round trip checked too); ``head_dims``:
    Q/K's and V's (MLA when they differ)."""
    import random

    from loongtrain.attn.masking import AttnMask, dense_mask
    from loongtrain.parallel.documents import balanced_chunk_order

    checked = 0
    for cfg in configs:
        mesh = loongtrain.init_mesh(**cfg)
        seq = 12 * mesh.hp * mesh.cp
        rng = random.Random(seq + mesh.dp_rank)  # identical on the ranks of a replica
        docs = [[0], [0]]
        for row in docs:
            while row[-1] < seq:
                row.append(min(seq, row[-1] + rng.randint(1, seq // 2)))
        for (num_heads, num_kv_heads), window, causal in itertools.product(heads, windows, (True, False)):
            if not gqa_ok(num_heads, num_kv_heads, mesh.hp):
                continue
            sliding = window(seq, mesh.cp) if callable(window) else window
            inputs = full_inputs(7 + mesh.dp_rank, 2, seq, num_heads, num_kv_heads, head_dims[0], torch.float64,
                                 head_dims[1])
            mask = AttnMask(causal, sliding, tuple(tuple(r) for r in docs))
            q, k, v, dout = inputs
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            outs = []
            for b in range(2):
                o, _ = reference_forward(*(t[b : b + 1].transpose(1, 2) for t in leaves), False,
                                         q.shape[-1] ** -0.5, dense_mask(seq, mask, b))
                outs.append(o.transpose(1, 2))
            out = torch.cat(outs)
            want = (out.detach(), *torch.autograd.grad(out, leaves, dout))
            order = balanced_chunk_order(docs, seq, mesh.cp, mesh.hp, chunks_per_rank=3) if balanced else None
            qs, ks, vs = (loongtrain.shard_sequence(t, mesh, 1, order).requires_grad_() for t in (q, k, v))
            got_out = loongtrain.attention(qs, ks, vs, mesh, causal=causal, cu_seqlens=[torch.tensor(r) for r in docs],
                                           sliding_window=sliding, chunk_order=order)
            got = (got_out.detach(), *torch.autograd.grad(got_out, (qs, ks, vs),
                                                          loongtrain.shard_sequence(dout, mesh, 1, order)))
            if balanced:
                errs = [(loongtrain.gather_sequence(g, mesh, 1, order) - w).abs().max().item()
                        for g, w in zip(got, want)]
                assert torch.equal(loongtrain.gather_sequence(qs.detach(), mesh, 1, order), q)
            else:
                errs = max_errors(mesh, got, want)
            assert max(errs) < tol, (cfg, num_heads, num_kv_heads, sliding, causal, errs)
            checked += 1
    return checked
