"""The planner's step clock (docs/planner.md): the memory-bound bytes are the code's own (counted op by op under
fake tensors), the ring's merges likewise, the gradient all-reduce overlaps the backward as the trainer runs
it, kernel rates follow the call size, and the step is the sum of its four named terms."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from loongtrain.commands import main as loongtrain_main
from loongtrain.model.config import ModelConfig, get_preset, num_params
from loongtrain.parallel.buckets import BUCKET_BYTES
from loongtrain.parallel.config import ParallelConfig, effective_kv_heads, mlp_tile_count
from loongtrain.parallel.layout import Layout
from loongtrain.plan.attention_cost import AttnShape, attention_time
from loongtrain.plan.cluster import load_cluster
from loongtrain.plan.cost import TERMS, grad_sync_exposed, gradient_buckets, step_cost
from loongtrain.plan.step_bytes import OPTIMIZER_BYTES, head_bytes, layer_bytes, ring_step_bytes
from tests.helpers.counting import TrafficCounter, step_traffic

#: a shape no fit used (the coefficients were read off other widths)
SHAPE = ModelConfig(vocab_size=2048, dim=1536, num_layers=2, num_heads=12, num_kv_heads=4, ffn_dim=4096,
                    head_dim=128)


@pytest.mark.parametrize("parallel, world, dtype", [
    (ParallelConfig(recompute="selective"), 1, "bf16"),
    (ParallelConfig(recompute="none"), 1, "bf16"),
    (ParallelConfig(recompute="full", zero="full"), 2, "bf16"),  # FSDP2's bf16 weights
    (ParallelConfig(recompute="selective"), 1, "fp32"),
    (ParallelConfig(recompute="selective", hp=2, mlp_tiles="2"), 2, "bf16"),
    (ParallelConfig(recompute="full", zero="full", mlp_tiles="4"), 2, "bf16"),
    (ParallelConfig(recompute="none", mlp_tiles="3"), 1, "fp32"),
], ids=["autocast-selective", "autocast-none", "fsdp2-full", "fp32-selective", "hp2-tiles2", "fsdp2-tiles4",
        "fp32-tiles3"])
def test_memory_bound_bytes_are_what_the_code_moves(parallel, world, dtype):
    seq = 2048 * parallel.sp
    counted = step_traffic(SHAPE, parallel, world, seq, dtype)
    t, b = seq / parallel.sp, 2 if dtype == "bf16" else 4
    sharded = parallel.shard_size(world) > 1
    tiles = mlp_tile_count(parallel.mlp_tiles, int(t), SHAPE.dim, SHAPE.ffn_dim, strict=False)
    layer, forward = layer_bytes(SHAPE, tokens=t, kv_heads=effective_kv_heads(12, 4, parallel.hp), hp=parallel.hp,
                                 dtype_bytes=b, sharded=sharded, checkpointed=parallel.recompute != "none",
                                 mlp_tiles=tiles)
    predicted = SHAPE.num_layers * layer + head_bytes(SHAPE, tokens=t, dtype_bytes=b, sharded=sharded)
    assert predicted == pytest.approx(counted["forward"] + counted["backward"], rel=0.03), counted
    assert SHAPE.num_layers * forward < counted["forward"] < predicted  # the forward is a part of it
    if world == 1:  # the foreach AdamW step moves what the single-tensor one did, per parameter
        assert counted["optimizer"] == pytest.approx((OPTIMIZER_BYTES - 12) * num_params(SHAPE), rel=0.01)


def test_ring_step_bytes_are_what_the_ring_moves():
    from loongtrain.attn.masking import AttnMask
    from loongtrain.attn.ring import RingCall, local_ring_backward, local_ring_forward
    from loongtrain.parallel.zigzag import shard_indices

    s, h, d = 1024, 4, 32  # K/V heads = query heads: the CPU kernel expands none
    for cp, dtype in ((2, torch.bfloat16), (4, torch.float32)):
        gen = torch.Generator().manual_seed(cp)
        q, k, v, dout = (torch.randn(1, s, h, d, generator=gen).to(dtype).transpose(1, 2) for _ in range(4))
        shards = [[x.transpose(1, 2)[:, shard_indices(s, 1, cp, r, 0)].transpose(1, 2) for r in range(cp)]
                  for x in (q, k, v, dout)]
        call = RingCall(AttnMask(True), d ** -0.5)
        with TrafficCounter() as fwd:
            outs = local_ring_forward(*shards[:3], 1, call)
        with TrafficCounter() as bwd:
            local_ring_backward(shards[3], *shards[:3], [o for o, _ in outs], [lse for _, lse in outs], 1, call)
        f, b = ring_step_bytes(s // cp, h, h, d, dtype.itemsize, cp)
        assert cp * f == pytest.approx(fwd.forward / cp, rel=0.15)  # per member: cp steps
        assert cp * b == pytest.approx((bwd.forward + bwd.backward) / cp, rel=0.15)


def test_the_planners_buckets_are_the_trainers():
    """The planner's buckets are the trainer's (:class:`loongtrain.train.sync.GradientSync` on the real model):
    the same bytes in the same order."""
    from loongtrain.model import Transformer
    from loongtrain.train.sync import GradientSync

    model = dataclasses.replace(get_preset("1b"), num_layers=3)
    with torch.device("meta"):
        net = Transformer(model)
    sync = GradientSync(net, dp=1, bucket_bytes=BUCKET_BYTES // 8)  # many buckets, inside the layers too
    sizes = [4 * p.numel() for p in sync.params]
    trainer = [sum(sizes[i] for i in bucket) for bucket in sync.buckets]
    planner = gradient_buckets(model, BUCKET_BYTES // 8)
    assert len(trainer) > 2 * model.num_layers and [n for _, n in planner] == trainer


def test_gradient_all_reduce_overlaps_the_rest_of_the_backward():
    model = get_preset("1b")
    buckets = gradient_buckets(model)
    assert sum(n for _, n in buckets) == 4 * num_params(model)  # every fp32 gradient once
    single = {4 * model.vocab_size * model.dim, 4 * model.dim * model.ffn_dim}  # parameters larger than a bucket
    assert all(n <= BUCKET_BYTES or n in single for _, n in buckets)
    assert buckets[0][0] == 0 and buckets[-1][0] == model.num_layers  # the head first, the embedding last
    assert [r for r, _ in buckets] == sorted(r for r, _ in buckets)
    total = sum(2 * 7 / 8 * n / 100e9 for _, n in buckets)
    # a fast link: everything hides behind the backward still running but the buckets full only at its end
    # (the first layer's last gradients, the embedding)
    fast = grad_sync_exposed(model, layer_backward=1.0, world=8, bandwidth=100e9, latency=0.0)
    last = [n for r, n in buckets if r == model.num_layers]
    assert len(last) == 2 and fast == pytest.approx(sum(2 * 7 / 8 * n / 100e9 for n in last))
    # a slow link: all of it but the overlapped part, which is at most the backward
    slow = grad_sync_exposed(model, layer_backward=1e-4, world=8, bandwidth=100e9, latency=0.0)
    assert total - model.num_layers * 1e-4 <= slow <= total
    # in the step: only without ZeRO on several ranks
    h200 = load_cluster("h200")
    assert step_cost(model, ParallelConfig(), h200, nodes=1, world=1, seq_len=8192).breakdown["grad-sync"] == 0
    dp = step_cost(model, ParallelConfig(), h200, nodes=1, seq_len=8192)
    zero = step_cost(model, ParallelConfig(zero="full"), h200, nodes=1, seq_len=8192)
    assert dp.breakdown["grad-sync"] > 0 and zero.breakdown["grad-sync"] == 0 < zero.breakdown["zero"]


def test_kernel_rates_follow_the_call_size():
    h200 = load_cluster("h200")
    rows = h200.attention_rates
    assert h200.attention_rate(128, rows[0][1]) == rows[0][2] * 1e12
    assert h200.attention_rate(128, 1.0) == rows[0][2] * 1e12 and h200.attention_rate(128, 1e12) == rows[-1][2] * 1e12
    between = h200.attention_rate(128, (rows[0][1] * rows[1][1]) ** 0.5)  # halfway in log
    assert between == pytest.approx((rows[0][2] + rows[1][2]) / 2 * 1e12)
    assert h200.attention_rate(64, rows[1][1]) == rows[1][2] * 1e12  # the nearest measured head dim
    slow_small = dataclasses.replace(h200, attention_rates=((128, 1e3, 100.0), (128, 1e7, 400.0)))
    shape = AttnShape(1, 65536, 32, 8, 128)
    one = attention_time(Layout(1, 1, 1), shape, slow_small)
    ring = attention_time(Layout(8, 1, 8), shape, slow_small)
    assert ring.compute_fwd * 8 > one.compute_fwd  # 8K-token steps run slower than one 64K call
    assert ring.memory_fwd > 0 == one.memory_fwd  # a ring merges, a ring of one member does not


def test_the_step_is_its_four_terms(capsys):
    c = step_cost(get_preset("7b-gqa"), ParallelConfig(hp=2, cp=4, zero="full", recompute="selective"),
                  load_cluster("h200"), nodes=1, seq_len=131072)
    assert c.step_time == pytest.approx(sum(c.terms.values()), rel=1e-12)
    assert set(c.terms) == set(TERMS) and all(v >= 0 for v in c.terms.values()) and c.terms["memory_bound"] > 0
    assert loongtrain_main(["plan", "--model", "1b", "--gpus", "8", "--cluster", "h200", "--seq-len", "128K",
                            "--json", "--top", "2"]) == 0
    row = json.loads(capsys.readouterr().out)["candidates"][0]
    assert set(row["terms_s"]) == set(TERMS)
    assert row["step_time_s"] == pytest.approx(sum(row["terms_s"].values()), rel=1e-9)
    assert loongtrain_main(["plan", "--model", "1b", "--gpus", "8", "--cluster", "h200", "--seq-len", "128K",
                            "--top", "2"]) == 0
    text = capsys.readouterr().out
    assert all(word in text for word in ("compute", "mem-bnd", "comm", "optim"))
