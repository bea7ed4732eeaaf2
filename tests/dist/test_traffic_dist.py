"""The planner's traffic formulas equal the bytes counted on real gloo ranks."""

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


CASES = [  # (hp, cp, inner_ring, placement, interleaved, num_heads, num_kv_heads, v_head_dim)
    (2, 2, 1, "head_first", False, 4, 2, 4),
    (1, 4, 2, "context_first", False, 4, 2, 4),
    (4, 1, 1, "head_first", False, 4, 1, 4),
    (2, 2, 2, "context_first", False, 4, 4, 4),
    (1, 4, 4, "head_first", True, 4, 2, 4),
    (1, 2, 1, "head_first", False, 4, 2, 4),  # dp = 2
    (2, 2, 1, "head_first", False, 4, 4, 2),  # MLA: values narrower than queries and keys
    (1, 4, 2, "head_first", False, 4, 1, 6),  # values wider
]


def _count(rank: int, world: int) -> list:
    import torch

    from loongtrain.attn.api import attention
    from loongtrain.parallel.comm import CommCounter
    from loongtrain.parallel.mesh import init_mesh

    results = []
    for hp, cp, inner_ring, placement, interleaved, h, hkv, dv in CASES:
        mesh = init_mesh(hp, cp, inner_ring=inner_ring, placement=placement, interleaved=interleaved)
        s_local, d = 32 // (hp * cp), 4
        q = torch.randn(1, s_local, h, d, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(1, s_local, hkv, d, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(1, s_local, hkv, dv, dtype=torch.bfloat16, requires_grad=True)
        with CommCounter() as counter:
            attention(q, k, v, mesh).sum().backward()
        results.append((dict(counter.ops), dict(counter.bytes), dict(counter.bytes_by_peer)))
    return results


@pytest.mark.distributed
def test_formulas_match_counted_bytes():
    from tests.helpers.dist_utils import run_distributed

    per_rank = run_distributed(_count, 4)
    for i, (hp, cp, inner_ring, placement, interleaved, h, hkv, dv) in enumerate(CASES):
        layout = Layout(4, hp, cp, inner_ring, placement, interleaved)
        for rank in range(4):
            ops, nbytes, by_peer = per_rank[rank][i]
            t = attention_traffic(layout, rank, batch=1, seq_len=32, num_heads=h, num_kv_heads=hkv,
                                  head_dim=4, dtype_bytes=2, v_head_dim=dv)
            expect_ops = {k: n for k, n in attention_ops(layout).items() if n}
            assert ops == expect_ops, (CASES[i], rank)
            assert nbytes == {k: sum(p.values()) for k, p in t.items() if p}, (CASES[i], rank)
            total: dict[int, int] = {}
            for peers in t.values():
                for peer, n in peers.items():
                    total[peer] = total.get(peer, 0) + n
            assert by_peer == total, (CASES[i], rank)
