"""The planner for models with experts (docs/moe-and-gpt-oss.md#mixture-of-experts): active parameters for FLOPs
and MFU, all experts for memory; the Qwen3-30B-A3B config's counts; the predicted peak against the trainer's own
step simulated under fake tensors (loongtrain/launch/simulate/)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from loongtrain.hf.convert import shape_config_from_hf
from loongtrain.hf.load import read_hf_config
from loongtrain.launch.simulate import simulate_step
from loongtrain.model.config import ModelConfig, active_params, flops_per_token, matmul_params, num_params, with_depth
from loongtrain.model.llama import Transformer
from loongtrain.parallel.config import ParallelConfig
from loongtrain.plan.memory_model import memory_per_rank

ROOT = Path(__file__).resolve().parents[2]
MOE = ModelConfig(vocab_size=256, dim=128, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=384, num_experts=16,
                  top_k=4, moe_ffn_dim=64, moe_layers=(0, 1))


def test_counts_of_the_qwen3_30b_a3b_config():
    model = shape_config_from_hf(read_hf_config(ROOT / "benchmarks/inputs/qwen3-30b-a3b"))
    assert (model.num_experts, model.top_k, model.moe_ffn_dim, model.moe_layers) == (128, 8, 768, tuple(range(48)))
    d, layers, vocab = 2048, 48, 151936
    attention = d * 32 * 128 * 2 + d * 4 * 128 * 2
    experts = 128 * 3 * d * 768 + 128 * d  # the experts and the router
    total = layers * (attention + experts + 2 * d) + d + 2 * vocab * d
    assert num_params(model) == total and 30.4e9 < total < 30.6e9  # "30.5B"
    active = total - layers * 120 * 3 * d * 768
    assert active_params(model) == active and 3.3e9 < active < 3.4e9  # "A3B": 3.3B active
    assert matmul_params(model) == active - layers * 2 * d - d - vocab * d  # FLOPs: no norms, no embedding lookup
    assert flops_per_token(model, 1) == pytest.approx(6 * matmul_params(model) + 12 * 0.5 * 32 * 128 * layers)


def test_loongtrains_decoder_with_experts_has_the_counted_parameters():
    model = Transformer(MOE)
    assert sum(p.numel() for p in model.parameters()) == num_params(MOE)
    dense = dataclasses.replace(MOE, moe_layers=(0,))  # a dense layer after an MoE one
    assert sum(p.numel() for p in Transformer(dense).parameters()) == num_params(dense)
    with pytest.raises(ValueError, match="cannot be simulated by depth"):
        with_depth(dense, 4)
    assert with_depth(MOE, 4).moe_layers == (0, 1, 2, 3)
    first_dense = dataclasses.replace(MOE, moe_layers=(1,))  # DeepSeek-V3's dense first layers: kept
    assert with_depth(first_dense, 4).moe_layers == (1, 2, 3)
    with pytest.raises(ValueError, match="1 layers leave none after the 1 dense first layers"):
        with_depth(first_dense, 1)


@pytest.mark.parametrize("world, parallel", [
    (4, ParallelConfig(hp=2, cp=2, zero="full", recompute="selective")),
    (4, ParallelConfig(hp=1, cp=4, zero="full", recompute="full", offload_activations=True)),
])
def test_planner_bounds_the_simulation_at_a_small_shape(world, parallel):
    # at this shape the weights and the routing dominate: the planner counts two gathered blocks (the simulation
    # one: no all-gather stream) and every MoE tensor at once; an upper bound within 25% (the Qwen3-30B-A3B
    # shape at its longest sequence: within 5%, tests/e2e/test_moe_cli.py)
    seq = 2048 * world
    simulated = simulate_step(MOE, parallel, world, seq_len=seq)
    predicted = memory_per_rank(MOE, parallel.layout(world), parallel, seq_len=seq, batch=1, dtype_bytes=2,
                                zero_size=parallel.shard_size(world))
    assert 1.0 <= predicted["total"] / simulated.peak_bytes <= 1.25, (predicted, simulated)


def test_bad_expert_shapes_raise():
    with pytest.raises(ValueError, match="top_k=5 must be at most num_experts=4"):
        dataclasses.replace(MOE, num_experts=4, top_k=5)
    with pytest.raises(ValueError, match=r"moe_layers=\[2\] must name distinct layers in \[0, 2\)"):
        dataclasses.replace(MOE, moe_layers=(2,))
    with pytest.raises(ValueError, match="moe_ffn_dim=0 must be a positive integer"):
        dataclasses.replace(MOE, moe_ffn_dim=0)
