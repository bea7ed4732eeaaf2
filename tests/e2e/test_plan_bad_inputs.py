"""`loongtrain plan` given bad input: model files that say the wrong thing, usage, TOML and cluster-file errors,
named by file and key; the real entry point once; Ctrl-C; nothing that fits.

The rows, and what each must show: tests/helpers/bad_inputs.py."""

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
    D,
    case_ids,
    check_bad_input,
    check_ctrl_c,
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
    check_ctrl_c("plan", files, tmp_path, capsys, monkeypatch)


def test_plan_nothing_fits_on_gpus_is_a_message_not_a_crash(capsys):
    """`plan --gpus N` when nothing fits: the table and why, exit 2 (the message took --nodes only)."""
    code = main(["plan", "--model", "13b", "--seq-len", "128K", "--gpus", "1", "--cluster", "a100", "--modes", "off"])
    out = capsys.readouterr()
    assert code == 2 and "Traceback" not in out.err
    assert out.err.startswith("loongtrain plan: nothing fits in memory: seq_len=131072 on gpus=1"), out.err
