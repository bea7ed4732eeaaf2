"""Packed documents through the CUDA kernels' variable-length ops (docs/attention.md), without a GPU:
the in-process ring with ``cuda_flash`` over a CPU emulation of ``_flash_attention_forward/_backward``, and
with ``cuda_cudnn`` over one of cuDNN's ragged ``_cudnn_attention_forward/_backward``
(tests/helpers/cuda_emulation.py), is exact in fp64 against a dense masked reference; a step packs its pieces into
one varlen call per causal flag instead of a dense call per piece, covering exactly the visible pairs (only
squares in a causal call where the op aligns masks top-left, as cuDNN's); the planted varlen faults are
caught; the real flash ops' meta registrations give the layouts the wrappers assume (cuDNN's ragged op has
none in torch 2.13)."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from loongtrain.attn.cuda_kernels import CUDA_CUDNN, CUDA_FLASH
from loongtrain.attn.kernels import Seqlens, VarlenMask, reference_forward
from loongtrain.attn.masking import AttnMask, dense_mask, piece_mask
from loongtrain.attn.ring import RingCall, local_ring_backward, local_ring_forward
from loongtrain.attn.ring_step import Pieces, plan_step, varlen_flag
from loongtrain.parallel.zigzag import shard_indices
from tests.helpers.counting import counted_reads
from tests.helpers.cuda_emulation import VARLEN_FAULTS

CHUNK, HEAD_DIM = 6, 8
DENSE_ONLY = dataclasses.replace(CUDA_FLASH, varlen_forward=None, varlen_backward=None)
VARLEN, DENSE = "_flash_attention_forward", "_scaled_dot_product_flash_attention"
RAGGED, CUDNN_DENSE = "_cudnn_attention_forward", "_scaled_dot_product_cudnn_attention"


def layouts(seq: int, seed: int) -> tuple[tuple[int, ...], ...]:
    """One batch row each: many tiny documents, length-1 documents, unaligned edges, one spanning all."""
    rng = random.Random(seed)
    tiny, pos = [0], 0
    while pos < seq:
        pos = min(seq, pos + rng.randint(1, 3))
        tiny.append(pos)
    ones = sorted({0, 1, 2, 3, CHUNK + 1, CHUNK + 2, seq - 1, seq} & set(range(seq + 1)))
    unaligned = sorted({0, 1, CHUNK + 1, seq - 2, seq} & set(range(seq + 1)))
    return tuple(tiny), tuple(ones), tuple(unaligned), (0, seq)


def inputs(batch: int, seq: int, heads: int, kv_heads: int, dtype=torch.float64, seed: int = 0,
           v_head_dim: int = HEAD_DIM):
    """q, k, v, dout ``[B, S, H, D]`` (the ring gets transposed views of their shards); v and dout with
    ``v_head_dim`` (MLA)."""
    g = torch.Generator().manual_seed(seed)
    shapes = ((heads, HEAD_DIM), (kv_heads, HEAD_DIM), (kv_heads, v_head_dim), (heads, v_head_dim))
    return [torch.randn(batch, seq, h, d, generator=g, dtype=torch.float64).to(dtype) for h, d in shapes]


def dense_reference(q, k, v, dout, mask: AttnMask):
    """out, lse, dq, dk, dv ``[B, H, S, ...]`` of each batch row under its dense ``[S, S]`` mask (fp64)."""
    leaves = [t.double().transpose(1, 2).clone().requires_grad_() for t in (q, k, v)]
    rows = [reference_forward(*(t[b:b + 1] for t in leaves), False, HEAD_DIM ** -0.5,
                              dense_mask(q.shape[1], mask, b)) for b in range(q.shape[0])]
    out, lse = torch.cat([o for o, _ in rows]), torch.cat([m for _, m in rows])
    return (out.detach(), lse.detach(), *torch.autograd.grad(out, leaves, dout.double().transpose(1, 2)))


def run_ring(q, k, v, dout, cp: int, inner_ring: int, mask: AttnMask, kernel=CUDA_FLASH):
    """The in-process ring on zigzag shards; out, lse, dq, dk, dv unsharded to ``[B, H, S, ...]``."""
    idx = [shard_indices(q.shape[1], 1, cp, c, 0) for c in range(cp)]
    qs, ks, vs, douts = ([t[:, i].transpose(1, 2) for i in idx] for t in (q, k, v, dout))
    res = local_ring_forward(qs, ks, vs, inner_ring, RingCall(mask, HEAD_DIM ** -0.5, kernel))
    outs, lses = [o for o, _ in res], [m for _, m in res]
    grads = local_ring_backward(douts, qs, ks, vs, outs, lses, inner_ring, RingCall(mask, HEAD_DIM ** -0.5, kernel))
    order = torch.cat(idx)

    def unshard(parts):
        cat = torch.cat(parts, dim=2)
        full = torch.empty_like(cat)
        full[:, :, order] = cat
        return full

    lse = unshard([m.unsqueeze(-1) for m in lses]).squeeze(-1)
    return (unshard(outs), lse, *(unshard(list(p)) for p in zip(*grads)))


def plans(mask: AttnMask, cp: int, batch: int, seq: int) -> list:
    """The step plans of every (member, source) pair, as the ring with ``cuda_flash`` makes them."""
    return [plan_step(Pieces(mask, batch, seq // cp, cp, p)(src), batch, torch.device("cpu"), True)
            for p in range(cp) for src in range(cp)]


def assert_close(got, want, tol: float) -> None:
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert g.shape == w.shape, (name, g.shape, w.shape)
        err = (g.double() - w).abs().max().item()
        assert err < tol, f"{name}: not close ({err:.2e})"


# ---------------------------------------------------------------- exactness (fp64 emulation)


@pytest.mark.parametrize("cp, inner_ring", [(1, 1), (2, 1), (4, 1), (4, 2)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("sliding", [None, 3, CHUNK + 2])  # 3: smaller than a chunk
def test_ring_with_varlen_calls_is_exact(emulate, cp, inner_ring, causal, sliding):
    ops = emulate(allow_fp64=True)
    seq = 2 * CHUNK * cp
    docs = layouts(seq, seed=cp + inner_ring)
    mask = AttnMask(causal, sliding, docs, 16 if sliding == CHUNK + 2 else 0)  # 16: some masked pieces too
    kv_heads = 2 if (cp + inner_ring + causal) % 2 else 1  # GQA and MQA
    q, k, v, dout = inputs(len(docs), seq, 4, kv_heads, seed=cp)
    assert_close(run_ring(q, k, v, dout, cp, inner_ring, mask), dense_reference(q, k, v, dout, mask), 1e-10)
    assert VARLEN in ops.calls and "_flash_attention_backward" in ops.calls
    if sliding is not None:  # pieces sharing query rows: the forward merges them in several rounds
        assert max(len(call.rounds) for call in plans(mask, cp, len(docs), seq) for call in call.varlen) > 1


@pytest.mark.parametrize("cp, inner_ring, causal, sliding", [(1, 1, True, None), (2, 1, True, None), (4, 2, True, 3),
                                                        (4, 1, False, None), (2, 1, True, CHUNK + 2)])
def test_ring_with_cudnn_ragged_calls_is_exact(emulate, cp, inner_ring, causal, sliding):
    """cuDNN's ragged op aligns causal masks top-left: the ring packs only squares into its causal calls."""
    ops = emulate(allow_fp64=True)
    seq = 2 * CHUNK * cp
    docs = layouts(seq, seed=cp + inner_ring + 7)
    mask = AttnMask(causal, sliding, docs, 16 if sliding == CHUNK + 2 else 0)
    q, k, v, dout = inputs(len(docs), seq, 4, 2, seed=cp + 1)
    assert_close(run_ring(q, k, v, dout, cp, inner_ring, mask, CUDA_CUDNN), dense_reference(q, k, v, dout, mask), 1e-10)
    assert RAGGED in ops.calls and "_cudnn_attention_backward" in ops.calls and VARLEN not in ops.calls


@pytest.mark.parametrize("kernel, varlen_op", [(CUDA_FLASH, VARLEN), (CUDA_CUDNN, RAGGED)], ids=["flash", "cudnn"])
@pytest.mark.parametrize("v_head_dim", [4, 16])
def test_ring_with_varlen_calls_and_another_v_head_dim_is_exact(emulate, kernel, varlen_op, v_head_dim):
    """MLA (V's head dim not Q/K's): the varlen and dense ops, which need one head dim, get V (or Q/K) zero-padded
    to the wider, exactly (docs/attention.md#mla)."""
    ops = emulate(allow_fp64=True)
    seq = 2 * CHUNK * 4
    docs = layouts(seq, seed=v_head_dim)
    mask = AttnMask(True, None, docs)
    q, k, v, dout = inputs(len(docs), seq, 4, 2, seed=v_head_dim, v_head_dim=v_head_dim)
    assert_close(run_ring(q, k, v, dout, 4, 2, mask, kernel), dense_reference(q, k, v, dout, mask), 1e-10)
    assert varlen_op in ops.calls


def test_varlen_in_device_dtypes(emulate):
    """With the real op's dtype rules (bf16, lse fp32): within bf16 rounding of fp64 math."""
    emulate(allow_fp64=False)
    cp, seq = 2, 4 * CHUNK
    docs = layouts(seq, seed=3)
    q, k, v, dout = inputs(len(docs), seq, 4, 2, dtype=torch.bfloat16, seed=3)
    mask = AttnMask(True, None, docs, 0)
    got = run_ring(q, k, v, dout, cp, 1, mask)
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.float32
    assert_close(got, dense_reference(q, k, v, dout, mask), 5e-2)


# ---------------------------------------------------------------- one varlen call instead of a call per piece


def test_many_short_documents_make_one_varlen_call(emulate):
    ops = emulate(allow_fp64=True)
    seq = 2 * CHUNK * 2
    docs = (layouts(seq, seed=1)[0],)
    q, k, v, dout = inputs(1, seq, 4, 2, seed=1)
    pieces = Pieces(AttnMask(True, None, docs, 0), 1, seq, 1, 0)(0)  # cp 1: the own block
    assert len(pieces) == len(docs[0]) - 1 >= 6 and {p.kind for _, p in pieces} == {"causal", "full"}
    assert {varlen_flag(p) for _, p in pieces} == {True}  # causal squares, and 1 x 1 (length-1 documents)
    singles = sum(p.kind == "full" for _, p in pieces)  # length-1 documents: top-left causal would hide their keys
    top_left = +Counter({RAGGED: 1 + (singles > 1), CUDNN_DENSE: int(singles == 1)})
    for kernel, want in ((CUDA_FLASH, {VARLEN: 1}), (DENSE_ONLY, {DENSE: len(pieces)}), (CUDA_CUDNN, top_left)):
        ops.calls.clear()
        run_ring(q, k, v, dout, 1, 1, AttnMask(True, None, docs, 0), kernel)
        forward = Counter(c for c in ops.calls if "backward" not in c)
        backward = Counter(c for c in ops.calls if "backward" in c)
        assert forward == want and sum(backward.values()) == sum(want.values()), ops.calls


@pytest.mark.parametrize("causal", [True, False])
def test_call_counts_follow_the_plan(emulate, causal):
    """Across a ring pass: one varlen call per causal flag with two or more pieces, a dense call for a
    lone piece, the reference for masked pieces (not an op call); far fewer calls than one per piece."""
    ops = emulate(allow_fp64=True)
    cp, seq = 4, 2 * CHUNK * 4
    docs = layouts(seq, seed=5)[:2]
    mask = AttnMask(causal, None, docs, 0)
    want = Counter()
    for plan in plans(mask, cp, len(docs), seq):
        want[VARLEN] += len(plan.varlen)
        want[DENSE] += sum(piece.kind != "masked" for _, piece in plan.dense)
    pieces = sum(len(Pieces(mask, len(docs), seq // cp, cp, p)(src)) for p in range(cp) for src in range(cp))
    q, k, v, dout = inputs(len(docs), seq, 4, 2, seed=5)
    run_ring(q, k, v, dout, cp, 1, mask)
    assert Counter(c for c in ops.calls if "backward" not in c) == +want
    assert sum(want.values()) * 2 < pieces, (want, pieces)


def _covered(plan, batch: int, rows: int, cols: int, band) -> torch.Tensor:
    """How often each (batch row, query, key) is computed by the plan's calls."""
    count = torch.zeros(batch, rows, cols, dtype=torch.long)
    for sl, p in plan.dense:
        sub = torch.ones(p.r1 - p.r0, p.c1 - p.c0, dtype=torch.bool)
        sub = {"full": sub, "causal": sub.tril(), "anticausal": sub.triu()}.get(p.kind, None)
        count[sl, p.r0:p.r1, p.c0:p.c1] += (piece_mask(p, band, "cpu") if sub is None else sub).long()
    for call in plan.varlen:
        cu_q, cu_k = call.cu_q.tolist(), call.cu_k.tolist()
        for a, b, c, d in zip(cu_q, cu_q[1:], cu_k, cu_k[1:]):
            assert b - a <= call.max_q and d - c <= call.max_k
            seen = torch.ones(b - a, d - c, dtype=torch.bool)
            if call.causal:  # bottom-right, as the op aligns it
                seen = seen.tril(diagonal=(d - c) - (b - a))
            qi, ki = torch.nonzero(seen, as_tuple=True)
            assert (call.q_row[a + qi] == call.k_row[c + ki]).all()
            count.index_put_((call.q_row[a + qi], call.q_pos[a + qi], call.k_pos[c + ki]),
                             torch.ones(len(qi), dtype=torch.long), accumulate=True)
        for a, b in call.rounds:  # a round never merges a (batch row, query) twice
            flat = call.q_row[a:b] * rows + call.q_pos[a:b]
            assert flat.unique().numel() == b - a
    return count


@pytest.mark.parametrize("seed", range(12))
def test_plans_cover_exactly_the_visible_pairs(seed):
    bottom_right = seed % 3 != 0  # FA2's alignment, or top-left (cuDNN's): then causal calls are squares only
    rng = random.Random(seed)
    cp = rng.choice([1, 2, 3, 4])
    seq = 2 * cp * rng.randint(2, 7)
    docs = tuple(layouts(seq, seed)[i] for i in rng.sample(range(4), 2))
    mask = AttnMask(rng.random() < 0.6, rng.choice([None, 1, 2, 5]), docs, rng.choice([0, 16]))
    for p in range(cp):
        for src in range(cp):
            items = Pieces(mask, len(docs), seq // cp, cp, p)(src)
            plan = plan_step(items, len(docs), torch.device("cpu"), True, bottom_right)
            for call in plan.varlen:
                sizes = zip(call.cu_q.diff().tolist(), call.cu_k.diff().tolist())
                assert bottom_right or not call.causal or all(a == b for a, b in sizes)
            qi, ki = shard_indices(seq, 1, cp, p, 0), shard_indices(seq, 1, cp, src, 0)
            want = torch.stack([dense_mask(seq, mask, b)[qi][:, ki] for b in range(len(docs))]).long()
            assert torch.equal(_covered(plan, len(docs), len(qi), len(ki), mask.band()), want), (p, src)
            for flag in (False, True):  # per causal flag: one varlen call, or a lone piece as a dense call
                lone = sum(varlen_flag(x, bottom_right) is flag for _, x in plan.dense)
                assert lone + sum(call.causal is flag for call in plan.varlen) <= 1, plan


# ---------------------------------------------------------------- no device read, no blocking copy


@pytest.mark.parametrize("kernel", [CUDA_FLASH, CUDA_CUDNN], ids=lambda k: k.name)
def test_the_varlen_path_reads_nothing_from_the_device(emulate, kernel):
    """A ring pass over packed documents through the emulated varlen ops, forward and backward, reads no
    floating value back (docs/launching.md: no synchronisation inside a layer)."""
    emulate(allow_fp64=True)
    cp, seq = 2, 4 * CHUNK
    docs = layouts(seq, seed=6)[:2]
    q, k, v, dout = inputs(len(docs), seq, 4, 2, seed=6)
    with counted_reads() as reads:
        run_ring(q, k, v, dout, cp, 1, AttnMask(True, None, docs, 0), kernel)
    assert reads.count == 0


def test_a_document_mix_is_copied_to_the_device_once_without_blocking(monkeypatch):
    """Every index tensor of a varlen plan reaches the device through ``runtime.to_device`` (pinned memory,
    non-blocking on CUDA), once per document mix (the plan cache)."""
    from loongtrain.attn import ring_step as step

    copies = []

    def recording(t, device):
        copies.append((t.dtype, str(device)))
        return t

    monkeypatch.setattr(step, "to_device", recording)
    docs = ((0, 3, 5, 9, 12, 16, 4 * CHUNK),)
    items = Pieces(AttnMask(True, None, docs, 0), 1, 4 * CHUNK, 1, 0)(0)
    plan = plan_step(items, 1, torch.device("cuda", 7), True)
    assert len(plan.varlen) == 1 and len(copies) == 6  # rows and positions of q and k, cu_q, cu_k
    assert all(device == "cuda:7" for _, device in copies)
    assert plan_step(items, 1, torch.device("cuda", 7), True) is plan and len(copies) == 6  # cached


def test_to_device_pins_and_copies_without_blocking(monkeypatch):
    from loongtrain.parallel.runtime import to_device

    calls = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: calls.append("pin") or self)
    original = torch.Tensor.to

    def to(self, *args, **kwargs):
        if args and str(args[0]).startswith("cuda"):
            calls.append(("to", str(args[0]), kwargs.get("non_blocking")))
            return self
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    to_device(torch.arange(3), torch.device("cuda", 1))
    assert calls == ["pin", ("to", "cuda:1", True)]
    cpu = torch.arange(3)
    assert to_device(cpu, "cpu") is cpu and len(calls) == 2  # on the CPU: as it is


# ---------------------------------------------------------------- the wrappers alone


SEQS = {False: ([2, 3, 1, 4], [3, 2, 1, 4]), True: ([3, 1, 2], [3, 4, 2])}  # equal totals; causal: square or 1 row
SQUARES = ([3, 1, 2], [3, 1, 2])  # causal sequences both alignments agree on (cuDNN's top-left)


def packed(causal: bool, seed: int = 0, squares: bool = False):
    """Packed q, k, v, dout (``[T, H, D]``, views of wider rows: unit last-dim stride only) and int32 cu."""
    q_len, k_len = SQUARES if squares else SEQS[causal]
    g = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(sum(q_len), 4, 2 * HEAD_DIM, generator=g, dtype=torch.float64)[..., :HEAD_DIM]
               for _ in range(2))
    k, v = (torch.randn(sum(k_len), 2, HEAD_DIM, generator=g, dtype=torch.float64) for _ in range(2))
    cu = [torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32) for n in (q_len, k_len)]
    return q, k, v, dout, *cu, max(q_len), max(k_len)


def packed_reference(q, k, v, dout, cu_q, cu_k, causal: bool):
    """out, lse ``[H, Tq]``, dq, dk, dv: each sequence alone, fp64 autograd, causal aligned bottom-right."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    outs, lses = [], []
    for a, b, c, d in zip(cu_q.tolist(), cu_q.tolist()[1:], cu_k.tolist(), cu_k.tolist()[1:]):
        seen = torch.ones(b - a, d - c, dtype=torch.bool).tril(diagonal=(d - c) - (b - a)) if causal else None
        parts = (leaves[0][a:b], leaves[1][c:d], leaves[2][c:d])
        o, m = reference_forward(*(t.transpose(0, 1)[None] for t in parts), False, 0.3, seen)
        outs.append(o[0].transpose(0, 1))
        lses.append(m[0])
    out = torch.cat(outs)
    return (out.detach(), torch.cat(lses, dim=1).detach(), *torch.autograd.grad(out, leaves, dout))


@pytest.mark.parametrize("kernel, calls", [(CUDA_FLASH, [VARLEN, "_flash_attention_backward"]),
                                           (CUDA_CUDNN, [RAGGED, "_cudnn_attention_backward"])], ids=["flash", "cudnn"])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_wrappers_exact(emulate, kernel, calls, causal):
    ops = emulate(allow_fp64=True)
    q, k, v, dout, cu_q, cu_k, max_q, max_k = packed(causal, squares=not kernel.varlen_bottom_right)
    seqlens, mask = Seqlens(cu_q, cu_k, max_q, max_k), VarlenMask(causal, 0.3)
    out, lse = kernel.varlen_forward(q, k, v, seqlens, mask)
    grads = kernel.varlen_backward(dout, q, k, v, out, lse, seqlens, mask)
    assert lse.shape == (4, q.shape[0]) and ops.calls == calls
    assert_close((out, lse, *grads), packed_reference(q, k, v, dout, cu_q, cu_k, causal), 1e-10)


# ---------------------------------------------------------------- the planted faults are caught

FAULTY = [(CUDA_FLASH, f) for f in VARLEN_FAULTS if "cudnn" not in f] + [
    (CUDA_CUDNN, f) for f in VARLEN_FAULTS if "cudnn" in f or "cum_seq" in f]


@pytest.mark.parametrize("kernel, fault", FAULTY, ids=lambda x: getattr(x, "name", x))
def test_planted_varlen_fault_is_caught(emulate, kernel, fault):
    emulate(allow_fp64=True, fault=fault)
    q, k, v, dout, cu_q, cu_k, max_q, max_k = packed(False)
    seqlens, mask = Seqlens(cu_q, cu_k, max_q, max_k), VarlenMask(False, 0.3)
    out, lse = kernel.varlen_forward(q, k, v, seqlens, mask)
    grads = kernel.varlen_backward(dout, q, k, v, out, lse, seqlens, mask)
    with pytest.raises(AssertionError, match="not close"):  # by the comparison, not by a check
        assert_close((out, lse, *grads), packed_reference(q, k, v, dout, cu_q, cu_k, False), 1e-10)
    cp, seq = 2, 4 * CHUNK  # and through the ring (the swapped bounds may be caught by a check there)
    docs = ((0, 5, 9, 16, seq), (0, 2, 3, 13, seq))  # documents across chunks: non-square full pieces
    mask = AttnMask(True, None, docs, 0)
    q, k, v, dout = inputs(len(docs), seq, 4, 2, seed=4)
    with pytest.raises(AssertionError):
        assert_close(run_ring(q, k, v, dout, cp, 1, mask, kernel), dense_reference(q, k, v, dout, mask), 1e-10)


# ---------------------------------------------------------------- the real ops' layouts


@pytest.mark.parametrize("kv_heads", [4, 1])
def test_real_varlen_ops_on_fake_cuda_tensors(kv_heads):
    """torch's meta registrations of the real ops: out ``[Tq, H, D]`` in the input dtype, lse fp32
    ``[H, Tq]``, gradients shaped like their inputs."""
    with FakeTensorMode():
        q = torch.empty(10, 4, 64, dtype=torch.bfloat16, device="cuda")
        k, v = (torch.empty(12, kv_heads, 64, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        cu_q, cu_k = (torch.empty(3, dtype=torch.int32, device="cuda") for _ in range(2))
        out, lse = CUDA_FLASH.varlen_forward(q, k, v, Seqlens(cu_q, cu_k, 6, 7), VarlenMask(True, 0.3))
        assert out.shape == q.shape and out.dtype == q.dtype and out.device.type == "cuda"
        assert lse.shape == (4, 10) and lse.dtype == torch.float32
        grads = CUDA_FLASH.varlen_backward(out, q, k, v, out, lse, Seqlens(cu_q, cu_k, 6, 7), VarlenMask(True, 0.3))
        assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
