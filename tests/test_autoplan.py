"""`loongtrain train --plan auto`: the planner's choice becomes the run's layout, validated like any other."""

from __future__ import annotations

import pytest

from loongtrain.plan.search import best_fitting
from loongtrain.train.autoplan import apply_plan
from loongtrain.train.config import TrainConfig
from loongtrain.train.launch import validate_run


def test_plan_auto_takes_the_best_fitting_configuration():
    cfg = TrainConfig(model="7b-gqa", seq_len=131072, plan="auto", plan_cluster="a100", dtype="bf16")
    planned = apply_plan(cfg, 16, under_launcher=True)
    best = best_fitting("7b-gqa", "a100", nodes=2, seq_len=131072, batch=1, dtype_bytes=2)
    assert planned.parallel == best.config and planned.parallel != cfg.parallel
    assert planned.parallel.zero_shard_size == (8 if best.config.zero == "hybrid" else 0)
    assert planned.plan == "" and planned.seq_len == cfg.seq_len and planned.model == cfg.model
    validate_run(planned, 16)  # the choice is a valid run on 16 ranks


def test_plan_options_are_checked():
    with pytest.raises(ValueError, match="--plan='best' is not one of"):
        apply_plan(TrainConfig(plan="best"), 4, under_launcher=False)
    with pytest.raises(ValueError, match="neither part of one a100 node nor a whole number"):
        apply_plan(TrainConfig(plan="auto", plan_cluster="a100"), 12, under_launcher=True)
    assert apply_plan(TrainConfig(), 4, under_launcher=False) == TrainConfig()


def test_plan_auto_on_cpu_under_torchrun_needs_a_cluster(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(ValueError, match="pass --plan-cluster"):
        apply_plan(TrainConfig(plan="auto"), 4, under_launcher=True)
