"""A sliding window over a long run in one process (loongtrain/attn/masking.py, ring_step.py, ring.py): planned
without recursion (a 128-token window over 65536 tokens is ``2 S / w`` cut pieces, or one call of FA2's own window
argument), counted by the planner, and run forward and backward, with gpt-oss's sinks, equal to fp64 on its tail
(the CPU kernel's cut pieces, and FA2's window through the CUDA emulation); FA2's band calls are exact wherever the
ring places them (documents, rings, non-causal)."""

from __future__ import annotations

import random

import pytest
import torch

from loongtrain.attn.api import attention
from loongtrain.attn.cuda_kernels import CUDA_FLASH
from loongtrain.attn.kernels import REFERENCE
from loongtrain.attn.masking import AttnMask, dense_mask, member_runs, visible_pieces
from loongtrain.attn.ring import Ring, RingCall, ring_backward, ring_forward
from loongtrain.attn.ring_step import StepPlans
from loongtrain.attn.sinks import sinks_grad
from loongtrain.parallel.zigzag import shard_indices
from loongtrain.plan.document_work import pair_work, piece_pairs
from tests.helpers.cuda_emulation import install
from tests.helpers.emulation_math import fa2_window
from tests.helpers.ring_cases import ring_results
from tests.helpers.sinks import sinks_reference
from tests.unit.test_documents import random_docs

S, W, TAIL = 65536, 128, 512


def _visible_count(seq: int, window: int) -> int:
    return sum(min(i + 1, window) for i in range(seq))


def test_a_128_window_over_65536_tokens_plans_without_recursion():
    runs = member_runs(S, 1, 0)
    band = AttnMask(True, W).band()
    cut = visible_pieces(runs, runs, None, band, True, 32 * 32)
    assert 2 * S // W - 16 <= len(cut) <= 2 * S // W  # the kernel-shaped pieces of a narrow band
    assert sum(piece_pairs(p, band) for p in cut) == _visible_count(S, W)
    (one,) = visible_pieces(runs, runs, None, band, True, 32 * 32, True)  # FA2's window: one call
    assert (one.kind, one.window, one.r1, one.c1) == ("band", (W - 1, 0), S, S)
    assert pair_work(None, S, 1, sliding_window=W) == ((_visible_count(S, W),),)  # the planner's count


def _tail_reference(q, k, v, sinks, dout):
    """fp64 autograd over the last ``TAIL + W`` tokens (every key a tail query sees) with ``dout`` zero before the
    tail: out and dq of the tail rows, dk and dv of the span's keys, the sinks' gradient."""
    span = TAIL + W
    leaves = [t[:, -span:].detach().clone().requires_grad_() for t in (q, k, v)] + [sinks.clone().requires_grad_()]
    i = torch.arange(span)
    visible = ((i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < W)).expand(1, span, span)
    out = sinks_reference(*leaves, visible)
    grads = torch.autograd.grad(out, leaves, dout[:, -span:])
    return out.detach()[:, -TAIL:], grads[0][:, -TAIL:], grads[1], grads[2], grads[3]


def _inputs(heads: int = 2, kv_heads: int = 1, head_dim: int = 8):
    """q, k, v, sinks and a dout that is zero before the last ``TAIL`` rows (fp64)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, S, heads, head_dim, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, S, kv_heads, head_dim, generator=g, dtype=torch.float64) for _ in range(2))
    sinks = torch.randn(heads, generator=g, dtype=torch.float64)
    dout = torch.zeros(1, S, heads, head_dim, dtype=torch.float64)
    dout[:, -TAIL:] = torch.randn(1, TAIL, heads, head_dim, generator=g, dtype=torch.float64)
    return q, k, v, sinks, dout


def _check_tail(out, dq, dk, dv, dsinks, want) -> None:
    """Tail rows and the span's keys against fp64; everything before them got no gradient."""
    span = TAIL + W
    for name, got, ref in (("out", out[:, -TAIL:], want[0]), ("dq", dq[:, -TAIL:], want[1]),
                           ("dk", dk[:, -span:], want[2]), ("dv", dv[:, -span:], want[3]), ("sinks", dsinks, want[4])):
        assert (got - ref).abs().max() < 1e-10, name
    assert not dq[:, :-TAIL].any() and not dk[:, :-span].any() and not dv[:, :-span].any()
    assert want[4].abs().max() > 1e-3 and want[2].abs().max() > 1e-3


def test_a_128_window_with_sinks_over_65536_tokens_runs_and_equals_fp64_on_its_tail():
    """The bar: ``loongtrain.attention`` in one process (the CPU kernel on the ~1000 cut pieces), forward and
    backward: out, dq, dk, dv and the sinks' gradient equal fp64 on the tail."""
    q, k, v, sinks, dout = _inputs()
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    out = attention(*leaves[:3], None, sliding_window=W, sinks=leaves[3])
    _check_tail(out.detach(), *torch.autograd.grad(out, leaves, dout), _tail_reference(q, k, v, sinks, dout))


def test_fa2s_window_runs_a_128_window_over_65536_tokens_as_one_call(monkeypatch):
    """Through the CUDA emulation: the ring of one member makes one FA2 call with its window argument each way
    (no accumulator), equal to fp64 on the tail, the sinks folded in as everywhere."""
    ops = install(monkeypatch, allow_fp64=True)
    q, k, v, sinks, dout = _inputs(heads=1)
    ring, mask, scale = Ring((0,), 0, 1), AttnMask(True, W), 8 ** -0.5
    bhsd = [t.transpose(1, 2) for t in (q, k, v, dout)]
    out, lse = ring_forward(*bhsd[:3], ring, RingCall(mask, scale, CUDA_FLASH), sinks=sinks)
    dq, dk, dv = ring_backward(bhsd[3], *bhsd[:3], out, lse, ring, RingCall(mask, scale, CUDA_FLASH))
    assert ops.calls == ["_flash_attention_forward", "_flash_attention_backward"]
    got = [t.transpose(1, 2) for t in (out, dq, dk, dv)]
    _check_tail(*got, sinks_grad(bhsd[3], out, lse, sinks), _tail_reference(q, k, v, sinks, dout))


@pytest.mark.parametrize("seed", range(6))
def test_band_calls_are_exact_wherever_the_ring_places_them(monkeypatch, seed):
    """Random documents, windows, causal or not, rings of 1-3: FA2 with its window (band pieces, in dense and
    varlen calls) equals the reference kernel in fp64, forward and backward."""
    install(monkeypatch, allow_fp64=True)
    rng = random.Random(seed)
    docs = tuple(random_docs(24, rng, rng.randint(1, 6)) for _ in range(2))
    mask = AttnMask(rng.random() < 0.7, rng.choice([2, 5, 7, 11]), docs if rng.random() < 0.7 else None)
    for cp in (1, 2, 3):
        for got, want in zip(ring_results(CUDA_FLASH, mask, cp), ring_results(REFERENCE, mask, cp), strict=True):
            assert (got - want).abs().max() < 1e-10, (mask, cp)


@pytest.mark.parametrize("seed", range(40))
def test_band_pieces_cover_exactly_the_visible_pairs_as_fa2_reads_them(seed):
    """Every band piece's window, read as FA2 reads it (its bounds past the key length dropped, also against a
    varlen call's longer sequences), covers exactly its visible pairs."""
    rng = random.Random(seed)
    cp = rng.randint(1, 6)
    seq = 2 * cp * rng.randint(1, 9)
    docs = random_docs(seq, rng, rng.randint(1, seq))
    mask = AttnMask(rng.random() < 0.7, rng.choice([None, 1, 2, 5, 7, seq]), (docs,))
    dense = dense_mask(seq, mask)
    for p in range(cp):
        for src in range(cp):
            pieces = visible_pieces(member_runs(seq, cp, p), member_runs(seq, cp, src), docs, mask.band(),
                                    mask.causal, 0, True)
            want = dense[shard_indices(seq, 1, cp, p, 0)][:, shard_indices(seq, 1, cp, src, 0)].long()
            for longer in (0, 50):
                count = torch.zeros_like(want)
                for x in pieces:
                    count[x.r0:x.r1, x.c0:x.c1] += _cells(x, longer).long()
                assert torch.equal(count, want), (seed, p, src, pieces)


def _cells(piece, longer: int) -> torch.Tensor:
    rows, cols = piece.r1 - piece.r0, piece.c1 - piece.c0
    full = torch.ones(rows, cols, dtype=torch.bool)
    if piece.kind != "band":
        return {"full": full, "causal": full.tril(), "anticausal": full.triu()}[piece.kind]
    left, right = fa2_window(*piece.window, False, rows + longer, cols + longer)
    d = torch.arange(cols)[None, :] - torch.arange(rows)[:, None] - (cols - rows)
    return full & ((d >= -left) if left >= 0 else full) & ((d <= right) if right >= 0 else full)


@pytest.mark.parametrize("v_head_dim", [8, 4])
def test_packed_documents_at_cp_1_are_one_varlen_call_without_accumulators(monkeypatch, v_head_dim):
    """One varlen call covers every row in order (documents, a ring of one member): the ring makes that one call
    each way and no merge (its plan: ``natural``); exact in fp64, also with V's head dim below Q/K's (MLA: V and dO
    zero-padded for FA2's one head dim, the padding cut off out and dV)."""
    ops = install(monkeypatch, allow_fp64=True)
    docs = (0, 3, 10, 11, 24)
    plans = StepPlans(AttnMask(True, None, (docs,)), 1, 24, 1, 0, torch.device("cpu"), True, True, True)
    (call,) = plans(0).varlen
    assert call.natural and not plans(0).dense
    g = torch.Generator().manual_seed(2)
    q, dout = (torch.randn(1, 4, 24, d, generator=g, dtype=torch.float64) for d in (8, v_head_dim))
    k, v = (torch.randn(1, 2, 24, d, generator=g, dtype=torch.float64) for d in (8, v_head_dim))
    ring, mask = Ring((0,), 0, 1), AttnMask(True, None, (docs,))
    results = {}
    for kernel in (CUDA_FLASH, REFERENCE):
        out, lse = ring_forward(q, k, v, ring, RingCall(mask, 0.3, kernel))
        results[kernel.name] = (out, lse, *ring_backward(dout, q, k, v, out, lse, ring, RingCall(mask, 0.3, kernel)))
    assert ops.calls == ["_flash_attention_forward", "_flash_attention_backward"]
    for got, want in zip(results["cuda_flash"], results["reference"], strict=True):
        assert got.shape == want.shape and (got - want).abs().max() < 1e-10
