"""`loongtrain train --plan auto`: the planner's choice becomes the run's layout, validated like any other."""

from __future__ import annotations

import pytest

from loongtrain.launch.autoplan import apply_plan
from loongtrain.launch.config import TrainConfig
from loongtrain.launch.train_run import validate_run
from loongtrain.plan.search import best_fitting


def test_plan_auto_takes_the_best_fitting_configuration():
    cfg = TrainConfig.from_dict(dict(model="7b-gqa", seq_len=131072, plan="auto", cluster="a100", dtype="bf16"))
    planned = apply_plan(cfg, 16, under_launcher=True)
    best = best_fitting("7b-gqa", "a100", nodes=2, seq_len=131072, batch=1, dtype_bytes=2)
    assert planned.parallel == best.config and planned.parallel != cfg.parallel
    assert planned.parallel.zero_shard_size == (8 if best.config.zero == "hybrid" else 0)
    assert planned.runtime.plan == "" and planned.data.seq_len == cfg.data.seq_len and \
        planned.model.model == cfg.model.model
    validate_run(planned, 16)  # the choice is a valid run on 16 ranks


def test_plan_options_are_checked():
    with pytest.raises(ValueError, match="--plan='best' is not one of"):
        apply_plan(TrainConfig.from_dict(dict(plan="best")), 4, under_launcher=False)
    with pytest.raises(ValueError, match="neither part of one a100 node nor a whole number"):
        apply_plan(TrainConfig.from_dict(dict(plan="auto", cluster="a100")), 12, under_launcher=True)
    assert apply_plan(TrainConfig(), 4, under_launcher=False) == TrainConfig()


def test_plan_auto_on_cpu_under_torchrun_needs_a_cluster(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(ValueError, match="pass --cluster"):
        apply_plan(TrainConfig.from_dict(dict(plan="auto")), 4, under_launcher=True)


def test_plan_auto_picks_offload_when_needed_and_reports_a_host_shortfall(tmp_path):
    """tiny at 64K on 4 fp32 CPU ranks: 116.0 MiB per device at best without host memory (tiled MLP), 114.8
    MiB with parameter offload, 106.8 MiB with both offloads (67.3 MiB of host memory per node: the offloaded
    block inputs, the states and the AdamW step's temporaries). On 115.4 MiB devices only the offload modes
    fit; with 1 KiB of host memory nothing does, and --plan auto says so before any worker starts."""
    from dataclasses import replace

    from loongtrain.plan.cluster import cluster_to_toml
    from tests.helpers.plan_cases import toy_cluster

    path = tmp_path / "c.toml"
    path.write_text(cluster_to_toml(replace(toy_cluster(), memory_gib=115.4 / 1024, host_memory_gib=1.0)))
    cfg = TrainConfig.from_dict(dict(model="tiny", seq_len=65536, plan="auto", cluster=str(path)))
    picked = apply_plan(cfg, 4, under_launcher=True).parallel
    assert picked.offload_params or picked.offload_activations, picked.label()
    path.write_text(cluster_to_toml(replace(toy_cluster(), memory_gib=115.4 / 1024, host_memory_gib=1e-6)))
    shortfall = r"(?s)--plan auto on toy: nothing fits.*needs 0.0673 GiB of host memory per node"
    with pytest.raises(ValueError, match=shortfall):
        apply_plan(cfg, 4, under_launcher=True)
