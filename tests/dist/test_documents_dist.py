"""loongtrain.attention with documents and sliding windows equals the dense masked reference (fp64, 1e-10,
forward and dq/dk/dv) over gloo ranks: every (hp, cp) of world 4 in both placements, GQA with hp > Hkv,
short windows (the short ring pass) and long ones; a world-8 set with double rings."""

from __future__ import annotations

import pytest

from tests.helpers.attention_cases import check_documents, factorisations
from tests.helpers.dist_utils import run_distributed

pytestmark = pytest.mark.distributed


def _short(seq: int, cp: int) -> int:
    return max(1, seq // (2 * cp) - 1)  # less than a chunk: the short pass when cp >= 4


def _between(seq: int, cp: int) -> int:
    return seq // (2 * cp) + 2  # between one and two chunks: reach 2


def _long(seq: int, cp: int) -> int:
    return seq // cp + 3  # more than S/cp


def test_world4_every_factorisation_both_placements():
    configs = [dict(hp=hp, cp=cp, placement=placement) for hp, cp in factorisations(4)
               for placement in ("head_first", "context_first") if hp * cp > 1 or placement == "head_first"]
    # windows of 1, and longer than S/cp, run in-process in test_documents.py
    counts = run_distributed(check_documents, 4, configs, [(4, 1), (4, 2)], [None, _short], 1e-10)
    assert min(counts) > 0


def test_world8_rings():
    # the short pass on single rings (cp 8: windows 1 and 8) and double rings (windows of 2 and 4)
    configs = [dict(hp=1, cp=8), dict(hp=2, cp=4), dict(hp=1, cp=8, inner_ring=2), dict(hp=1, cp=8, inner_ring=8),
               dict(hp=1, cp=8, inner_ring=4, placement="context_first")]
    counts = run_distributed(check_documents, 8, configs, [(8, 2)], [None, 1, _short, _between, _long], 1e-10)
    assert min(counts) > 0


@pytest.mark.parametrize("world, configs, blocks", [
    # chunk = 4 tokens: reach 1, 2 blocks per pass instead of 3
    (4, [dict(hp=1, cp=4), dict(hp=1, cp=4, inner_ring=4, placement="context_first")], 2),
    # double rings, chunk = 2 tokens: reach 1 is one outer hop each way (one for two inner rings) and one inner
    # hop each way round the blocks reached: 5 blocks per pass instead of 7 (docs/attention.md#the-ring-schedule)
    (8, [dict(hp=1, cp=8, inner_ring=2), dict(hp=1, cp=8, inner_ring=4, placement="context_first")], 5),
])
def test_short_window_sends_fewer_blocks_as_the_formulas_say(world, configs, blocks):
    from loongtrain.parallel.layout import Layout
    from loongtrain.plan import traffic
    from tests.helpers.attention_cases import count_comm

    shape = dict(batch=1, seq_len=32, num_heads=4, num_kv_heads=2, head_dim=8)
    sliding = 3
    per_rank = run_distributed(count_comm, world, configs, shape, "float32", sliding)
    for rank, results in enumerate(per_rank):
        for cfg, res in zip(configs, results):
            layout = Layout(world_size=world, **cfg)
            assert traffic.ring_reach(layout, shape["seq_len"], sliding) == 1
            for backward in (False, True):
                want = traffic.attention_traffic(layout, rank, **shape, dtype_bytes=4, backward=backward,
                                                 sliding_window=sliding)
                full = traffic.attention_traffic(layout, rank, **shape, dtype_bytes=4, backward=backward)
                for kind in ("kv", "dkv"):
                    got = res["fwd"].bytes[kind] + (res["bwd"].bytes[kind] if backward else 0)
                    assert got == sum(want[kind].values()), (cfg, rank, kind, backward)
                    assert sum(full[kind].values()) == 0 or got < sum(full[kind].values())
            ops = traffic.attention_ops(layout, seq_len=shape["seq_len"], sliding_window=sliding)
            assert res["fwd"].ops["kv"] + res["bwd"].ops["kv"] == ops["kv"] == 2 * blocks
            assert res["bwd"].ops["dkv"] == ops["dkv"] == blocks


def test_balanced_layout_world4():
    configs = [dict(hp=1, cp=4), dict(hp=2, cp=2, placement="context_first"), dict(hp=1, cp=2, inner_ring=2)]
    counts = run_distributed(check_documents, 4, configs, [(4, 2)], [None, _short], 1e-10, True)
    assert min(counts) > 0
