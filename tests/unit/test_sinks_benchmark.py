"""benchmarks/sinks.py runs end to end at a tiny size (world 1), so it cannot rot; it asserts no time."""

from __future__ import annotations

from benchmarks.sinks import main


def test_sinks_benchmark_tiny(capsys):
    assert main(["--rounds", "2", "--seq-len", "64", "--window", "16"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| hp1 x cp1, S=64")]
    assert len(rows) == 2  # wall and CPU
