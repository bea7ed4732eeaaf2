"""The attention benchmarks run end to end at tiny sizes, so they cannot rot (each benchmark's ``main`` in this
process, its ranks and limit processes as it starts them; one of them through ``python -m``). Nothing here
asserts a time: only that every case ran against its SDPA limit and that the counted work and bytes have the
right order."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    """``python -m benchmarks.NAME args`` from the repository root, as the benchmarks are run."""
    proc = subprocess.run([sys.executable, "-m", f"benchmarks.{Path(script).stem}", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def _main(name: str, *args: str) -> None:
    """``benchmarks.NAME.main(args)`` in this process: the benchmark's whole path, its ranks and its limit's
    process included, without another interpreter start (``python -m`` itself: :func:`_run`)."""
    module = importlib.import_module(f"benchmarks.{name}")
    assert module.main(list(args)) == 0


def test_documents_tiny(tmp_path):
    out = tmp_path / "documents.json"
    _main("documents", "--tiny", "--configs", "1x4", "--json", str(out))
    rows = {r["case"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"docs", "docs-balanced", "causal", "window"}
    for row in rows.values():
        assert len(row["time"]) == len(row["limit"]) == 1 and min(row["time"] + row["limit"]) > 0
    # --tiny: S=512 over cp=4 (chunks of 64); a window of 64 reaches only the neighbouring rank
    assert rows["window"]["ring_bytes"] < rows["causal"]["ring_bytes"]
    assert rows["docs-balanced"]["work_imbalance"] < rows["docs"]["work_imbalance"]
    assert rows["docs"]["visible_fraction"] < 1 and rows["causal"]["visible_fraction"] == 1


def test_attention_tiny(tmp_path):
    out = tmp_path / "attention.json"
    _main("attention", "--seq-len", "256", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
         "--iters", "1", "--rounds", "1", "--configs", "2x2", "--baselines", "none", "--json", str(out))
    (case,) = json.loads(out.read_text())["cases"]
    assert case["error"] is None and (case["hp"], case["cp"], case["kv_heads"]) == (2, 2, 2)
    assert len(case["total_s"]) == len(case["limit_s"]) == 1


def test_agreement_tiny(capsys):
    """benchmarks/agreement.py: the per-call check against the once-per-signature one."""
    _main("agreement", "--hp", "1", "--cp", "2", "--seq-lens", "64", "--iters", "1", "--rounds", "1")
    stdout = capsys.readouterr().out
    row = stdout.strip().splitlines()[-1]
    assert row.startswith("| 64 |") and row.endswith(" us |"), stdout


def test_max_seq_planner_rows(tmp_path):
    """Through ``python -m`` (the others call ``main`` in this process)."""
    out = tmp_path / "max_seq.json"
    _run("max_seq.py", "--models", "1b", "--gpus", "1", "--no-simulate", "--out", str(out))
    rows = json.loads(out.read_text())
    assert [r["modes"] for r in rows] == ["off", "auto"] and all(r["fits"] for r in rows)
    assert rows[1]["planner_max_seq_len"] >= rows[0]["planner_max_seq_len"] > 0


def test_host_work_tiny(capsys):
    from benchmarks import host_work

    assert host_work.main(["--layers", "2", "--seq", "64", "--documents", "4", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "before: step" in out and "after: step" in out and "after / before, planning_s" in out


def test_grpo_tiny(capsys):
    """benchmarks/grpo.py runs: a GRPO step against an SFT step on the same rows, with and without the KL term."""
    from benchmarks import grpo

    grpo.main(["--rounds", "1", "--seq-len", "256", "--docs", "2"])
    out = capsys.readouterr().out
    for name in ("grpo / sft (CPU)", "grpo+kl / sft (wall)"):
        row = next(line for line in out.splitlines() if line.startswith(f"| {name} |"))
        assert float(row.split("|")[2]) > 0


def test_linear_attention_tiny(capsys):
    """benchmarks/linear_attention.py: the timing table and the byte table at tiny sizes."""
    _main("linear_attention", "--rounds", "1", "--seq-len", "64", "--world", "2", "--hp", "1", "--cp", "2")
    assert "| hp1 x cp2, S=64 |" in capsys.readouterr().out
    _main("linear_attention", "--bytes", "--world", "2", "--hp", "1", "--cp", "2", "--lengths", "64,128")
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| 64 ", "| 128 "))]
    assert len(rows) == 2 and rows[0].split("|")[2:] == rows[1].split("|")[2:]  # the same bytes at both lengths
