"""Sharded 2D-Attention equals unsharded attention: forward and dq, dk, dv, over gloo ranks."""

from __future__ import annotations

import pytest

from tests.helpers.attention_cases import check_exact, factorisations
from tests.helpers.dist_utils import run_distributed

pytestmark = pytest.mark.distributed

HEADS = [(8, 8), (8, 2), (8, 1)]  # MHA, GQA (hp > Hkv for hp in 4, 8), MQA


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_float64_every_factorisation(world_size):
    configs = [dict(hp=hp, cp=cp) for hp, cp in factorisations(world_size)]
    counts = run_distributed(check_exact, world_size, configs, HEADS, [64, 128], "float64", 1e-10)
    assert min(counts) > 0


def test_float32_world4():
    configs = [dict(hp=hp, cp=cp) for hp, cp in factorisations(4)]
    counts = run_distributed(check_exact, 4, configs, [(8, 2)], [64], "float32", 1e-5)
    assert min(counts) == 2 * len(configs), counts  # every rank compared every layout, causal and not


def test_bfloat16_world4():
    # bf16 inputs, fp32 lse merge; compared with float64 math on the same (bf16-rounded) inputs.
    configs = [dict(hp=2, cp=2), dict(hp=1, cp=4), dict(hp=4, cp=1)]
    counts = run_distributed(check_exact, 4, configs, [(8, 2)], [64], "bfloat16", 5e-2)
    assert min(counts) == 2 * len(configs), counts  # every rank compared every layout, causal and not


def test_shard_gather_roundtrip():
    from tests.helpers.attention_cases import check_shard_gather

    configs = [dict(hp=hp, cp=cp) for hp, cp in factorisations(8)]
    configs.append(dict(hp=2, cp=4, inner_ring=2, placement="context_first", interleaved=True))
    run_distributed(check_shard_gather, 8, configs)
