"""The CUDA kernels' own backward scratch (loongtrain/attn/cuda_kernels.backward_scratch_bytes): what it
describes, that the per-head split follows the same description, and that the planner and the simulation
count it for the kernels the device's choice may pick (docs/planner.md#memory-per-device)."""

from __future__ import annotations

import pytest
import torch

from loongtrain.attn import cuda_kernels
from loongtrain.attn.cuda_kernels import CUDA_CUDNN, CUDA_FLASH, SCRATCH_KERNELS, backward_scratch_bytes
from loongtrain.attn.kernel_memory import kernel_scratch_bytes
from loongtrain.parallel.config import ParallelConfig
from loongtrain.plan.cluster import Cluster, load_cluster
from loongtrain.plan.memory_model import memory_per_rank
from loongtrain.plan.memory_terms import feature_terms
from loongtrain.train.memory_report import scratch_kernels
from tests.helpers.plan_cases import SMALL, memory, toy_cluster

BOTH = ("cuda_flash", "cuda_cudnn")


@pytest.mark.parametrize("kernel", SCRATCH_KERNELS)
@pytest.mark.parametrize("heads, kv_heads", [(32, 32), (32, 8), (32, 1)])
def test_one_call_scratch_is_the_fp32_dq_the_row_sums_and_gqa_expanded_grads(kernel, heads, kv_heads):
    b, sq, sk, d, e = 2, 4096, 6144, 128, 2
    dq_accum = 4 * b * sq * heads * d  # fp32 dQ accumulator
    row_sums = 4 * b * heads * sq  # fp32 sum(dO * O) per query row (FA2's softmax_d, cuDNN's softmax_sum)
    expanded = 2 * b * sk * heads * d * e if kv_heads != heads else 0  # dK and dV at the query heads
    assert backward_scratch_bytes(kernel, b, heads, kv_heads, sq, sk, d, e) == dq_accum + row_sums + expanded


def test_past_the_split_one_head_at_a_time(monkeypatch):
    b, h, hk, s, d, e = 1, 32, 8, 1 << 18, 128, 2
    whole = 4 * b * s * h * (d + 1) + 2 * b * s * h * d * e  # one call's (the test above)
    assert whole > cuda_kernels.SPLIT_BACKWARD_BYTES  # 256K tokens of 32 heads: 8.6 GB in one call
    one_head = 4 * b * s * (d + 1)
    per_head_results = b * d * (s * e + 2 * s * e)  # one head's dQ, dK, dV from the kernel
    fp32_sums = 2 * 2 * b * s * d * 4  # a KV head's dK/dV sums and the next ones
    assert backward_scratch_bytes("cuda_flash", b, h, hk, s, s, d, e) == one_head + per_head_results + fp32_sums
    monkeypatch.setattr(cuda_kernels, "SPLIT_BACKWARD_BYTES", whole)  # at the limit: one call
    assert backward_scratch_bytes("cuda_flash", b, h, hk, s, s, d, e) == whole


@pytest.mark.parametrize("kernel", [CUDA_FLASH, CUDA_CUDNN], ids=lambda k: k.name)
def test_the_split_follows_the_described_scratch(emulate, monkeypatch, kernel):
    """The backward makes one op call while its described one-call scratch is within SPLIT_BACKWARD_BYTES,
    and one per query head once past it: the description the planner counts is the one the kernel obeys."""
    ops = emulate(allow_fp64=False)
    b, h, hk, s, d = 1, 4, 2, 48, 16
    q, dout = (torch.randn(b, h, s, d, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(b, hk, s, d, dtype=torch.bfloat16) for _ in range(2))
    out, lse = kernel.forward(q, k, v, True, d ** -0.5)
    described = backward_scratch_bytes(kernel.name, b, h, hk, s, s, d, 2)
    for limit, calls in ((described, 1), (described - 1, h)):
        monkeypatch.setattr(cuda_kernels, "SPLIT_BACKWARD_BYTES", limit)
        ops.calls.clear()
        kernel.backward(dout, q, k, v, out, lse, True, d ** -0.5)
        assert len(ops.calls) == calls, (limit, ops.calls)


def test_the_planner_counts_the_largest_scratch_of_the_device_kernels():
    """The attention moment holds the kernel's scratch; of several kernels, the largest (cuDNN's row sums
    are FA2's too, so here they are equal; with one KV head per rank there is no expansion)."""
    from loongtrain.parallel.config import Layout

    layout, kw = Layout(4, 2, 2), dict(seq_len=4096, batch=1, zero_size=4, recompute="full", mlp_tiles="4")
    plain = memory(SMALL, layout, **kw)
    flash = memory(SMALL, layout, kernels=("cuda_flash",), **kw)
    both = memory(SMALL, layout, kernels=BOTH, **kw)
    t = 4096 / 4
    scratch = backward_scratch_bytes("cuda_flash", 1, SMALL.num_heads // 2, 1, int(t * 2), int(t * 2),
                                     SMALL.head_dim, 2)
    assert kernel_scratch_bytes(SMALL, layout, t, 2, BOTH) == scratch > 0
    assert flash["workspace"] - plain["workspace"] == scratch  # the attention moment is the larger here
    assert both["total"] >= flash["total"] > plain["total"]


def test_clusters_name_the_kernels_their_choice_may_pick():
    assert "cuda_cudnn" in load_cluster("h200").attention_kernels
    assert load_cluster("a100").attention_kernels == ("cuda_flash",)
    with pytest.raises(ValueError, match=r"attention_kernels=\['cuda_tpu'\].*one of \['cuda_flash', 'cuda_cudnn'\]"):
        toy_cluster(attention_kernels=("cuda_tpu",))
    assert isinstance(toy_cluster(attention_kernels=BOTH), Cluster)
    assert scratch_kernels(torch.device("cpu"), torch.bfloat16, 128) == ()  # CPU runs none of them


def test_the_simulation_counts_the_scratch_the_planner_counts():
    """A ring of two (fake ranks) where the attention moment is the peak: the scratch raises the planner's
    prediction and the simulated peak by the same bytes."""
    from loongtrain.launch.simulate import simulate_step
    from tests.unit.test_simulate import WIDE

    seq = 2 * 16384  # the attention moment is the planner's and the simulation's peak here
    parallel = ParallelConfig(recompute="full", zero="full", mlp_tiles="4", cp=2, hp=1)
    kw = dict(seq_len=seq, batch=1, dtype_bytes=2, zero_size=2)
    added = (memory_per_rank(WIDE, parallel.layout(2), parallel, features=feature_terms(kernels=BOTH), **kw)["total"]
             - memory_per_rank(WIDE, parallel.layout(2), parallel, **kw)["total"])
    simulated = (simulate_step(WIDE, parallel, 2, seq_len=seq, kernels=BOTH).peak_bytes
                 - simulate_step(WIDE, parallel, 2, seq_len=seq).peak_bytes)
    assert added == simulated > 0, (added, simulated)


def test_the_deterministic_flash_backward_keeps_a_dq_accumulator_per_split():
    """FA2's deterministic backward (torch's ``mha_bwd``): ``ceil(SMs / (B * H))`` fp32 dQ accumulators, not one;
    with few heads per rank, or one head at a time past the split, about one per SM; cuDNN's is unchanged."""
    from loongtrain.attn.cuda_kernels import deterministic_dq_copies

    b, h, s, d, e = 1, 32, 8192, 128, 2
    plain = backward_scratch_bytes("cuda_flash", b, h, h, s, s, d, e)
    assert deterministic_dq_copies(1, 32, 132) == 5 and deterministic_dq_copies(1, 4, 132) == 33
    assert deterministic_dq_copies(2, 132, 132) == 1
    det = backward_scratch_bytes("cuda_flash", b, h, h, s, s, d, e, deterministic_sms=132)
    assert det - plain == 4 * b * h * s * d * (5 - 1)
    assert backward_scratch_bytes("cuda_cudnn", b, h, h, s, s, d, e, deterministic_sms=132) == \
        backward_scratch_bytes("cuda_cudnn", b, h, h, s, s, d, e)
    s_long = 1 << 18  # past the split: one head per call, 132 accumulators of one head's dQ
    split = backward_scratch_bytes("cuda_flash", b, h, 8, s_long, s_long, d, e, deterministic_sms=132)
    assert split - backward_scratch_bytes("cuda_flash", b, h, 8, s_long, s_long, d, e) == 4 * s_long * d * 131


def test_the_planner_counts_the_deterministic_dq_accumulators():
    """``--deterministic`` through the memory terms (the planner's ``Workload``, the trainer's prediction): the
    attention moment holds FA2's extra dQ accumulators, by the device's SMs; without FA2 (cuDNN alone) nothing."""
    from loongtrain.attn.cuda_kernels import deterministic_dq_copies
    from loongtrain.parallel.config import Layout

    layout, kw = Layout(4, 2, 2), dict(seq_len=4096, batch=1, zero_size=4, recompute="full", mlp_tiles="4")
    t, heads = 4096 / 4, SMALL.num_heads // 2
    plain = memory(SMALL, layout, kernels=("cuda_flash",), **kw)["workspace"]
    for sms in (132, 148):
        terms = feature_terms(kernels=("cuda_flash",), deterministic=True, sm_count=sms)
        det = memory_per_rank(SMALL, layout, ParallelConfig(hp=2, cp=2, recompute="full", mlp_tiles="4"),
                              features=terms, dtype_bytes=2, **{k: v for k, v in kw.items()
                                                                if k not in ("recompute", "mlp_tiles")})["workspace"]
        extra = 4 * heads * int(t * 2) * SMALL.head_dim * (deterministic_dq_copies(1, heads, sms) - 1)
        assert det - plain == extra > 0, (sms, det - plain, extra)
    cudnn = feature_terms(kernels=("cuda_cudnn",), deterministic=True)
    assert kernel_scratch_bytes(SMALL, layout, t, 2, ("cuda_cudnn",), deterministic_sms=132) == \
        kernel_scratch_bytes(SMALL, layout, t, 2, ("cuda_cudnn",)) and len(cudnn) == 1
