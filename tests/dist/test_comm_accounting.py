"""Communication accounting: ops and bytes each rank sends equal the formulas (no redundant traffic)."""

from __future__ import annotations

import pytest

from loongtrain.parallel.layout import Layout
from loongtrain.plan import traffic
from tests.helpers.attention_cases import count_comm
from tests.helpers.dist_utils import run_distributed

pytestmark = pytest.mark.distributed


CONFIGS = [
    dict(hp=2, cp=2),
    dict(hp=4, cp=1),
    dict(hp=1, cp=4),
    dict(hp=1, cp=4, inner_ring=2, placement="context_first"),
    dict(hp=2, cp=2, inner_ring=2, placement="context_first", interleaved=True),
    dict(hp=2, cp=1),  # dp = 2
]


@pytest.mark.parametrize("num_kv_heads, dtype_name, dtype_bytes", [(8, "float32", 4), (2, "float32", 4),
                                                                    (1, "bfloat16", 2)])
def test_counted_traffic_equals_formula(num_kv_heads, dtype_name, dtype_bytes):
    shape = dict(batch=2, seq_len=32, num_heads=8, num_kv_heads=num_kv_heads, head_dim=16)
    per_rank = run_distributed(count_comm, 4, CONFIGS, shape, dtype_name)
    for rank, results in enumerate(per_rank):
        for cfg, res in zip(CONFIGS, results):
            layout = Layout(world_size=4, **cfg)
            fwd = traffic.attention_traffic(layout, rank, **shape, dtype_bytes=dtype_bytes, backward=False)
            total = traffic.attention_traffic(layout, rank, **shape, dtype_bytes=dtype_bytes, backward=True)
            fwd_ops = traffic.attention_ops(layout, backward=False)
            total_ops = traffic.attention_ops(layout, backward=True)
            for kind in ("a2a", "kv", "dkv"):
                counted_fwd = res["fwd"].bytes[kind]
                counted_all = counted_fwd + res["bwd"].bytes[kind]
                assert counted_fwd == sum(fwd.get(kind, {}).values()), (cfg, rank, kind)
                assert counted_all == sum(total.get(kind, {}).values()), (cfg, rank, kind)
                assert res["fwd"].ops[kind] == fwd_ops.get(kind, 0), (cfg, rank, kind)
                assert res["fwd"].ops[kind] + res["bwd"].ops[kind] == total_ops.get(kind, 0), (cfg, kind)
            by_peer = {}
            for kinds in total.values():
                for peer, nbytes in kinds.items():
                    by_peer[peer] = by_peer.get(peer, 0) + nbytes
            counted_by_peer = res["fwd"].bytes_by_peer + res["bwd"].bytes_by_peer
            assert dict(counted_by_peer) == {p: b for p, b in by_peer.items() if b}, (cfg, rank)
