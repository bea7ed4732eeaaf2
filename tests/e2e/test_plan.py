"""The planner's cost model (pure arithmetic, hand-computed), search, and CLI."""

from __future__ import annotations

import json

import pytest

from loongtrain._options import parse_size
from loongtrain.commands.plan import main
from loongtrain.model.config import get_preset
from loongtrain.parallel.config import ParallelConfig
from loongtrain.parallel.layout import Layout
from loongtrain.plan.attention_cost import (
    AttnShape,
    _Link,
    attention_flops,
    attention_time,
    predict_attention_time,
    simulate_pass,
)
from loongtrain.plan.cluster import cluster_to_toml, load_cluster
from loongtrain.plan.cost import step_cost
from loongtrain.plan.search import best_fitting, plan
from loongtrain.plan.traffic import message_bytes
from tests.helpers.plan_cases import SMALL, memory, toy_cluster

# B=1, S=64, H=Hkv=4, D=4, bf16 -> forward FLOPs per rank (sp=8) = 2*64^2*4*4/8 = 16384;
# KV block (cp=8) = 2*4*8*4*2 = 512 B
SHAPE = AttnShape(batch=1, seq_len=64, num_heads=4, num_kv_heads=4, head_dim=4, dtype_bytes=2)


def test_parse_size():
    assert parse_size("128K") == 131072 and parse_size("1M") == 1048576 and parse_size("4096") == 4096
    with pytest.raises(ValueError, match="1G"):
        parse_size("1G")


def test_attention_flops():
    assert attention_flops(SHAPE, 8) == 16384
    assert message_bytes(Layout(8, 1, 8), **SHAPE.kwargs())["kv"] == 512


def test_double_ring_overlap_hand_computed():
    # per ring step c = 16384 / 8 / 2048 = 1 s. Inner hop (NVLink) 512/1024 = 0.5 s, outer (NIC) 512/64 = 8 s.
    # forward: inner_ring = 3*max(1, .5) + 1 = 4 s; outer exposed = 8 - 4 = 4 s.
    # backward: c = 2.5 s, inner_ring 10 s. With 2 inner rings the one outer K/V hop (8 s) hides behind the first
    # inner_ring; fp32 dK/dV (1024 B) follow K/V on the inner link (inner hops hide behind the 2.5 s steps);
    # the chain waits for the last inner_ring's last inner dK/dV hop (1024 / 1024 = 1 s) and then sends the
    # inner_ring's dK/dV home over the outer link (1024 / 64 = 16 s), which nothing hides.
    t = attention_time(Layout(8, 1, 8, inner_ring=4, placement="context_first"), SHAPE, toy_cluster())
    assert t.compute_fwd == pytest.approx(8) and t.compute_bwd == pytest.approx(20)
    assert t.ring_inner_fwd == pytest.approx(0) and t.ring_outer_fwd == pytest.approx(4)
    assert t.ring_inner_bwd == pytest.approx(1) and t.ring_outer_bwd == pytest.approx(16)
    assert t.a2a_fwd == 0 and t.total == pytest.approx(49)
    # plain ring: forward 7 steps each waiting on the slowest (cross-node) hop: 7*(8-1) = 49 s exposed.
    # backward: the outer link never idles (each K/V hop is posted as the previous one lands, dK/dV queue
    # behind): 7 K/V + 7 dK/dV hops = 7*(512 + 1024) B / 64 B/s = 168 s, i.e. 168 - 20 exposed
    plain = attention_time(Layout(8, 1, 8, inner_ring=1), SHAPE, toy_cluster())
    assert plain.ring_outer_fwd == pytest.approx(49) and plain.ring_outer_bwd == pytest.approx(148)
    assert predict_attention_time(Layout(8, 1, 8, inner_ring=1), SHAPE, toy_cluster()) == pytest.approx(225)


def test_link_shares_bandwidth_between_transfers_in_flight():
    link = _Link(bandwidth=100.0, latency=0.25, bytes_factor=1.0)
    a = link.post(0.0, 100)  # alone for 0.5 s (50 B), then 50 B/s each: lands at 1.5
    b = link.post(0.5, 100)  # 50 B by 1.5, then alone: lands at 2.0
    assert link.wait(0.0, a) == pytest.approx(1.75) and link.wait(3.0, b) == pytest.approx(3.0)
    assert link.blocked == pytest.approx(1.75) and link.arrived[b] == pytest.approx(2.0)
    half = _Link(bandwidth=100.0, latency=0.0, bytes_factor=2.0)  # one connection, both directions
    assert half.wait(0.0, half.post(0.0, 100)) == pytest.approx(2.0)


@pytest.mark.parametrize("steps", [(1, 8), (8, 1), (2, 4), (4, 2), (3, 3)])
def test_simulated_pass_sends_what_the_ring_sends(steps):
    # the schedule moves each K/V block n*w - 1 hops and each dK/dV partial as many (ring.py docstring):
    # per rank n*(w-1) inner and n-1 outer hops of each kind, and the pass takes at least its compute
    n, w = steps
    for dkv in (None, 8):
        inner, outer = _Link(1e3, 0.0, 1.0), _Link(1e3, 0.0, 1.0)
        t = simulate_pass(steps, 1.0, inner, outer, 4, dkv)
        kinds = 1 if dkv is None else 2
        assert len(inner.arrived) + len(inner.left) == kinds * n * (w - 1)
        assert len(outer.arrived) + len(outer.left) == kinds * (n - 1)
        assert not inner.left and not outer.left  # the pass ends only when everything has landed
        assert t >= n * w


def test_half_duplex_doubles_two_window_outer_hops_and_a2a():
    # 2 inner rings: outer next == previous peer, so on a half-duplex cluster the outer K/V hop moves 1024 B
    # (16 s: 12 s exposed behind the 4-s forward inner_ring, 6 s behind the 10-s backward inner_ring) and the
    # final dK/dV hop 2048 B (32 s); the inner ring (4 members) is unchanged. The hp=2 all-to-all
    # doubles too: 2 * 8 s per pass.
    half = toy_cluster(duplex=False)
    t = attention_time(Layout(8, 1, 8, inner_ring=4, placement="context_first"), SHAPE, half)
    assert t.ring_outer_fwd == pytest.approx(16 - 4) and t.ring_outer_bwd == pytest.approx(6 + 32)
    assert t.ring_inner_bwd == pytest.approx(1)
    assert attention_time(Layout(8, 2, 4, placement="context_first"), SHAPE, half).a2a_fwd == pytest.approx(16)


def test_shared_nic_and_a2a():
    # one NIC per node shared by the 4 devices sending across at once: 16 B/s each -> outer hop 32 s
    double = Layout(8, 1, 8, inner_ring=4, placement="context_first")
    t = attention_time(double, SHAPE, toy_cluster(nics_per_node=1))
    assert t.ring_outer_fwd == pytest.approx(32 - 4)
    # hp=2 context_first: head peer 4 ranks away (other node). a2a pieces (S/sp=8 tokens):
    # qkv = 8*(4+2*4)*4*2/2 = 384 B, out = 8*4*4*2/2 = 128 B per call -> (384 + 128) / 64 B/s = 8 s per pass
    t = attention_time(Layout(8, 2, 4, placement="context_first"), SHAPE, toy_cluster())
    assert t.a2a_fwd == pytest.approx(8) and t.a2a_bwd == pytest.approx(8)
    t = attention_time(Layout(8, 2, 4, placement="head_first"), SHAPE, toy_cluster())
    assert t.a2a_fwd == pytest.approx(512 / 1024)


# params: per layer 64*64 + 2*64*32 + 64*64 + 3*64*128 + 2*64 = 36992; total 2*36992 + 64 + 2*256*64 = 106816


def test_memory_hand_computed():
    layout = Layout(8, 2, 4)  # t = 1024/8 = 128 tokens; He = 2
    # FSDP2 bf16 (z > 1): d-sized 4 bf16 (the norms keep their input, the attention's norm output is never kept:
    # fused into q/k/v); k/v + SwiGLU (2*2*16 + 4*128) bf16; lse 4*4; 2 rsqrt
    full_layer = 128 * (4 * 64 * 2 + (2 * 2 * 16 + 4 * 128) * 2 + 4 * 4 + 8)
    final_norm = 128 * 64 * 2  # in the chunked loss: only its input's gradient
    kw = dict(seq_len=1024, batch=1, zero_size=8, dtype_bytes=2)
    none = memory(SMALL, layout, recompute="none", **kw)
    assert none["activations"] == 2 * full_layer + final_norm and none["recompute"] == 0
    assert none["states"] == 16 * 106816 / 8
    # FSDP2 gathers bf16: two blocks + the root (embedding, head, norm) + one block's bf16 grad and fp32 copy
    assert none["working_params"] == 2 * (2 * 36992 + 2 * 256 * 64 + 64) + (2 + 4) * 36992
    keep = memory(SMALL, layout, recompute="none", reshard_after_forward=False, **kw)
    assert keep["working_params"] == none["working_params"]  # L = 2: all blocks are the two in flight
    assert none["logits"] == 128 * 4 + 128 * 256 * (2 + 4)  # chunked loss: fp32 lse + one chunk (all 128 tokens)
    # a block's backward, beyond its recomputed set: the larger of its two moments (memory_model.layer_moments)
    kv = 2 * 128 * 2 * 16
    mlp = 128 * (2 * 64 * 2 + 2 * 128 * 2)  # two residual gradients, SwiGLU's gradients (untiled: 2 * f)
    mlp_part = 64 * 2 + 4 * 128 * 2 + 64 * 2  # h, SwiGLU's intermediates, the MLP's norm output
    # dh, dO; the op's results dQ and packed dK/dV; its own workspace (attn/ring.backward_workspace_bytes): a
    # piece's kernel results, the fp32 dQ accumulator, 3 K/V blocks, 4 fp32 dK/dV blocks (the all-to-all's
    # buffers are not live then: hp = 2)
    results = 128 * 64 * 2 + kv * 2
    attention = 128 * (2 * 64 * 2 - mlp_part) + 2 * results + 4 * 128 * 64 + 3 * kv * 2 + 4 * kv * 4
    assert none["workspace"] == max(mlp, attention) == 147456
    full = memory(SMALL, layout, recompute="full", **kw)
    assert full["activations"] == 2 * 128 * 64 * 2 + final_norm and full["recompute"] == full_layer
    sel = memory(SMALL, layout, recompute="selective", **kw)
    # input, ring output, lse and (hp = 2) the all-to-alls' outputs: q, k, v, attention output
    kept = 64 * 2 + 64 * 2 + 16 + (2 * 64 + 2 * 2 * 16) * 2
    assert sel["activations"] == 2 * 128 * kept + final_norm and sel["recompute"] == full_layer
    # autocast (z = 1): fp32 residual stream, so the checkpointed layer inputs are fp32
    full1 = memory(SMALL, layout, recompute="full", **dict(kw, zero_size=1))
    assert full1["activations"] == 2 * 128 * 64 * 4 + 128 * 64 * 4
    unsharded = memory(SMALL, layout, recompute="none", **dict(kw, zero_size=1))
    assert unsharded["states"] == 16 * 106816 and unsharded["working_params"] == 2 * (2 * 36992 + 256 * 64)
    sel32 = memory(SMALL, layout, recompute="selective", **dict(kw, dtype_bytes=4))
    assert sel32["working_params"] == 4 * (2 * 36992 + 2 * 256 * 64 + 64) + 4 * 36992  # fp32 gathered


def test_step_compute_hand_computed():
    # 1 node of 4, hp=1 cp=4, S=256: t = 64 tokens; GEMM fwd per layer 2*P_l*t, P_l (no norms) = 36864
    cl = toy_cluster(intra_node_gbyte_s=1e6)  # fast links: pure compute
    c = step_cost(SMALL, ParallelConfig(cp=4, recompute="none"), cl, nodes=1, seq_len=256)
    gemm = 3 * 2 * 36992 * 64 / 2048  # fwd + 2x bwd (norm weights counted with the layer)
    attn = 3.5 * 2 * 256**2 * 4 * 16 / 4 / 2048
    head = 6 * 256 * 64 * 64 / 2048
    assert c.breakdown["compute"] == pytest.approx(2 * (gemm + attn) + head)
    sel = step_cost(SMALL, ParallelConfig(cp=4, recompute="selective"), cl, nodes=1, seq_len=256)
    assert sel.breakdown["compute"] - c.breakdown["compute"] == pytest.approx(2 * gemm / 3)
    full = step_cost(SMALL, ParallelConfig(cp=4, recompute="full"), cl, nodes=1, seq_len=256)
    assert full.breakdown["compute"] - c.breakdown["compute"] == pytest.approx(2 * (gemm / 3 + attn / 3.5))


def test_ulysses_invalid_for_gqa_and_ring_ranking():
    with pytest.raises(ValueError, match=r"hp=64 is invalid.*valid hp on 64 devices: \[1, 2, 4, 8, 16, 32\]"):
        plan("7b-gqa", "a100", nodes=8, seq_len=1 << 20, hp=64)
    cands = plan("7b-mha", "a100", nodes=8, seq_len=128 << 10, sp=64)
    assert all(c.config.hp <= 32 for c in cands) and cands[0].fits
    by = {(c.config.hp, c.config.cp, c.config.inner_ring, c.config.placement, c.config.zero, c.config.recompute): c
          for c in cands}
    plain = by[(1, 64, 1, "head_first", "full", "selective")]
    double = by[(1, 64, 8, "head_first", "full", "selective")]
    assert plain.bottleneck == "ring-outer" and double.step_time < plain.step_time
    assert cands[0].step_time <= double.step_time
    assert [c.fits for c in cands] == sorted((c.fits for c in cands), reverse=True)


def test_best_fitting_and_no_fit():
    best = best_fitting("7b-gqa", "a100", nodes=8, seq_len=1 << 20)
    assert best.fits and best.memory["total"] <= load_cluster("a100").usable_memory
    assert isinstance(best.config, ParallelConfig)  # exactly what `loongtrain train` runs
    assert best.config.zero_shard_size == (8 if best.config.zero == "hybrid" else 0)
    hybrid = plan("7b-gqa", "a100", nodes=2, seq_len=128 << 10, zero="hybrid", recompute="selective")
    assert all(c.config.zero_shard_size == 8 and c.config.recompute == "selective" for c in hybrid)
    with pytest.raises(ValueError, match="closest alternative: --nodes"):
        best_fitting("7b-mha", "a100", nodes=1, seq_len=4 << 20)


def test_calibration_measures_rates():
    from loongtrain.plan.calibrate import measure_attention_flops, measure_matmul_flops

    assert measure_matmul_flops(n=64, repeats=1) > 0
    assert measure_attention_flops(seq=64, heads=1, head_dim=16, repeats=1) > 0


def test_calibration_shares_cpus_between_ranks(monkeypatch):
    from loongtrain.plan import calibrate as cal

    monkeypatch.setattr(cal, "measure_matmul_flops", lambda: 1e12)
    monkeypatch.setattr(cal, "measure_attention_flops", lambda: 2e12)
    monkeypatch.setattr(cal, "measure_gloo_loopback", lambda: (1e9, 1e-5))
    monkeypatch.setattr(cal.os, "cpu_count", lambda: 2)
    four = cal.calibrate(world=4)  # 4 one-thread ranks on 2 CPUs: each gets half
    assert four.attention_tflops == pytest.approx(1.0) and four.matmul_tflops == pytest.approx(0.5)
    assert not four.duplex and four.gpus_per_node == 4 and four.intra_node_gbyte_s == pytest.approx(1.0)
    two = cal.calibrate(world=2)  # one CPU each: no sharing
    assert two.attention_tflops == pytest.approx(2.0)


def test_cluster_files(tmp_path):
    a100 = load_cluster("a100")
    assert a100.gpus_per_node == 8 and a100.nic_bw == pytest.approx(200e9 / 8 * 0.8)
    path = tmp_path / "mine.toml"
    path.write_text(cluster_to_toml(a100))
    assert load_cluster(path) == a100
    path.write_text("[cluster]\nbogus = 1\n")
    with pytest.raises(ValueError, match="bogus"):
        load_cluster(path)
    with pytest.raises(ValueError, match="a100"):
        load_cluster("nosuch")


def test_cli_json_and_errors(capsys, tmp_path):
    assert main(["--model", "7b-gqa", "--seq-len", "128K", "--nodes", "2", "--json", "--top", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["seq_len"] == 131072 and out["world_size"] == 16 and len(out["candidates"]) == 3
    assert out["candidates"][0]["fits"] and out["candidates"][0]["mfu"] > 0
    assert main(["--model", "7b-gqa", "--seq-len", "128K", "--nodes", "2", "--json", "--recompute", "full"]) == 0
    rows = json.loads(capsys.readouterr().out)["candidates"]
    assert rows and all(r["recompute"] == "full" for r in rows)
    assert main(["--model", "7b-gqa", "--seq-len", "128K", "--nodes", "2", "--top", "1"]) == 0
    assert " recompute " in capsys.readouterr().out
    assert main(["--model", "7b-gqa", "--seq-len", "1M", "--nodes", "8", "--hp", "64"]) == 2
    assert "hp=64" in capsys.readouterr().err
    assert main(["--model", "7b-gqa", "--seq-len", "1001", "--nodes", "8"]) == 2
    assert "seq_len=1001" in capsys.readouterr().err
    assert main(["--model", "7b-mha", "--seq-len", "8M", "--nodes", "1"]) == 2
    assert "nothing fits" in capsys.readouterr().err
    assert main(["--model", "nope", "--seq-len", "1K", "--nodes", "1"]) == 2
    assert "nope" in capsys.readouterr().err
    cfg = tmp_path / "plan.toml"
    cfg.write_text('seq_len = "64K"\nnodes = 1\ncluster = "h200"\n[model]\nvocab_size = 256\ndim = 64\n'
                   "num_layers = 2\nnum_heads = 4\nnum_kv_heads = 2\nffn_dim = 128\n")
    assert main(["--config", str(cfg), "--top", "2", "--hp", "2", "--cp", "4", "--traffic"]) == 0
    out = capsys.readouterr().out
    assert "h200" in out and "kv_cross" in out


def test_sliding_window_attention_costs_only_visible_pairs_and_the_short_pass():
    from dataclasses import replace

    from loongtrain.plan.traffic import ring_reach

    cluster = load_cluster("h100")
    seq, window = 131072, 4096
    full = AttnShape(1, seq, 32, 8, 128, 2)
    windowed = replace(full, sliding_window=window)
    layout = Layout(16, 1, 16)  # a single ring of 16: the window reaches one neighbour each way
    assert ring_reach(layout, seq, window) == 1
    a, b = attention_time(layout, full, cluster), attention_time(layout, windowed, cluster)
    pairs_full, pairs_window = seq * seq / 2, window * seq - window * (window - 1) / 2
    assert b.compute_fwd == pytest.approx(a.compute_fwd * pairs_window / pairs_full, rel=1e-12)
    assert b.total < a.total
    # a window as long as the sequence changes nothing
    assert attention_time(layout, replace(full, sliding_window=seq), cluster) == a
    mistral = replace(get_preset("7b-gqa"), sliding_window=window)
    kw = dict(nodes=2, seq_len=seq)
    cfg = ParallelConfig(hp=1, cp=16, zero="full", recompute="selective")
    dense = step_cost(get_preset("7b-gqa"), cfg, cluster, **kw)
    assert step_cost(mistral, cfg, cluster, **kw).step_time < dense.step_time
