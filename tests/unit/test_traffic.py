"""Byte accounting of one attention layer (loongtrain.plan.traffic): hand-computed cases, plus one
gloo run checking the formulas against what the code actually sends."""

from __future__ import annotations

import pytest

from loongtrain.parallel.layout import Layout
from loongtrain.plan.traffic import (
    attention_ops,
    attention_traffic,
    format_traffic_report,
    split_by_node,
    traffic_report,
)

# B=1, S=64, H=4, Hkv=2, D=4, bf16
SHAPE = dict(batch=1, seq_len=64, num_heads=4, num_kv_heads=2, head_dim=4, dtype_bytes=2)


def test_plain_ring_vs_double_ring_cross_node_kv():
    # world 8 = 2 nodes x 4, pure ring cp=8. KV block = 2 * Hkv * S/cp * D * b = 2*2*8*4*2 = 256 bytes.
    plain = Layout(8, 1, 8, inner_ring=1)
    fwd = {r: attention_traffic(plain, r, backward=False, **SHAPE) for r in range(8)}
    assert fwd[3]["kv"] == {4: 7 * 256}  # ring 3 -> 4 crosses nodes, all 7 blocks
    assert fwd[0]["kv"] == {1: 7 * 256}
    assert split_by_node(fwd[3]["kv"], 3, 4) == (0, 1792)
    assert split_by_node(fwd[7]["kv"], 7, 4) == (0, 1792)  # wrap-around 7 -> 0
    assert split_by_node(fwd[1]["kv"], 1, 4) == (1792, 0)
    # double ring, inner_ring 4: 2 inner rings = the 2 nodes; 2*(4-1) = 6 inner sends, 1 outer send per rank
    double = Layout(8, 1, 8, inner_ring=4, placement="context_first")
    for r in range(8):
        t = attention_traffic(double, r, backward=False, **SHAPE)
        assert split_by_node(t["kv"], r, 4) == (6 * 256, 256)
        assert t["a2a"] == {} and t["dkv"] == {}
    # backward: kv again, plus dK/dV in fp32 (2x the bf16 block bytes) on the same peers
    t = attention_traffic(double, 0, **SHAPE)
    assert t["kv"] == {1: 2 * 6 * 256, 4: 2 * 256}
    assert t["dkv"] == {1: 6 * 512, 4: 512}


def test_placement_moves_a2a_across_nodes():
    # hp=2, cp=4. a2a per peer per call: qkv = S/sp*(H + 2*Hkv)*D*b/hp = 8*8*4*2/2 = 256;
    # out = 8*4*4*2/2 = 128
    head_first = Layout(8, 2, 4, placement="head_first")
    ctx_first = Layout(8, 2, 4, placement="context_first")
    hf = attention_traffic(head_first, 0, **SHAPE)
    assert hf["a2a"] == {1: 2 * (256 + 128)}
    assert split_by_node(hf["a2a"], 0, 4) == (768, 0)
    # ring of rank 0 is 0,2,4,6: kv block = 2 * (Hkv/hp=1) * S/cp=16 * 4 * 2 = 256 bytes, 3 blocks
    assert hf["kv"] == {2: 2 * 3 * 256}
    assert max(split_by_node(attention_traffic(head_first, r, **SHAPE)["kv"], r, 4)[1] for r in range(8)) > 0
    cf = attention_traffic(ctx_first, 0, **SHAPE)
    assert cf["a2a"] == {4: 768}
    assert split_by_node(cf["a2a"], 0, 4) == (0, 768)
    for r in range(8):  # rings 0-3 and 4-7 stay inside their node
        t = attention_traffic(ctx_first, r, **SHAPE)
        assert split_by_node(t["kv"], r, 4)[1] == 0 and split_by_node(t["dkv"], r, 4)[1] == 0


def test_gqa_replication_and_fp64():
    # hp=4 > Hkv=2: KV heads replicated to 4 before the a2a, one per head rank.
    layout = Layout(4, 4, 1)
    t = attention_traffic(layout, 0, backward=False, **SHAPE)
    # local tokens S/sp = 16: qkv = 16*(4 + 2*4)*4*2/4 = 384, out = 16*4*4*2/4 = 128
    assert t["a2a"] == {1: 512, 2: 512, 3: 512}
    shape64 = dict(SHAPE, dtype_bytes=8)
    t = attention_traffic(Layout(2, 1, 2), 0, **shape64)
    block = 2 * 2 * 32 * 4 * 8
    assert t["kv"] == {1: 2 * block} and t["dkv"] == {1: block}


def test_ops_and_report():
    assert attention_ops(Layout(8, 2, 4, inner_ring=2)) == {"a2a": 4, "kv": 6, "dkv": 3}
    assert attention_ops(Layout(8, 2, 4), backward=False) == {"a2a": 2, "kv": 3, "dkv": 0}
    assert attention_ops(Layout(4, 1, 1)) == {"a2a": 0, "kv": 0, "dkv": 0}
    rows = traffic_report(Layout(8, 1, 8, inner_ring=4, placement="context_first"), 4, **SHAPE)
    assert [r["kv_cross"] for r in rows] == [2 * 256] * 8
    assert all(r["cross"] == r["kv_cross"] + r["dkv_cross"] for r in rows)
    assert "kv_cross" in format_traffic_report(rows)


def test_invalid_heads():
    with pytest.raises(ValueError, match="hp=3"):
        attention_traffic(Layout(3, 3, 1), 0, **dict(SHAPE, seq_len=66, num_heads=6, num_kv_heads=2))
    with pytest.raises(ValueError, match=r"sequence length 60 must be divisible by 2\*cp\*hp"):
        attention_traffic(Layout(8, 2, 4), 0, **dict(SHAPE, seq_len=60))


# ---------------------------------------------------------------- against the real code (gloo, world 4)




def _scan(layout: Layout, ranks_per_node: int):
    """link_stats' answer, rank by rank through the layout's own peers (coords, grid, ring_peers)."""
    from loongtrain.plan.traffic import LinkStats

    node = lambda r: r // ranks_per_node  # noqa: E731
    a2a_in = a2a_out = 0
    senders: dict[str, dict[int, int]] = {"a2a": {}, "inner": {}, "outer": {}}
    for rank in range(layout.world_size):
        d, c, _ = layout.coords(rank)
        peers = [p for p in layout.grid[d][c] if p != rank]
        cross = sum(node(p) != node(rank) for p in peers)
        a2a_in, a2a_out = max(a2a_in, len(peers) - cross), max(a2a_out, cross)
        hops = {"a2a": cross > 0}
        if layout.cp > 1:
            ring = layout.ring_peers(rank)
            hops["inner"] = layout.inner_ring > 1 and node(ring["inner_next"]) != node(rank)
            hops["outer"] = layout.num_inner_rings > 1 and node(ring["outer_next"]) != node(rank)
        for kind, is_cross in hops.items():
            if is_cross:
                senders[kind][node(rank)] = senders[kind].get(node(rank), 0) + 1
    most = {kind: max(s.values(), default=0) for kind, s in senders.items()}
    return LinkStats(a2a_in, a2a_out, most["a2a"], most["inner"] > 0, most["inner"], most["outer"] > 0,
                     most["outer"])


@pytest.mark.parametrize("world, hp, cp, inner_ring, placement, interleaved, ranks_per_node", [
    (16, 2, 8, 4, "head_first", False, 4), (16, 2, 8, 4, "context_first", False, 4),
    (48, 4, 4, 2, "context_first", True, 8), (24, 3, 8, 2, "head_first", False, 6),
    (32, 1, 32, 8, "head_first", True, 8), (64, 8, 4, 1, "context_first", False, 4),
    (12, 2, 2, 1, "head_first", False, 5), (8, 8, 1, 1, "head_first", False, 8),
])
def test_link_stats_equal_a_scan_rank_by_rank(world, hp, cp, inner_ring, placement, interleaved, ranks_per_node):
    from loongtrain.plan.traffic import link_stats

    layout = Layout(world, hp, cp, inner_ring=inner_ring, placement=placement, interleaved=interleaved)
    assert link_stats(layout, ranks_per_node) == _scan(layout, ranks_per_node)
