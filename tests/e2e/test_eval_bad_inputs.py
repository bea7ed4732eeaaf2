"""`loongtrain eval` given bad input: incomplete or damaged checkpoints, --out by the ownership rule and the lock,
corpora too short or contradicting their manifest; Ctrl-C.

Each row exits 2 before any worker starts (within 10 s), with one line on stderr naming the file or option, no
traceback, and every fixture file untouched (hashed before and after); the tables are in tests/helpers/bad_inputs.py."""

from __future__ import annotations

import pytest

from loongtrain.commands import main
from tests.helpers.bad_inputs import (
    PLAN,
    SAFETY,
    TRAIN,
    check_safety,
    rows_of,
)


@pytest.mark.parametrize("case", rows_of(SAFETY, "eval"), ids=[c.name for c in rows_of(SAFETY, "eval")])
def test_data_safety(case, safety, tmp_path, monkeypatch, capsys, reached):
    check_safety(case, safety, tmp_path, monkeypatch, capsys, reached)


def test_ctrl_c_is_one_line(files, tmp_path, capsys, monkeypatch):
    from loongtrain.launch import eval_run as eval_launch
    from loongtrain.launch import train_run as launch
    from loongtrain.plan import report as plan_cli
    from loongtrain.train import export

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(eval_launch, "launch", interrupt)
    monkeypatch.setattr(export, "export_hf", interrupt)
    monkeypatch.setattr(plan_cli, "plan", interrupt)
    monkeypatch.setattr(launch, "_launch_local", interrupt)
    command = "eval"
    argv = {"eval": ["eval", files["run"], "--task", "position-loss", "--nproc", "1", "--out", str(tmp_path / "e")],
            "export": ["export", files["ckpt"], "--hf", str(tmp_path / "hf")],
            "plan": PLAN, "train": [*TRAIN, "--corpus", files["corpus"], "--out-dir", str(tmp_path / "t")]}[command]
    assert main(argv) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"loongtrain {command}: interrupted" and not any("Traceback" in line for line in err), err
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob(".hf.export-*"))
    assert not list(tmp_path.rglob(".loongtrain.lock")), "a lock outlived its command"
