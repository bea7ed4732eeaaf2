"""The planner's offload and tiling modes, device counts, longest-sequence search and generated CLI
(docs/planner.md): hand-computed memory terms, bisection, JSON interface, old flags, and the old
predictions bit-identical to a golden file written by the pre-change planner."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest

from loongtrain.commands.plan import main, parse_plan_args
from loongtrain.parallel.config import ParallelConfig, mlp_tile_count
from loongtrain.parallel.layout import Layout
from loongtrain.plan.cluster import load_cluster
from loongtrain.plan.cost import step_cost
from loongtrain.plan.max_seq import max_seq_len
from loongtrain.plan.search import best_fitting, plan, world_size
from loongtrain.plan.step_bytes import head_bytes
from tests.helpers.plan_cases import SMALL, memory, toy_cluster

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "plan_golden.json"
SMALL4 = dataclasses.replace(SMALL, num_layers=4)  # 4 * 36992 + 64 + 2 * 256 * 64 = 180800 parameters
P4, P_L = 180800, 36992


def test_mlp_tiles_keep_one_tile_of_the_intermediates():
    layout, kw = Layout(8, 2, 4), dict(seq_len=1024, batch=1, zero_size=8, dtype_bytes=2)  # t = 128 tokens
    plain = memory(SMALL, layout, recompute="full", **kw)
    tiled = memory(SMALL, layout, recompute="full", mlp_tiles="2", **kw)
    # SwiGLU's 4 * f * b = 4 * 128 * 2 bytes per token: half of them at a time; the MLP's norm output per tile
    assert tiled["recompute"] == plain["recompute"] - 128 * 4 * 128 * 2 / 2 - 128 * 64 * 2
    assert {k: v for k, v in tiled.items() if k not in ("recompute", "workspace", "total")} == \
        {k: v for k, v in plain.items() if k not in ("recompute", "workspace", "total")}
    # the block's backward (memory_model.layer_moments): the MLP's moment shrinks with the tiles (SwiGLU's
    # gradients of one tile: 3 * f * b / 2 against 2 * f * b whole), the attention kernel's does not (what it
    # holds is the recomputed set less the MLP's part, tiled or not), and here it is the larger
    mlp_plain, mlp_tiled = 128 * (2 * 64 * 2 + 2 * 128 * 2), 128 * (2 * 64 * 2 + 3 * 128 * 2 / 2)
    assert plain["workspace"] > mlp_plain and tiled["workspace"] > mlp_tiled
    assert tiled["recompute"] + tiled["workspace"] == plain["recompute"] + plain["workspace"]
    # auto is the trainer's rule (parallel.config.mlp_tile_count): ceil(f / d) = 2 tiles of the 128 tokens
    auto = memory(SMALL, layout, recompute="full", mlp_tiles="auto", **kw)
    assert mlp_tile_count("auto", 128, SMALL.dim, SMALL.ffn_dim) == 2 and auto == tiled


def test_activation_offload_keeps_two_blocks_on_the_device():
    layout, kw = Layout(8, 2, 4), dict(seq_len=1024, batch=1, zero_size=8, dtype_bytes=2, recompute="full")
    plain = memory(SMALL4, layout, **kw)
    off = memory(SMALL4, layout, offload_activations=True, **kw)
    block = 128 * 64 * 2  # a recomputed block's input: t * d * r (FSDP2 bf16: r = b = 2)
    final_norm = 128 * 64 * 2
    assert plain["activations"] == 4 * block + final_norm and plain["host"] == 0
    assert off["activations"] == 2 * block + final_norm and off["host"] == 4 * block
    # in a block's backward only its own input is on the device (the previous block comes back after its peaks)
    assert off["total"] == plain["total"] - 3 * block
    # --offload-keep 2: the last two blocks stay; in the last block's backward both inputs are on the device
    kept = memory(SMALL4, layout, offload_activations=True, offload_keep=2, **kw)
    assert kept["host"] == 2 * block and kept["activations"] == 4 * block + final_norm
    assert kept["total"] == off["total"] + block
    eight = memory(dataclasses.replace(SMALL, num_layers=8), layout, offload_activations=True, **kw)
    assert eight["activations"] == off["activations"]  # does not grow with depth; the host copy does
    assert eight["host"] == 2 * off["host"]


def test_parameter_offload_moves_the_states_to_the_host():
    layout, kw = Layout(8, 2, 4), dict(seq_len=1024, batch=1, dtype_bytes=2, recompute="full")
    plain = memory(SMALL4, layout, zero_size=8, **kw)
    off = memory(SMALL4, layout, zero_size=8, offload_params=True, **kw)
    adamw = 3 * 4 * 256 * 64 / 8  # the host AdamW step's fp32 temporaries of the largest shard (the head's)
    assert off["states"] == 0 and off["host"] == 16 * P4 / 8 + adamw
    assert off["working_params"] == plain["working_params"]
    base = off["working_params"]  # no state, no gradient on the device: the loss, a block's backward, the end
    layer = base + off["activations"] - 128 * 64 * 2 + off["recompute"] + off["workspace"]  # 4 block inputs
    assert off["total"] == max(base + off["activations"] + off["logits"], layer, base)
    # one device (z = 1): FSDP2's bf16 gathering (two blocks + root + the larger of a block's and the root's
    # bf16 gradient with its fp32 copy: the block's, 36992 > 2 * 256 * 64 + 64)
    one = memory(SMALL4, Layout(1, 1, 1), zero_size=1, offload_params=True, **kw)
    assert one["working_params"] == 2 * (2 * P_L + 2 * 256 * 64 + 64) + (2 + 4) * P_L
    assert one["host"] == 16 * P4 + 8 * adamw and one["states"] == 0


def test_host_memory_decides_fit_and_the_message_names_it():
    cluster = toy_cluster(memory_gib=1.0, host_memory_gib=1e-6)  # ~1 KiB of host memory per node
    off = ParallelConfig(cp=4, zero="full", recompute="full", offload_activations=True)
    c = step_cost(SMALL4, off, cluster, nodes=1, seq_len=256)
    assert c.host_per_node == 4 * c.memory["host"] and not c.fits and c.memory["total"] < cluster.usable_memory
    slow = step_cost(SMALL4, off, toy_cluster(host_link_gbyte_s=1e-9), nodes=1, seq_len=256)  # 1 B/s
    fast = step_cost(SMALL4, off, toy_cluster(host_link_gbyte_s=1e9), nodes=1, seq_len=256)
    # per layer a block's input (64 tokens * 64 * 2 B) out and back at 1 B/s, beyond the layer's busy time
    # (layers' compute, memory-bound ops and ring: the breakdown's less the head's, 6 * V * d * t / rate = 3072 s
    # of matmuls and its memory-bound bytes)
    head = 6 * 256 * 64 * 64 / 2048 + head_bytes(SMALL4, tokens=64, dtype_bytes=2, sharded=True) / cluster.memory_bw
    busy = (slow.breakdown["compute"] + slow.breakdown["memory-bound"] - head + slow.breakdown["ring-outer"]) / 4
    assert busy < 2 * 64 * 64 * 2
    assert slow.breakdown["offload"] == pytest.approx(4 * (2 * 64 * 64 * 2 - busy), rel=1e-12)
    assert fast.breakdown["offload"] == 0 and fast.step_time < slow.step_time
    # --offload-keep 2: only the first two blocks' inputs move; the kept ones cost no copy time
    kept = step_cost(SMALL4, dataclasses.replace(off, offload_keep=2), toy_cluster(host_link_gbyte_s=1e-9),
                     nodes=1, seq_len=256)
    assert kept.breakdown["offload"] == pytest.approx(2 * (2 * 64 * 64 * 2 - busy), rel=1e-12)
    # 64K tokens: the smallest configuration without host memory needs 35.0 MiB per device (tiled MLP), with
    # offload 30.5 MiB and 34.1 MiB of host memory per node; on 33 MiB devices with 1 KiB of host memory
    # nothing fits, and the message says it is the host memory
    small = toy_cluster(memory_gib=33 / 1024, host_memory_gib=1e-6)
    with pytest.raises(ValueError, match="fits on the device but needs 0.0333 GiB of host memory per node"):
        best_fitting(SMALL4, small, nodes=1, seq_len=65536, modes="auto")
    assert load_cluster("h200").host_memory_gib == 2048 and load_cluster("h200").usable_host_memory > 0


def test_device_counts_part_of_a_node_or_whole_nodes():
    h200 = load_cluster("h200")
    assert world_size(h200, gpus=1) == (1, 1) and world_size(h200, gpus=4) == (4, 1)
    assert world_size(h200, gpus=16) == (16, 2) and world_size(h200, nodes=2) == (16, 2)
    with pytest.raises(ValueError, match="gpus=12 does not fit h200"):
        world_size(h200, gpus=12)
    one = plan("1b", "h200", gpus=1, seq_len=8192)
    assert one[0].world_size == 1 and {(c.config.hp, c.config.cp) for c in one} == {(1, 1)}
    four = plan("1b", "h200", gpus=4, seq_len=8192)
    assert all(c.world_size == 4 and c.config.zero != "hybrid" for c in four)


def test_modes_only_when_needed():
    fits = plan("1b", "h200", gpus=8, seq_len=65536, modes="auto")
    assert fits[0].fits and not any(c.config.offload_activations or c.config.offload_params for c in fits)
    needs = plan("7b-gqa", "h200", gpus=8, seq_len=4 << 20, modes="auto")
    best = needs[0].config
    assert needs[0].fits and (best.offload_activations or best.offload_params or best.mlp_tiles != "1")
    assert not plan("7b-gqa", "h200", gpus=8, seq_len=4 << 20, modes="off")[0].fits


def test_max_seq_len_is_the_last_fitting_length_on_the_grid():
    cluster = toy_cluster(memory_gib=2.0**-6)  # 16 MiB devices, 4 per node
    length, best = max_seq_len(SMALL4, cluster, nodes=1, modes="off")
    unit = 2 * 4
    assert length % unit == 0 and best.fits and best.world_size == 4
    assert plan(SMALL4, cluster, nodes=1, seq_len=length)[0].fits
    assert not plan(SMALL4, cluster, nodes=1, seq_len=length + unit)[0].fits
    more, _ = max_seq_len(SMALL4, cluster, nodes=1, modes="auto")
    assert more > length  # offloading and tiling reach further
    with pytest.raises(ValueError, match=r"seq_len=8 \(the shortest valid\)"):
        max_seq_len(SMALL4, toy_cluster(memory_gib=2.0**-20), nodes=1)


def test_cli_max_seq_len_and_device_errors(capsys):
    assert main(["--model", "1b", "--gpus", "8", "--cluster", "h200", "--max-seq-len", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert isinstance(out["max_seq_len"], int) and out["world_size"] == 8
    assert out["candidate"]["fits"] and out["configuration"].startswith("hp=")
    assert main(["--model", "1b", "--gpus", "12", "--cluster", "h200", "--seq-len", "64K"]) == 2
    assert "gpus=12" in capsys.readouterr().err
    assert main(["--model", "13b", "--gpus", "1", "--cluster", "a100", "--max-seq-len", "--modes", "off"]) == 2
    assert "no sequence length fits" in capsys.readouterr().err


def test_generated_parser_takes_train_names_only(tmp_path):
    cfg = parse_plan_args(["--model", "1b", "--seq-len", "128K", "--nodes", "2", "--batch-size", "2",
                           "--cluster", "h100", "--recompute", "full", "--offload-activations"])
    assert cfg.data.batch_size == 2 and cfg.cluster == "h100" and cfg.data.seq_len == 131072
    assert cfg.filters() == {"recompute": "full", "offload_activations": True}
    for old in (["--batch", "2"], ["--ckpt", "full"], ["--plan-cluster", "h100"]):  # no second names
        with pytest.raises(ValueError, match=old[0]):
            parse_plan_args(old)
    path = tmp_path / "plan.toml"
    path.write_text('model = "1b"\nseq_len = "1M"\nbatch_size = 3\nrecompute = "selective"\ncluster = "h200"\n'
                    'gpus = 4\n')
    cfg = parse_plan_args(["--config", str(path), "--batch-size", "5"])
    assert (cfg.data.seq_len, cfg.data.batch_size, cfg.recompute, cfg.cluster, cfg.gpus) == (1 << 20, 5, "selective",
                                                                                             "h200",
                                                                                           4)
    path.write_text('ckpt = "full"\n')
    with pytest.raises(ValueError, match="unknown option 'ckpt'"):
        parse_plan_args(["--config", str(path)])
    with pytest.raises(ValueError, match="seq_len='1G'"):
        parse_plan_args(["--seq-len", "1G"])


def test_train_takes_the_same_sizes(tmp_path):
    from loongtrain.commands.train import parse_args

    assert parse_args(["--seq-len", "128K"]).data.seq_len == 131072
    path = tmp_path / "train.toml"
    path.write_text('seq_len = "16K"\n')
    assert parse_args(["--config", str(path)]).data.seq_len == 16384
    with pytest.raises(ValueError, match="seq_len='12x'"):
        parse_args(["--seq-len", "12x"])


def _row(c) -> str:
    parts = ",".join(f"{k}={c.memory[k].hex()}" for k in ("states", "working_params", "activations", "recompute",
                                                          "logits", "workspace", "total"))
    return f"{c.config.label()}|{c.step_time.hex()}|{c.mfu.hex()}|{c.fits}|{c.bottleneck}|{parts}"


def golden_entry(key: str) -> dict:
    """What the golden file holds for one ``model/cluster/nodes/seq_len/dtype_bytes`` request: the number
    of candidates, the best one in clear, and a sha256 over all of them (exact floats, as hex)."""
    model, cluster, nodes, seq, b = key.split("/")
    rows = [_row(c) for c in plan(model, cluster, nodes=int(nodes), seq_len=int(seq), dtype_bytes=int(b))]
    return {"candidates": len(rows), "best": rows[0], "sha256": hashlib.sha256("\n".join(rows).encode()).hexdigest()}


def test_old_predictions_are_bit_identical():
    """tests/data/plan_golden.json holds the planner's predictions for the moderate grid's 6768 candidates;
    they must come out the same bit for bit. The file is rewritten only on purpose, when the memory or cost
    model changes what it predicts (the commit that rewrites it says why)."""
    golden = json.loads(GOLDEN.read_text())
    keys = sorted(golden)[::3]  # a third of the grid (suite time); every key passed when the file was checked in
    assert len(keys) >= 10
    for key in keys:
        assert golden_entry(key) == golden[key], key


if __name__ == "__main__":  # python -m tests.unit.test_plan_modes: rewrite the golden file (only on purpose)
    GOLDEN.write_text(json.dumps({k: golden_entry(k) for k in json.loads(GOLDEN.read_text())}, indent=1,
                                 sort_keys=True))
