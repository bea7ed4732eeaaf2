"""`loongtrain plan` given bad input: model files that say the wrong thing, usage, TOML and cluster-file errors,
named by file and key; the real entry point once; Ctrl-C; nothing that fits.

Each row exits 2 before any worker starts (within 10 s), with one line on stderr naming the file or option, no
traceback, and every fixture file untouched (hashed before and after); the tables are in tests/helpers/bad_inputs.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from loongtrain.commands import main
from tests.helpers.bad_inputs import (
    CASES,
    PLAN,
    TRAIN,
    D,
    case_ids,
    check_bad_input,
    fill,
    hashes,
    rows_of,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("argv, needle", rows_of(CASES, "plan"), ids=case_ids(rows_of(CASES, "plan")))
def test_bad_input_exits_2_with_one_line(argv, needle, files, capsys, no_workers):
    check_bad_input(argv, needle, files, capsys)


@pytest.mark.distributed  # starts processes
@pytest.mark.parametrize("argv, needle", [
    # `plan` through the real entry point (its row is in the table above too; `train`'s subprocess case is
    # tests/e2e/test_cli_errors.py's): each subprocess costs an interpreter start and the imports
    ([*PLAN, "--cluster", D + "/cluster_frac.toml"], "gpus_per_node = 7.5"),
])


def test_bad_input_in_a_subprocess(argv, needle, files):
    argv = fill(argv, files)
    if argv[0] == "train":
        argv += ["--corpus", files["corpus"], "--out-dir", str(Path(files["dir"], "out"))]
    before = hashes(Path(files["dir"]))
    # the time bound is the in-process table's; here interpreter start and imports dominate (~3 s on
    # quiet cores, over 30 s measured on the shared 2-core machine), so only the timeout bounds it
    proc = subprocess.run([sys.executable, "-m", "loongtrain.commands", *argv], cwd=ROOT, capture_output=True,
                          text=True,
                          timeout=180, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert hashes(Path(files["dir"])) == before


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
    command = "plan"
    argv = {"eval": ["eval", files["run"], "--task", "position-loss", "--nproc", "1", "--out", str(tmp_path / "e")],
            "export": ["export", files["ckpt"], "--hf", str(tmp_path / "hf")],
            "plan": PLAN, "train": [*TRAIN, "--corpus", files["corpus"], "--out-dir", str(tmp_path / "t")]}[command]
    assert main(argv) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"loongtrain {command}: interrupted" and not any("Traceback" in line for line in err), err
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob(".hf.export-*"))
    assert not list(tmp_path.rglob(".loongtrain.lock")), "a lock outlived its command"


def test_plan_nothing_fits_on_gpus_is_a_message_not_a_crash(capsys):
    """`plan --gpus N` when nothing fits: the table and why, exit 2 (the message took --nodes only)."""
    code = main(["plan", "--model", "13b", "--seq-len", "128K", "--gpus", "1", "--cluster", "a100", "--modes", "off"])
    out = capsys.readouterr()
    assert code == 2 and "Traceback" not in out.err
    assert out.err.startswith("loongtrain plan: nothing fits in memory: seq_len=131072 on gpus=1"), out.err
