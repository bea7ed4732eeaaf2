"""``loongtrain train`` without ``--hp``/``--cp``: the layout follows the world size (loongtrain/commands/train.py,
loongtrain/train/config.py ``world_layout``): one GPU trains at hp = cp = 1, the CPU quickstart keeps its four
workers at hp=2 x cp=2, given options (command line or config file) and ``--plan auto`` are left alone."""

from __future__ import annotations

import pytest
import torch

from loongtrain.commands.train import parse_args
from loongtrain.launch.train_run import world_size_for
from loongtrain.train.config import world_layout


def layout(cfg) -> tuple[int, int]:
    return cfg.parallel.hp, cfg.parallel.cp


def test_the_rule():
    assert [world_layout(w) for w in (1, 2, 3, 4, 6, 8, 12)] == [(1, 1), (1, 2), (1, 1), (2, 2), (1, 2), (2, 2),
                                                                  (2, 2)]


@pytest.mark.parametrize("gpus, want", [(1, (1, 1)), (2, (1, 2)), (8, (2, 2))])
def test_on_gpus_the_layout_follows_the_device_count(monkeypatch, gpus, want):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    cfg = parse_args([])
    assert layout(cfg) == want and world_size_for(cfg) == gpus
    assert layout(parse_args(["--hp", "2", "--cp", "2"])) == (2, 2)  # given: as given (world 1 then refuses it)
    assert layout(parse_args(["--cp", "1"])) == (2, 1)  # one of them given: the other keeps its default


def test_on_cpu_the_quickstart_keeps_four_workers_at_hp2_cp2(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = parse_args([])
    assert layout(cfg) == (2, 2) and world_size_for(cfg) == 4
    assert layout(parse_args(["--nproc", "1"])) == (1, 1) and layout(parse_args(["--nproc", "2"])) == (1, 2)
    toml = tmp_path / "run.toml"
    toml.write_text("[train]\nnproc = 1\n\n[parallel]\nhp = 1\ncp = 1\n")
    assert layout(parse_args(["--config", str(toml), "--nproc", "4"])) == (1, 1)  # the file gave them
    planned = parse_args(["--nproc", "1", "--plan", "auto"])
    assert layout(planned) == (2, 2) and planned.runtime.plan == "auto"  # the planner picks them at launch
