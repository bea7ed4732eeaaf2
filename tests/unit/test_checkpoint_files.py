"""Checkpoint directory bookkeeping (no processes): retention by step, ``latest`` protected, stale saves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from loongtrain.train.checkpoint import (
    CHECKSUM_FILE,
    LATEST,
    STATE_FILE,
    complete_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    remove_stale_tmp,
    save_checkpoint,
    verify_checkpoint,
)


def _make(root: Path, step: int, complete: bool = True, checksums: bool = True) -> Path:
    path = root / f"step_{step:08d}"
    path.mkdir(parents=True)
    if complete:
        (path / STATE_FILE).write_text("{}")
        if checksums:
            (path / CHECKSUM_FILE).write_text("{}")
    return path


def test_retention_orders_by_step_and_keeps_latest_target(tmp_path):
    # names that sort differently from their steps, as a run past 10^8 steps or hand-made names would
    for step in (9, 10, 100, 11):
        _make(tmp_path, step)
    (tmp_path / "step_00000012.tmp").mkdir()  # a save that died: not a checkpoint
    _make(tmp_path, 13, complete=False)  # no trainer state: not complete
    _make(tmp_path, 14, checksums=False)  # no checksums and not latest's target: a copy that did not finish
    assert [p.name for p in complete_checkpoints(tmp_path)] == [
        "step_00000009", "step_00000010", "step_00000011", "step_00000100"]
    (tmp_path / LATEST).write_text("step_00000010\n")  # e.g. after a resume from step 10
    deleted = prune_checkpoints(tmp_path, keep=1)
    assert sorted(p.name for p in deleted) == ["step_00000009", "step_00000011"]
    assert sorted(p.name for p in complete_checkpoints(tmp_path)) == ["step_00000010", "step_00000100"]


def test_stale_tmp_directories_are_removed(tmp_path):
    keep = _make(tmp_path, 4)
    (tmp_path / "step_00000005.tmp").mkdir()
    (tmp_path / "step_00000005.tmp" / "__0_0.distcp").write_bytes(b"half a save")
    removed = remove_stale_tmp(tmp_path)
    assert [p.name for p in removed] == ["step_00000005.tmp"]
    assert keep.is_dir() and not (tmp_path / "step_00000005.tmp").exists()


def _saved(tmp_path: Path) -> tuple[Path, torch.nn.Module, torch.optim.Optimizer, object]:
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    path = save_checkpoint(tmp_path, 3, model, optimizer, scheduler, {"micro_step": 3})
    return path, model, optimizer, scheduler


def test_same_size_corruption_is_named_before_loading(tmp_path):
    path, *_ = _saved(tmp_path)
    assert verify_checkpoint(path)["step"] == 3  # intact: passes
    shard = next(path.glob("*.distcp"))
    shard.write_bytes(bytes(255 - b for b in shard.read_bytes()))  # same size, other bytes
    with pytest.raises(ValueError, match=re.escape(str(shard)) + ".*corrupt"):
        verify_checkpoint(path)


def test_a_failed_load_names_the_checkpoint(tmp_path):
    path, model, optimizer, scheduler = _saved(tmp_path)
    (path / "checksums.json").unlink()  # as a checkpoint from before checksums: only the load can tell
    shard = next(path.glob("*.distcp"))
    shard.write_bytes(bytes(255 - b for b in shard.read_bytes()))
    with pytest.raises(RuntimeError, match=re.escape(str(path)) + ".*could not be loaded"):
        load_checkpoint(path, model, optimizer, scheduler)
