"""Checkpoint directory bookkeeping (no processes): retention by step, ``latest`` protected, stale saves."""

from __future__ import annotations

from pathlib import Path

from loongtrain.train.checkpoint import (
    LATEST,
    STATE_FILE,
    complete_checkpoints,
    prune_checkpoints,
    remove_stale_tmp,
)


def _make(root: Path, step: int, complete: bool = True) -> Path:
    path = root / f"step_{step:08d}"
    path.mkdir(parents=True)
    if complete:
        (path / STATE_FILE).write_text("{}")
    return path


def test_retention_orders_by_step_and_keeps_latest_target(tmp_path):
    # names that sort differently from their steps, as a run past 10^8 steps or hand-made names would
    for step in (9, 10, 100, 11):
        _make(tmp_path, step)
    (tmp_path / "step_00000012.tmp").mkdir()  # a save that died: not a checkpoint
    _make(tmp_path, 13, complete=False)  # no trainer state: not complete
    assert [p.name for p in complete_checkpoints(tmp_path)] == [
        "step_00000009", "step_00000010", "step_00000011", "step_00000100"]
    (tmp_path / LATEST).write_text("step_00000010\n")  # e.g. after a resume from step 10
    deleted = prune_checkpoints(tmp_path, keep=1)
    assert sorted(p.name for p in deleted) == ["step_00000009", "step_00000011"]
    assert sorted(p.name for p in complete_checkpoints(tmp_path)) == ["step_00000010", "step_00000100"]


def test_stale_tmp_directories_are_removed(tmp_path):
    keep = _make(tmp_path, 4)
    (tmp_path / "step_00000005.tmp" / "sub").mkdir(parents=True)
    removed = remove_stale_tmp(tmp_path)
    assert [p.name for p in removed] == ["step_00000005.tmp"]
    assert keep.is_dir() and not (tmp_path / "step_00000005.tmp").exists()
