"""MLA's head dims through 2D-Attention (docs/attention.md#mla): a V head dim different from Q/K's, sharded equal to
unsharded in fp64 (1e-10, forward and dq/dk/dv) on 4 gloo ranks at hp2 x cp2, hp1 x cp4, the double ring and
pure Ulysses; with GQA, packed documents and a short sliding window too."""

from __future__ import annotations

import pytest

from tests.helpers.attention_cases import check_documents, check_exact
from tests.helpers.dist_utils import run_distributed

pytestmark = pytest.mark.distributed

CONFIGS = [dict(hp=2, cp=2), dict(hp=1, cp=4), dict(hp=1, cp=4, inner_ring=2), dict(hp=4, cp=1)]


def _short(seq: int, cp: int) -> int:
    return max(1, seq // (2 * cp) - 1)  # less than a chunk: the short pass at cp 4


def test_v_head_dim_unlike_qk_world4():
    # one KV head: GQA, replicated to the head ranks at hp 4
    counts = run_distributed(check_exact, 4, CONFIGS, [(4, 1)], [(24, 16), (16, 24)], "float64", 1e-10)
    assert min(counts) == len(CONFIGS) * 2 * 2, counts  # every layout, both dims, causal and not


def test_v_head_dim_unlike_qk_with_documents_world4():
    counts = run_distributed(check_documents, 4, CONFIGS, [(4, 2)], [None, _short], 1e-10, False, (24, 16))
    assert min(counts) == len(CONFIGS) * 2 * 2, counts


def _native_mla(rank: int, world_size: int, configs: list[dict]) -> list[list[float]]:
    import dataclasses

    from loongtrain.model.llama import Transformer
    from tests.helpers.deepseek import native_mla_config
    from tests.helpers.gpt_oss import compare_sharded, native_forward

    config = dataclasses.replace(native_mla_config(), num_layers=2, moe_layers=(1,))
    results = []
    for cfg in configs:
        import loongtrain

        mesh = loongtrain.init_mesh(**cfg)
        for with_documents in (False, True):
            model = Transformer(config, seed=3).double()
            results.append(compare_sharded(model, native_forward, mesh, 32, with_documents, 1e-10))
    return results


def test_loongtrains_own_mla_decoder_sharded_equals_whole_world4():
    """loongtrain's decoder with MLA and shared experts: logits and every gradient at hp2 x cp2 and the double ring,
    with and without packed documents, equal the whole model's (fp64)."""
    results = run_distributed(_native_mla, 4, [dict(hp=2, cp=2), dict(hp=1, cp=4, inner_ring=2)])
    assert all(len(r) == 4 and max(max(e) for e in r) < 1e-10 for r in results), results
