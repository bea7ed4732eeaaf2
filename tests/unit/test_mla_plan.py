"""The planner's MLA and DeepSeek-V3 MoE (docs/planner.md, docs/attention.md#mla): the latent attention's memory
term and the shared experts' keep the planner as close to the simulation as it is for plain attention and routed
experts alone (the step under fake tensors, checked against real tensors in tests/unit/test_simulate.py); attention
FLOPs and ring bytes count the values' own head dim; the CUDA kernels' scratch the padded width; a model with dense
first layers is simulated by depth as whole."""

from __future__ import annotations

import dataclasses

import pytest

from loongtrain.attn.kernel_memory import kernel_scratch_bytes
from loongtrain.launch.simulate import simulate_by_depth, simulate_step
from loongtrain.model.config import ModelConfig
from loongtrain.parallel.config import ParallelConfig
from loongtrain.parallel.layout import Layout
from loongtrain.plan.attention_cost import AttnShape, attention_flops
from loongtrain.plan.memory_model import memory_per_rank
from loongtrain.plan.traffic import message_bytes

PLAIN = ModelConfig(vocab_size=1024, dim=512, num_layers=2, num_heads=8, num_kv_heads=8, ffn_dim=1024, head_dim=64)
MLA = dataclasses.replace(PLAIN, head_dim=96, kv_lora_rank=128, q_lora_rank=192, qk_rope_head_dim=32, v_head_dim=64)
LAYOUTS = [(1, ParallelConfig(recompute="none")), (4, ParallelConfig(hp=2, cp=2, zero="full", recompute="selective")),
           (4, ParallelConfig(hp=1, cp=4, recompute="full"))]


def _ratio(model: ModelConfig, world: int, parallel: ParallelConfig) -> float:
    seq = 4096 * world
    simulated = simulate_step(model, parallel, world, seq_len=seq)
    predicted = memory_per_rank(model, parallel.layout(world), parallel, seq_len=seq, batch=1, dtype_bytes=2,
                                zero_size=parallel.shard_size(world))
    return predicted["total"] / simulated.peak_bytes


@pytest.mark.parametrize("world, parallel", LAYOUTS, ids=["none", "hp2-cp2-selective", "cp4-full"])
def test_the_latent_attention_term_tracks_the_simulation_as_plain_attention_does(world, parallel):
    """At an activation-bound shape the planner's ratio to the simulation moves by at most 3% from plain attention's
    to MLA's (without the term: 6-10%, the latents and MLA's wider queries uncounted)."""
    assert abs(_ratio(MLA, world, parallel) - _ratio(PLAIN, world, parallel)) <= 0.03


def test_shared_experts_are_counted_as_the_routed_experts_are():
    moe = dataclasses.replace(PLAIN, num_experts=8, top_k=2, moe_ffn_dim=256, moe_layers=(0, 1))
    world, parallel = LAYOUTS[1]
    shared = dataclasses.replace(moe, shared_ffn_dim=512)
    assert abs(_ratio(shared, world, parallel) - _ratio(moe, world, parallel)) <= 0.02


def test_attention_flops_bytes_and_kernel_scratch_count_both_head_dims():
    shape = AttnShape(1, 4096, 8, 8, 96, 2, v_head_dim=64)
    assert attention_flops(shape, 1) == 4096 ** 2 * 8 * (96 + 64)  # QK^T over 96, PV over 64
    layout = Layout(4, 1, 4)
    msg = message_bytes(layout, **shape.kwargs())
    assert msg["kv"] == 8 * 1024 * (96 + 64) * 2 and msg["dkv"] == 8 * 1024 * (96 + 64) * 4
    narrow = dataclasses.replace(MLA, v_head_dim=32, qk_rope_head_dim=32)
    assert (kernel_scratch_bytes(MLA, Layout(1, 1, 1), 4096, 2, ("cuda_flash",))
            == kernel_scratch_bytes(narrow, Layout(1, 1, 1), 4096, 2, ("cuda_flash",)))  # V padded to 96 either way


def test_dense_first_layers_are_simulated_by_depth_as_whole():
    """DeepSeek-V3's shape in small: MLA, a dense first layer, then experts with a shared one; simulated at 1 + 3
    and 1 + 4 layers and extended to 6, the whole 6-layer step's peak."""
    model = dataclasses.replace(MLA, num_layers=6, num_experts=8, top_k=2, moe_ffn_dim=128, moe_layers=(1, 2, 3, 4, 5),
                                shared_ffn_dim=128)
    parallel = ParallelConfig(recompute="full")
    whole = simulate_step(model, parallel, 1, seq_len=1024)
    scaled = simulate_by_depth(model, parallel, 1, seq_len=1024)
    assert scaled.peak_bytes == pytest.approx(whole.peak_bytes, rel=0.01), (scaled, whole)
