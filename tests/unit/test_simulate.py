"""The full-size memory simulation (docs/planner.md) checked where real tensors fit: the trainer's step
under FakeTensorMode peaks within 5% of the same step on real CPU tensors (both counted by torch's
MemTracker, storage by storage, host memory apart from the device's), on one rank and as one rank of four
with the fake process group, with and without the offload and tiling modes; the host side against an
independent count (the offloaded block inputs, the offloaded states); activation offload's device
memory independent of depth; the start-up memory report's device/host split under ``--offload-params``;
and ``loongtrain plan --simulate --json`` prints the simulated and predicted peaks side by side."""

from __future__ import annotations

import json

import pytest
import torch

from loongtrain.commands import main as loongtrain_main
from loongtrain.launch.simulate import simulate_step
from loongtrain.model.config import ModelConfig, num_params
from loongtrain.parallel.config import ParallelConfig
from loongtrain.plan.memory_model import memory_per_rank

MODEL = ModelConfig(vocab_size=256, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=192)
TOLERANCE = 0.05
SEQ = 512


@pytest.mark.parametrize("world, parallel", [
    (1, ParallelConfig(recompute="full")),
    (4, ParallelConfig(hp=2, cp=2, zero="full", recompute="selective")),
    (4, ParallelConfig(hp=1, cp=2, zero="none", recompute="none")),  # dp = 2: the gradient all-reduce too
    (1, ParallelConfig(recompute="selective", offload_activations=True, mlp_tiles="auto")),
    (4, ParallelConfig(hp=2, cp=2, zero="full", recompute="full", offload_activations=True, offload_params=True,
                       mlp_tiles="2")),
])
def test_simulation_matches_real_tensors(world, parallel):
    fake = simulate_step(MODEL, parallel, world, seq_len=SEQ, dtype="bf16")
    real = simulate_step(MODEL, parallel, world, seq_len=SEQ, dtype="bf16", fake=False)
    assert real.peak_bytes > 0 and real.parts["activation"] > 0  # the step ran and was counted
    assert abs(fake.peak_bytes - real.peak_bytes) <= TOLERANCE * real.peak_bytes, (fake, real)
    offloads = parallel.offload_activations or parallel.offload_params
    assert (real.host_bytes > 0) == offloads, real
    assert abs(fake.host_bytes - real.host_bytes) <= TOLERANCE * real.host_bytes, (fake, real)


def test_host_bytes_are_what_the_offload_modes_move():
    # activation offload, full checkpointing: every block's input (fp32 residual stream under autocast)
    acts = simulate_step(MODEL, ParallelConfig(recompute="full", offload_activations=True), 1, seq_len=SEQ,
                         fake=False)
    assert acts.host_bytes == MODEL.num_layers * SEQ * MODEL.dim * 4
    assert acts.host_parts["activation"] == acts.host_bytes
    # parameter offload: fp32 parameters, gradients and AdamW's m, v on the host (plus the host step's
    # temporaries: a few fp32 tensors of one parameter's size at a time); none of them on the device
    params = simulate_step(MODEL, ParallelConfig(zero="full", recompute="full", offload_params=True), 1,
                           seq_len=SEQ)
    states = 16 * num_params(MODEL)
    largest = 4 * MODEL.vocab_size * MODEL.dim  # fp32 bytes of the embedding (or the head)
    assert states <= params.host_bytes <= states + 4 * largest, params
    assert params.parts["optstate"] == 0 and params.host_parts["optstate"] >= 8 * num_params(MODEL)


def _offloaded(layers: int):
    model = ModelConfig(vocab_size=64, dim=32, num_layers=layers, num_heads=4, num_kv_heads=2, ffn_dim=64)
    return simulate_step(model, ParallelConfig(recompute="full", offload_activations=True), 1, seq_len=4096)


def test_simulated_device_activations_do_not_grow_with_depth():
    two, eight = _offloaded(2), _offloaded(8)
    block = 4096 * 32 * 4  # one block's checkpointed input, fp32 under autocast
    # device: all but weights, gradients and states (MemTracker files the fetched blocks under activations or
    # temporaries depending on the moment) is the same blocks' worth
    def device_activations(sim):
        return sim.peak_bytes - sum(sim.parts[k] for k in ("parameter", "buffer", "gradient", "optstate"))

    assert device_activations(eight) == device_activations(two) > 2 * block
    assert (two.host_bytes, eight.host_bytes) == (2 * block, 8 * block)  # host: every block's input


#: a shape whose peak is the activations' (fake mode's cost is the number of ops, not the sizes)
WIDE = ModelConfig(vocab_size=8192, dim=1024, num_layers=4, num_heads=8, num_kv_heads=2, ffn_dim=3584)
WIDE_SEQ = 65536
@pytest.mark.parametrize("modes", [
    {"offload_activations": True},
    {"mlp_tiles": "4"},  # auto: 64 tiles of dim tokens here; the planner's term is the same, 16x the ops
    {"zero": "full", "offload_params": True},
    {"zero": "full", "offload_params": True, "offload_activations": True, "mlp_tiles": "4"},
    {},  # none of them: full checkpointing under autocast
], ids=["offload_activations", "mlp_tiles", "offload_params", "all", "none"])
def test_planner_matches_the_simulation_per_mode(modes):
    parallel = ParallelConfig(recompute="full", **modes)
    predicted = memory_per_rank(WIDE, parallel.layout(1), parallel, seq_len=WIDE_SEQ, batch=1, zero_size=1,
                                dtype_bytes=2)
    simulated = simulate_step(WIDE, parallel, 1, seq_len=WIDE_SEQ)
    assert abs(predicted["total"] / simulated.peak_bytes - 1) <= 0.10, (predicted, simulated)
    if parallel.offload_activations or parallel.offload_params:  # the host: what the modes move, or a bit more
        assert 0.99 <= predicted["host"] / simulated.host_bytes <= 1.25, (predicted, simulated)


def test_startup_report_counts_offloaded_states_on_the_host():
    from loongtrain.launch.config import TrainConfig, run_of
    from loongtrain.launch.simulate import fake_ranks
    from loongtrain.parallel.mesh import init_mesh
    from loongtrain.train.memory_report import metrics_fields
    from loongtrain.train.trainer import Trainer

    cfg = TrainConfig.from_dict(dict(model="tiny", seq_len=64, batch_size=1, dtype="fp32", memory_report=False,
                      parallel=ParallelConfig(zero="full", recompute="full", offload_params=True,
                                              offload_activations=True)))
    ids = torch.randint(0, MODEL.vocab_size, (1, 64))
    batch = {"input_ids": ids, "labels": ids, "position_ids": torch.arange(64)[None]}
    with fake_ranks(1):  # FSDP2's CPUOffloadPolicy on a one-rank group, in this process
        trainer = Trainer(run_of(cfg, MODEL), init_mesh(1, 1), torch.device("cpu"), batches=lambda *a: iter(()))
        report = trainer.memory_report(batch)
    shards = sum(p.to_local().numel() * 4 for p in trainer.model.parameters())
    assert report["params"] == report["grads"] == report["optimizer_state"] == 0  # nothing of them on the device
    assert report["host_states"] == 4 * shards  # parameters, gradients (their size), AdamW's two moments
    assert report["host_activations"] == MODEL.num_layers * 64 * MODEL.dim * 4  # the offloaded block inputs
    fields = metrics_fields(report)
    assert fields["mem_host_gib"] == (report["host_states"] + report["host_activations"]) / 2**30
    assert fields["mem_total_gib"] == report["activations"] / 2**30


def test_plan_simulate_json(tmp_path, capsys):
    config = tmp_path / "plan.toml"
    config.write_text("[model]\nvocab_size = 256\ndim = 64\nnum_layers = 2\nnum_heads = 4\nnum_kv_heads = 2\n"
                      "ffn_dim = 192\n")
    argv = ["plan", "--config", str(config), "--gpus", "1", "--cluster", "h200", "--seq-len", "1K", "--simulate",
            "--json", "--modes", "on", "--offload-activations", "--offload-params", "--mlp-tiles", "auto"]
    assert loongtrain_main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert "offload_activations offload_params mlp_tiles=auto" in out["configuration"] and out["world_size"] == 1
    assert out["simulated_device_gib"] > 0 and out["predicted_device_gib"] > 0
    assert out["simulated_host_gib"] > 0 and out["predicted_host_gib_per_rank"] > 0
    assert out["device_ratio"] == pytest.approx(out["predicted_device_gib"] / out["simulated_device_gib"])
    assert out["host_ratio"] == pytest.approx(out["predicted_host_gib_per_rank"] / out["simulated_host_gib"])


@pytest.mark.parametrize("layout", [
    {"hp": 2},  # the heads' all-to-all
    {"cp": 2},  # a ring of two
    {"hp": 2, "cp": 2, "offload_keep": 1},  # both, the last block kept on the device
], ids=["hp2", "cp2", "hp2-cp2-keep1"])
def test_planner_matches_the_simulation_sharded(layout):
    """FSDP2 over the ranks, activation offload and MLP tiles on 2 and 4 (fake) ranks: device within 10%,
    host exact (every offloaded block's input)."""
    from loongtrain.plan.memory_model import memory_per_rank

    parallel = ParallelConfig(recompute="full", zero="full", offload_activations=True, mlp_tiles="4", **layout)
    world = parallel.sp
    predicted = memory_per_rank(WIDE, parallel.layout(world), parallel, seq_len=WIDE_SEQ * world, batch=1,
                                dtype_bytes=2, zero_size=world)
    simulated = simulate_step(WIDE, parallel, world, seq_len=WIDE_SEQ * world)
    assert abs(predicted["total"] / simulated.peak_bytes - 1) <= 0.10, (predicted, simulated)
    assert predicted["host"] == simulated.host_bytes, (predicted, simulated)


#: 5 blocks, and a vocabulary whose chunked loss takes chunks of 64 tokens (the loss's alike loop runs 3 of 8)
DEEP = ModelConfig(vocab_size=2**20, dim=64, num_layers=5, num_heads=4, num_kv_heads=2, ffn_dim=192)


@pytest.mark.parametrize("world, parallel", [
    (1, ParallelConfig(recompute="none")),
    (1, ParallelConfig(recompute="selective", zero="full", offload_activations=True, mlp_tiles="auto",
                       offload_params=True)),
    (4, ParallelConfig(hp=2, cp=2, zero="full", recompute="full")),
], ids=["none", "selective-every-memory-mode", "hp2-cp2-fsdp2-full"])
def test_simulation_by_depth_equals_the_whole_step(world, parallel):
    """Simulations at 3 and 4 blocks, their alike loops (loss chunks, MLP tiles of 64 tokens) run in part,
    extended phase by phase to 5 blocks, give the whole 5-block step's peaks."""
    from loongtrain.launch import simulate
    from loongtrain.launch.simulate.fake_step import alike_loops
    from loongtrain.loss import chunked

    seq = 512 * parallel.sp
    assert simulate.DEPTHS[1] < DEEP.num_layers  # extended, not simulated whole
    assert chunked.default_chunk_tokens(DEEP.vocab_size) == 64
    with alike_loops():  # run in part: 3 of the 8 chunks of a rank's 512 tokens
        assert list(chunked._chunks(512, 64)) == [(0, 64), (64, 128), (448, 512)]
    whole = simulate_step(DEEP, parallel, world, seq_len=seq)
    scaled = simulate.simulate_by_depth(DEEP, parallel, world, seq_len=seq)
    assert scaled.peak_bytes == pytest.approx(whole.peak_bytes, rel=0.01), (scaled, whole)
    assert scaled.host_bytes == pytest.approx(whole.host_bytes, rel=0.01, abs=0), (scaled, whole)
    assert (whole.host_bytes > 0) == (parallel.offload_activations or parallel.offload_params)
