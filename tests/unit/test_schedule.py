"""The ring schedule (docs/attention.md#the-ring-schedule): the executor runs exactly the events the planner
simulates, and
the in-process executor is exact against unsharded attention for every (cp, inner_ring) up to 8. No processes."""

from __future__ import annotations

import pytest
import torch

from loongtrain.attn.kernel_choice import select_kernel
from loongtrain.attn.kernels import reference_forward
from loongtrain.attn.masking import AttnMask
from loongtrain.attn.ring import RingCall, local_ring_backward, local_ring_forward
from loongtrain.attn.schedule import Compute, Post, Wait, pass_events
from loongtrain.attn.short_pass import pass_reach, short_sends
from loongtrain.parallel.layout import DoubleRing
from loongtrain.parallel.zigzag import shard_indices
from tests.helpers.schedule_trace import Recorder, planned_trace

RINGS = [(cp, w) for cp in range(1, 9) for w in range(1, cp + 1) if cp % w == 0]


def test_peers_and_source_rule():
    for cp, w in RINGS:
        ring = DoubleRing(cp // w, w)
        for p in range(cp):
            for hop in ("inner", "outer"):
                assert ring.peer(ring.peer(p, hop, 1), hop, -1) == p
            assert ring.peer(p, "inner", 1) // w == p // w  # inner hops stay in the inner ring
            assert ring.peer(p, "outer", 1) % w == p % w
            held = [ring.source(p, o, t) for o in range(cp // w) for t in range(w)]
            assert sorted(held) == list(range(cp)) and held[0] == p  # every block once, own block first
            for o in range(cp // w):  # a block moves one inner hop per inner step, one outer hop per inner ring
                for t in range(w - 1):
                    assert ring.source(ring.peer(p, "inner", 1), o, t + 1) == ring.source(p, o, t)
                if o < cp // w - 1:
                    assert ring.source(ring.peer(p, "outer", 1), o + 1, 0) == ring.source(p, o, 0)


def test_last_inner_dkv_hop_of_a_window_is_awaited_after_the_next_compute():
    events = pass_events(3, 4, True)
    for o in range(2):
        wait = events.index(Wait(f"dkv.inner.{o}.3", "dkv_own" if o == 0 else f"dkv_window{o % 2}", add=True))
        assert [e for e in events[:wait] if isinstance(e, Compute)][-1] == Compute(o + 1, 0, "kv_outer",
                                                                                  f"dkv_window{(o + 1) % 2}")
    assert sum(isinstance(e, Post) and e.payload == "dkv" for e in events) == 11  # cp - 1


@pytest.mark.parametrize("cp, inner_ring", RINGS)
def test_executor_runs_what_the_planner_simulates(cp, inner_ring):
    qs, ks, vs, douts = _shards(_full_inputs(cp, 2, 1, torch.float64), cp)
    kernel = select_kernel(qs[0].device, qs[0].dtype, qs[0].shape[-1])
    fwd = Recorder(cp, inner_ring)
    results = local_ring_forward(qs, ks, vs, inner_ring, RingCall(AttnMask(True), 0.5, fwd.kernel(kernel)),
                                 fwd.transports)
    bwd = Recorder(cp, inner_ring)
    local_ring_backward(douts, qs, ks, vs, [o for o, _ in results], [lse for _, lse in results], inner_ring,
                        RingCall(AttnMask(True), 0.5, bwd.kernel(kernel)), bwd.transports)
    for recorder, backward in ((fwd, False), (bwd, True)):
        planned = planned_trace(cp, inner_ring, backward)
        assert planned.count(("compute",)) == cp
        assert len(recorder.log) == cp * len(planned)
        for p in range(cp):
            assert recorder.member_trace(p) == planned, (cp, inner_ring, backward, p)


def _full_inputs(cp: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype, head_dim: int = 8):
    g = torch.Generator().manual_seed(cp)
    seq = 4 * cp

    def rand(heads: int) -> torch.Tensor:
        return torch.randn(2, heads, seq, head_dim, generator=g, dtype=dtype)

    return rand(num_heads), rand(num_kv_heads), rand(num_kv_heads), rand(num_heads)


def _shards(tensors, cp: int) -> list[list[torch.Tensor]]:
    seq = tensors[0].shape[2]
    idx = [shard_indices(seq, 1, cp, c, 0) for c in range(cp)]
    return [[t[:, :, i] for i in idx] for t in tensors]


@pytest.mark.parametrize("cp, inner_ring", RINGS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (4, 1), (6, 2)])
def test_local_ring_equals_unsharded_attention(cp, inner_ring, causal, num_heads, num_kv_heads):
    q, k, v, dout = _full_inputs(cp, num_heads, num_kv_heads, torch.float64)
    scale = q.shape[-1] ** -0.5
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = reference_forward(*leaves, causal, scale)
    want = (out, lse, *torch.autograd.grad(out, leaves, dout))
    qs, ks, vs, douts = _shards((q, k, v, dout), cp)
    call = RingCall(AttnMask(causal), scale)
    results = local_ring_forward(qs, ks, vs, inner_ring, call)
    outs, lses = [o for o, _ in results], [lse for _, lse in results]
    grads = local_ring_backward(douts, qs, ks, vs, outs, lses, inner_ring, call)
    for name, got, full in zip(("out", "lse", "dq", "dk", "dv"),
                               (outs, lses, *zip(*grads)), want):
        ref = _shards((full.detach(),) if full.dim() == 4 else (full.detach().unsqueeze(-1),), cp)[0]
        for p, (g, r) in enumerate(zip(got, ref)):
            err = (g - r.reshape(g.shape)).abs().max().item()
            assert err < 1e-10, (name, cp, inner_ring, causal, p, err)


SHORT = [(cp, w, r) for cp, w in RINGS for r in range(4)
         if pass_reach(DoubleRing(cp // w, w), 2, 2 * r + 1) == r]


def test_short_passes_exist_on_double_rings():
    # r = 0 (a sliding window of 1) on every double ring; longer reaches only where they save hops (cp = 8)
    assert {(cp, w) for cp, w, r in SHORT if 1 < w < cp and r == 0} == {(4, 2), (6, 2), (6, 3), (8, 2), (8, 4)}
    assert {(cp, w, r) for cp, w, r in SHORT if 1 < w < cp and r > 0} == {(8, 2, 1), (8, 2, 2), (8, 4, 1)}


@pytest.mark.parametrize("cp, inner_ring, reach", SHORT)
def test_short_pass_brings_each_nearby_block_once(cp, inner_ring, reach):
    ring = DoubleRing(cp // inner_ring, inner_ring)
    for backward in (False, True):
        events = pass_events(cp // inner_ring, inner_ring, backward, reach)
        for p in range(cp):
            held = [ring.source(p, e.outer, e.inner) for e in events if isinstance(e, Compute)]
            assert len(held) == len(set(held)) and held[0] == p, (p, held)
            assert {(p + d) % cp for d in range(-reach, reach + 1)} <= set(held), (p, held)
        posts = [e for e in events if isinstance(e, Post)]
        assert len(posts) < (cp - 1) * (2 if backward else 1)
        for (hop, direction), count in short_sends(ring, reach).items():  # the byte formulas' route
            assert sum(e.payload == "kv" and (e.hop, e.direction) == (hop, direction) for e in posts) == count
            dkv = sum(e.payload == "dkv" and (e.hop, e.direction) == (hop, -direction) for e in posts)
            assert dkv == (count if backward else 0)


@pytest.mark.parametrize("cp, inner_ring, reach", SHORT)
def test_executor_runs_the_planned_short_pass(cp, inner_ring, reach):
    """Executor events == planner trace for every short pass (kernel calls aside: a window's block may
    need several pieces or none), and the result is exact."""
    from tests.helpers.schedule_trace import dense_reference

    mask = AttnMask(True, 2 * reach + 1, None)  # chunks of 2 tokens: reach ``reach``
    q, k, v, dout = _full_inputs(cp, 2, 1, torch.float64)
    qs, ks, vs, douts = _shards((q, k, v, dout), cp)
    fwd, bwd = Recorder(cp, inner_ring), Recorder(cp, inner_ring)
    scale = q.shape[-1] ** -0.5
    results = local_ring_forward(qs, ks, vs, inner_ring, RingCall(mask, scale), fwd.transports)
    outs, lses = [o for o, _ in results], [lse for _, lse in results]
    grads = local_ring_backward(douts, qs, ks, vs, outs, lses, inner_ring, RingCall(mask, scale), bwd.transports)
    for recorder, backward in ((fwd, False), (bwd, True)):
        planned = [op for op in planned_trace(cp, inner_ring, backward, reach) if op[0] != "compute"]
        for p in range(cp):
            assert [op for who, op in recorder.log if who == p] == planned, (cp, inner_ring, backward, p)
    want = dense_reference(q, k, v, dout, mask)
    got = [outs, lses, *zip(*grads)]
    for name, parts, full in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        ref = _shards((full if full.dim() == 4 else full.unsqueeze(-1),), cp)[0]
        err = max((g - r.reshape(g.shape)).abs().max().item() for g, r in zip(parts, ref))
        assert err < 1e-10, (name, cp, inner_ring, reach, err)


def test_planner_runs_the_short_pass_of_a_double_ring():
    from dataclasses import replace

    from loongtrain.parallel.layout import Layout
    from loongtrain.plan.attention_cost import AttnShape, attention_time
    from loongtrain.plan.cluster import load_cluster
    from loongtrain.plan.traffic import attention_ops, ring_reach

    cluster = load_cluster("h100")
    seq, sliding = 131072, 4096  # chunk 4096 on a ring of 16: reach 1
    full = AttnShape(1, seq, 32, 8, 128, 2)
    layout = Layout(16, 1, 16, inner_ring=4)  # 4 inner rings of 4
    assert ring_reach(layout, seq, sliding) == 1
    assert attention_ops(layout, seq_len=seq, sliding_window=sliding)["dkv"] == 6  # 2 outer + 2 + 1 + 1 inner
    windowed = attention_time(layout, replace(full, sliding_window=sliding), cluster)
    long_window = attention_time(layout, replace(full, sliding_window=seq - 1), cluster)  # full pass
    assert windowed.total < long_window.total
