"""Packed documents and sliding windows through the ring (docs/attention.md#the-ring-schedule): the in-process
executor is
exact (fp64, 1e-10, out/lse/dq/dk/dv) against a dense masked reference and against each document run
alone, for every (cp, window) up to 8; pieces cover exactly the visible pairs; invisible blocks cost no
kernel call; a short sliding window sends fewer blocks. No processes."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from loongtrain.attn.kernel_choice import select_kernel
from loongtrain.attn.kernels import Kernel, reference_forward
from loongtrain.attn.masking import AttnMask, dense_mask, member_runs, visible_pieces
from loongtrain.attn.ring import RingCall, local_ring_backward, local_ring_forward
from loongtrain.attn.short_pass import pass_reach
from loongtrain.parallel.layout import DoubleRing
from loongtrain.parallel.zigzag import shard_indices
from tests.helpers.schedule_trace import Recorder, dense_reference, planned_trace

RINGS = [(cp, w) for cp in range(1, 9) for w in range(1, cp + 1) if cp % w == 0]
CHUNK = 6


def random_docs(seq: int, rng: random.Random, max_len: int) -> tuple[int, ...]:
    """cu_seqlens with random lengths in [1, max_len] (length 1 included, edges unaligned)."""
    bounds, pos = [0], 0
    while pos < seq:
        pos = min(seq, pos + rng.randint(1, max_len))
        bounds.append(pos)
    return tuple(bounds)


def doc_layouts(cp: int, seq: int, seed: int) -> dict[str, tuple[int, ...]]:
    rng = random.Random(seed)
    per_rank = seq // cp
    return {
        "random": random_docs(seq, rng, max(2, seq // 3)),
        "tiny": random_docs(seq, rng, 3),
        "one_spanning_all": (0, seq),
        "one_per_rank": tuple(range(0, seq + 1, per_rank)),
        "unaligned": (0, 1, CHUNK + 1, seq - 2, seq) if seq > CHUNK + 3 else (0, 1, seq),
    }




def per_document_reference(q, k, v, dout, mask: AttnMask):
    """Each document of each row alone (its own unsharded attention); out, dq, dk, dv."""
    out = torch.empty_like(q)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    for b, bounds in enumerate(mask.cu_seqlens or [(0, q.shape[2])] * q.shape[0]):
        for s, e in zip(bounds, bounds[1:]):
            leaves = [t[b : b + 1, :, s:e].clone().requires_grad_() for t in (q, k, v)]
            alone = dataclasses.replace(mask, cu_seqlens=None)
            o, _ = reference_forward(*leaves, False, q.shape[-1] ** -0.5, dense_mask(e - s, alone))
            grads = torch.autograd.grad(o, leaves, dout[b : b + 1, :, s:e])
            out[b : b + 1, :, s:e] = o.detach()
            for full, g in zip((dq, dk, dv), grads):
                full[b : b + 1, :, s:e] = g
    return out, dq, dk, dv


def _inputs(cp: int, num_heads: int, num_kv_heads: int, batch: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    seq = 2 * CHUNK * cp
    shapes = [(num_heads, seq), (num_kv_heads, seq), (num_kv_heads, seq), (num_heads, seq)]
    return [torch.randn(batch, h, s, 8, generator=g, dtype=torch.float64) for h, s in shapes]


def _shard(t: torch.Tensor, cp: int, order=None) -> list[torch.Tensor]:
    return [t[:, :, shard_indices(t.shape[2], 1, cp, c, 0, order)] for c in range(cp)]


def run_ring(q, k, v, dout, cp: int, inner_ring: int, mask: AttnMask, kernel: Kernel | None = None,
             transports=None):
    """The in-process ring; returns full-sequence out, lse, dq, dk, dv (unsharded back)."""
    scale = q.shape[-1] ** -0.5
    qs, ks, vs, douts = (_shard(t, cp, mask.chunk_order) for t in (q, k, v, dout))
    fwd_t, bwd_t = transports or (None, None)
    res = local_ring_forward(qs, ks, vs, inner_ring, RingCall(mask, scale, kernel), fwd_t)
    outs, lses = [o for o, _ in res], [lse for _, lse in res]
    grads = local_ring_backward(douts, qs, ks, vs, outs, lses, inner_ring, RingCall(mask, scale, kernel), bwd_t)
    idx = torch.cat([shard_indices(q.shape[2], 1, cp, c, 0, mask.chunk_order) for c in range(cp)])

    def unshard(parts):
        cat = torch.cat(parts, dim=2)
        full = torch.empty_like(cat)
        full[:, :, idx] = cat
        return full

    return (unshard(outs), unshard([lse.unsqueeze(-1) for lse in lses]).squeeze(-1),
            *(unshard(list(p)) for p in zip(*grads)))


def _windows(cp: int) -> list[int | None]:
    seq = 2 * CHUNK * cp
    return [None, 1, CHUNK // 2, CHUNK + 2, seq // cp + 5, seq]


@pytest.mark.parametrize("cp, inner_ring", RINGS)
@pytest.mark.parametrize("causal", [True, False])
def test_ring_with_documents_and_windows_is_exact(cp, inner_ring, causal):
    seq = 2 * CHUNK * cp
    layouts = doc_layouts(cp, seq, seed=cp * 10 + inner_ring)
    heads = (4, 2) if (cp + inner_ring) % 2 else (3, 3)  # GQA and MHA (the ring never splits heads)
    q, k, v, dout = _inputs(cp, *heads, batch=len(layouts), seed=cp)
    for i, sliding in enumerate(_windows(cp)):
        tiny = (0, 64)[i % 2]  # kernel shapes only / tiny masked pieces allowed
        for docs in (tuple(layouts.values()), None) if sliding is not None else (tuple(layouts.values()),):
            mask = AttnMask(causal, sliding, docs, tiny)
            got = run_ring(q, k, v, dout, cp, inner_ring, mask)
            want = dense_reference(q, k, v, dout, mask)
            errs = [(g - w).abs().max().item() for g, w in zip(got, want)]
            assert max(errs) < 1e-10, (cp, inner_ring, causal, heads, sliding, tiny, docs, errs)
            if docs is not None and i in (0, 2):  # no window; a window shorter than a chunk
                per_doc = per_document_reference(q, k, v, dout, mask)
                for name, g, w in zip(("out", "dq", "dk", "dv"), (got[0], *got[2:]), per_doc):
                    assert (g - w).abs().max().item() < 1e-10, (name, cp, inner_ring, sliding)


def _cells(pieces, rows: int, cols: int) -> torch.Tensor:
    count = torch.zeros(rows, cols, dtype=torch.long)
    for p in pieces:
        block = torch.ones(p.r1 - p.r0, p.c1 - p.c0, dtype=torch.long)
        if p.kind == "causal":
            block = block.tril()
        elif p.kind == "anticausal":
            block = block.triu()
        count[p.r0 : p.r1, p.c0 : p.c1] += block
    return count


@pytest.mark.parametrize("seed", range(20))
def test_pieces_cover_exactly_the_visible_pairs(seed):
    rng = random.Random(seed)
    cp = rng.randint(1, 6)
    seq = 2 * cp * rng.randint(1, 9)
    docs = random_docs(seq, rng, rng.randint(1, seq))
    mask = AttnMask(rng.random() < 0.7, rng.choice([None, 1, 2, 5, seq]), (docs,), rng.choice([0, 16]))
    dense = dense_mask(seq, mask)
    for p in range(cp):
        for src in range(cp):
            q_runs, k_runs = member_runs(seq, cp, p), member_runs(seq, cp, src)
            pieces = visible_pieces(q_runs, k_runs, docs, mask.band(), mask.causal, mask.tiny)
            qi, ki = shard_indices(seq, 1, cp, p, 0), shard_indices(seq, 1, cp, src, 0)
            want = dense[qi][:, ki]
            masked = [x for x in pieces if x.kind == "masked"]
            assert all(x.cells <= mask.tiny for x in masked)
            count = _cells([x for x in pieces if x.kind != "masked"], len(qi), len(ki))
            for x in masked:
                sub = want[x.r0 : x.r1, x.c0 : x.c1]
                assert sub.any(dim=1).all() and sub.any(dim=0).all()  # trimmed: no empty row or column
                count[x.r0 : x.r1, x.c0 : x.c1] += sub.long()
            assert torch.equal(count, want.long()), (seed, p, src, pieces)
            for x in pieces:  # no piece has an invisible row or column
                sub = want[x.r0 : x.r1, x.c0 : x.c1]
                assert sub.any(dim=1).all() and sub.any(dim=0).all(), x


def test_plain_causal_is_one_kernel_call_per_block():
    for cp in range(1, 9):
        for p in range(cp):
            for src in range(cp):
                pieces = visible_pieces(member_runs(8 * cp, cp, p), member_runs(8 * cp, cp, src), None,
                                        AttnMask().band(), True, 0)
                assert len(pieces) == 1, (cp, p, src, pieces)


class _CountingKernel:
    def __init__(self, base: Kernel) -> None:
        self.calls = 0
        self.kernel = dataclasses.replace(base, forward=self._wrap(base.forward), backward=self._wrap(base.backward))

    def _wrap(self, fn):
        def counted(*args):
            self.calls += 1
            return fn(*args)

        return counted


def test_invisible_blocks_make_no_kernel_call():
    cp, heads = 4, (2, 2)
    seq = 2 * CHUNK * cp
    chunk_docs = tuple(range(0, seq + 1, CHUNK))  # one document per zigzag chunk: only the own block is visible
    q, k, v, dout = _inputs(cp, *heads, batch=1, seed=1)
    for mask, calls_per_pass in ((AttnMask(True, None, (chunk_docs,)), 2 * cp), (AttnMask(), cp * cp)):
        counter = _CountingKernel(select_kernel(q.device, q.dtype, q.shape[-1]))
        got = run_ring(q, k, v, dout, cp, 1, mask, counter.kernel)
        assert counter.calls == 2 * calls_per_pass  # forward + backward
        want = dense_reference(q, k, v, dout, mask)
        assert max((g - w).abs().max().item() for g, w in zip(got, want)) < 1e-10


# blocks a short pass sends per pass, worked out by hand: a single ring sends r each way; a double ring of
# inner rings of 2 or 4 in a ring of 8 reaches ring distance 1 (or 2) with 1 outer hop each way (one way for two
# inner rings) and at most one inner hop each way around every block it reaches (docs/attention.md#the-ring-schedule)
SHORT_HOPS = {(8, 2, 0): 0, (8, 2, 1): 5, (8, 2, 2): 5, (8, 4, 0): 0, (8, 4, 1): 5}


@pytest.mark.parametrize("cp, inner_ring", RINGS)
@pytest.mark.parametrize("sliding", [1, 2, CHUNK, CHUNK + 1, 2 * CHUNK + 1])
def test_short_window_pass_sends_fewer_blocks(cp, inner_ring, sliding):
    geometry = DoubleRing(cp // inner_ring, inner_ring)
    reach = pass_reach(geometry, CHUNK, sliding)
    r = -(-(sliding - 1) // CHUNK)
    single = inner_ring in (1, cp) or r == 0
    hops = 2 * r if single else SHORT_HOPS.get((cp, inner_ring, r), cp - 1)
    assert reach == (r if hops < cp - 1 else None), (hops, reach)
    q, k, v, dout = _inputs(cp, 2, 1, batch=2, seed=cp)
    mask = AttnMask(True, sliding, None)
    recorders = (Recorder(cp, inner_ring), Recorder(cp, inner_ring))
    base = select_kernel(q.device, q.dtype, q.shape[-1])
    got = run_ring(q, k, v, dout, cp, inner_ring, mask, base, tuple(r.transports for r in recorders))
    want = dense_reference(q, k, v, dout, mask)
    assert max((g - w).abs().max().item() for g, w in zip(got, want)) < 1e-10
    for recorder, backward in zip(recorders, (False, True)):
        planned = planned_trace(cp, inner_ring, backward, reach)
        posts = [op for op in planned if op[0] == "post"]
        full = (cp - 1) * (2 if backward else 1)
        assert len(posts) == (full if reach is None else hops * (2 if backward else 1))
        for p in range(cp):  # the executor runs exactly the planner's events (kernel calls aside)
            assert [op for who, op in recorder.log if who == p] == [op for op in planned if op[0] != "compute"]


@pytest.mark.parametrize("cu_seqlens, sliding, message", [
    (torch.tensor([1, 8, 16]), None, "must start at 0"),
    (torch.tensor([0, 8, 12]), None, "must end at the full sequence length S=16"),
    (torch.tensor([0, 8, 8, 16]), None, "must strictly increase"),
    (torch.tensor([0.0, 16.0]), None, "1-D integer tensor"),
    ([torch.tensor([0, 16])] * 2, None, "2 row"),
    (None, 0, "sliding_window=0 must be None or an integer >= 1"),
    (None, True, "sliding_window=True"),
])
def test_invalid_documents_and_windows_raise_before_communication(cu_seqlens, sliding, message):
    import loongtrain

    q = torch.randn(1, 16, 2, 8)
    with pytest.raises(ValueError, match=message):
        loongtrain.attention(q, q, q, None, cu_seqlens=cu_seqlens, sliding_window=sliding)


def test_single_process_api_matches_dense_reference():
    import loongtrain

    q, k, v, dout = (t.transpose(1, 2) for t in _inputs(1, 4, 2, batch=2, seed=3))
    docs = [torch.tensor([0, 1, 5, 12]), torch.tensor([0, 12])]
    for causal, sliding in ((True, None), (True, 3), (False, None), (False, 2)):
        mask = AttnMask(causal, sliding, tuple(tuple(d.tolist()) for d in docs))
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = loongtrain.attention(*leaves, None, causal=causal, cu_seqlens=docs, sliding_window=sliding)
        got = (out, *torch.autograd.grad(out, leaves, dout))
        want = dense_reference(*(t.transpose(1, 2) for t in (q, k, v, dout)), mask)
        for g, w in zip(got, (want[0], *want[2:])):
            assert (g - w.transpose(1, 2)).abs().max().item() < 1e-10


def test_work_per_rank_and_balanced_layout():
    from loongtrain.parallel.documents import balanced_chunk_order, rank_work, visible_keys, visible_pairs
    from loongtrain.plan.document_work import imbalance

    rng = random.Random(5)
    seq, cp = 480, 4
    docs = [random_docs(seq, rng, 200), (0, 7, 400, seq)]
    for causal, sliding in ((True, None), (True, 9), (False, None), (False, 5)):
        mask = AttnMask(causal, sliding, tuple(docs))
        dense = [dense_mask(seq, mask, b) for b in range(2)]
        for b in range(2):
            assert torch.equal(visible_keys(docs[b], seq, causal=causal, sliding_window=sliding), dense[b].sum(1))
            assert visible_pairs(docs[b], seq, causal=causal, sliding_window=sliding) == int(dense[b].sum())
        zigzag = rank_work(docs, seq, cp, causal=causal, sliding_window=sliding)
        order = balanced_chunk_order(docs, seq, cp, causal=causal, sliding_window=sliding)
        balanced = rank_work(docs, seq, cp, chunk_order=order, causal=causal, sliding_window=sliding)
        assert sum(zigzag) == sum(balanced) == sum(int(d.sum()) for d in dense)
        assert imbalance(balanced) <= imbalance(zigzag) + 1e-12
    assert imbalance(rank_work([docs[1]], seq, cp)) > 1.2 > imbalance(
        rank_work([docs[1]], seq, cp, chunk_order=balanced_chunk_order([docs[1]], seq, cp)))


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_ring_on_a_balanced_layout_is_exact(cp):
    from loongtrain.parallel.documents import balanced_chunk_order

    seq = 2 * CHUNK * cp
    docs = tuple(doc_layouts(cp, seq, seed=cp).values())
    q, k, v, dout = _inputs(cp, 4, 2, batch=len(docs), seed=cp)
    order = balanced_chunk_order(docs, seq, cp, chunks_per_rank=3)
    assert order != tuple(x for c in range(cp) for x in (c, 2 * cp - 1 - c))
    for causal, sliding in ((True, None), (True, 4), (False, None)):
        mask = AttnMask(causal, sliding, docs, 0, order)
        got = run_ring(q, k, v, dout, cp, 1, mask)
        want = dense_reference(q, k, v, dout, mask)
        assert max((g - w).abs().max().item() for g, w in zip(got, want)) < 1e-10


def test_packed_inputs_from_eos():
    import loongtrain

    ids = torch.tensor([[5, 9, 0, 4, 0, 0, 7, 8], [1, 2, 3, 4, 5, 6, 7, 0]])
    cu, pos = loongtrain.packed_inputs(ids, eos_id=0)
    assert [c.tolist() for c in cu] == [[0, 3, 5, 6, 8], [0, 8]]  # a document ends with its EOS
    assert pos.tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], list(range(8))]
    assert torch.equal(loongtrain.document_position_ids(cu[0], 8), pos[0])


@pytest.mark.parametrize("causal, sliding", [(True, None), (True, 3), (False, None), (False, 2), (True, 200)])
def test_local_attention_masks_match_the_dense_reference(causal, sliding):
    from loongtrain.model.local_attention import local_attention

    q, k, v, dout = (t.transpose(1, 2) for t in _inputs(20, 4, 2, batch=2, seed=9))  # S = 240
    docs = [torch.tensor(random_docs(240, random.Random(1), 150)), torch.tensor([0, 1, 240])]
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = local_attention(*leaves, causal=causal, cu_seqlens=docs, sliding_window=sliding)
    got = (out, *torch.autograd.grad(out, leaves, dout))
    mask = AttnMask(causal, sliding, tuple(tuple(d.tolist()) for d in docs))
    want = dense_reference(*(t.transpose(1, 2) for t in (q, k, v, dout)), mask)
    for g, w in zip(got, (want[0], *want[2:])):
        assert (g - w.transpose(1, 2)).abs().max().item() < 1e-10


def test_model_with_documents_equals_each_document_alone():
    from loongtrain.model import ModelConfig, Transformer

    config = ModelConfig(vocab_size=32, dim=16, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=32)
    model = Transformer(config, seed=1).double()
    ids = torch.randint(0, 32, (1, 24), generator=torch.Generator().manual_seed(0))
    cu = torch.tensor([0, 5, 6, 17, 24])
    pos = torch.tensor([list(range(5)) + [0] + list(range(11)) + list(range(7))])
    packed = model(ids, pos, cu_seqlens=cu)
    alone = torch.cat([model(ids[:, s:e]) for s, e in zip(cu.tolist(), cu.tolist()[1:])], dim=1)
    assert (packed - alone).abs().max().item() < 1e-10


@pytest.mark.parametrize("kernel_name", ["cuda_flash", "cuda_efficient"])
def test_pieces_on_emulated_cuda_kernels(monkeypatch, kernel_name):
    """Full, causal and mirrored (anticausal) pieces through the CUDA kernel wrappers (ops emulated on CPU)."""
    from loongtrain.attn import cuda_kernels
    from tests.helpers.cuda_emulation import install

    ops = install(monkeypatch, allow_fp64=True)
    kernel = {"cuda_flash": cuda_kernels.CUDA_FLASH, "cuda_efficient": cuda_kernels.CUDA_EFFICIENT}[kernel_name]
    cp = 4
    seq = 2 * CHUNK * cp
    docs = tuple(doc_layouts(cp, seq, seed=2).values())[:2]
    q, k, v, dout = _inputs(cp, 4, 2, batch=2, seed=2)
    for causal, sliding in ((True, 4), (False, 3), (True, None)):
        mask = AttnMask(causal, sliding, docs, 0)
        got = run_ring(q, k, v, dout, cp, 2, mask, kernel)
        want = dense_reference(q, k, v, dout, mask)
        assert max((g - w).abs().max().item() for g, w in zip(got, want)) < 1e-10, (causal, sliding)
    assert ops.calls


def test_plan_reports_document_balance(capsys):
    from loongtrain.commands.plan import main
    from loongtrain.plan.document_work import balance_report, lognormal_documents

    docs = lognormal_documents(16384, 1024, seed=0)
    assert docs[0] == 0 and docs[-1] == 16384 and all(a < b for a, b in zip(docs, docs[1:]))
    report = balance_report([docs], 16384, 4)
    assert report["balanced_imbalance"] < report["zigzag_imbalance"] and 0 < report["visible_fraction"] < 1
    assert main(["--model", "tiny", "--seq-len", "16K", "--nodes", "1", "--cluster", "a100", "--top", "1",
                 "--doc-median", "1024"]) == 0
    out = capsys.readouterr().out
    assert "packed documents (lognormal, median 1024" in out and "balanced layout" in out
