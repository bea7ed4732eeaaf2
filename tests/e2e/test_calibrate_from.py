"""``loongtrain plan --calibrate-from``: a cluster file from a gpu_check run's kernel, matmul and memory-bandwidth
measurements only (never its training step times), the H200 training rows predicted from it, the shipped h200
preset holding its rates, and bad runs or cluster files refused in one line (docs/planner.md)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from loongtrain.commands import main as loongtrain_main
from loongtrain.model.config import get_preset
from loongtrain.parallel.config import ParallelConfig
from loongtrain.plan.cluster import load_cluster
from loongtrain.plan.cost import step_cost

RUN = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "gpu_check_h200.json"


def _calibrate(tmp_path: Path, run: dict, name: str = "gpu_check_h200.json", *extra: str) -> tuple[int, Path]:
    src = tmp_path / name
    src.write_text(json.dumps(run))
    out = tmp_path / "cluster.toml"
    return loongtrain_main(["plan", "--calibrate-from", str(src), "--out", str(out), *extra]), out


def test_the_training_step_times_play_no_part(tmp_path):
    run = json.loads(RUN.read_text())
    for name in "abc":
        (tmp_path / name).mkdir()
    rc, out = _calibrate(tmp_path / "a", run)
    assert rc == 0
    for row in run["training"]["runs"]:  # every measured step time, MFU and throughput perturbed
        row["step_s"] = [3 * s for s in row["step_s"]]
        row["mfu"], row["tokens_per_s"], row["model_tflops"] = 0.9, 1.0, 1.0
    rc2, out2 = _calibrate(tmp_path / "b", run)
    assert rc2 == 0 and out2.read_bytes() == out.read_bytes()
    del run["training"]  # and without them at all
    assert _calibrate(tmp_path / "c", run)[1].read_bytes() == out.read_bytes()


def test_the_h200_rows_are_predicted_within_ten_percent(tmp_path):
    rc, out = _calibrate(tmp_path, json.loads(RUN.read_text()))
    assert rc == 0
    cluster, shipped = load_cluster(out), load_cluster("h200")
    assert cluster.attention_rates == shipped.attention_rates and cluster.attention_tflops == shipped.attention_tflops
    assert cluster.matmul_tflops == shipped.matmul_tflops and cluster.memory_gbyte_s == shipped.memory_gbyte_s
    assert "not measured in this run" in cluster.description  # matmul and memory bandwidth: the base's
    for row in json.loads(RUN.read_text())["training"]["runs"]:  # the targets (read only here)
        c = step_cost(get_preset(row["model"]), ParallelConfig(recompute=row["recompute"]), cluster, nodes=1, world=1,
                      seq_len=row["seq_len"])
        measured = statistics.median(row["step_s"])
        assert abs(c.step_time / measured - 1) <= 0.10, (row["model"], c.step_time, measured, c.terms)


@pytest.mark.parametrize("content, words", [
    ("not json", "not a gpu_check JSON output"),
    (json.dumps([1, 2]), "not a gpu_check output (no 'environment' section"),
    (json.dumps({"environment": {"name": "NVIDIA H200"}, "training": {}}), "lacks the kernel sections"),
    (json.dumps({"environment": {"name": "NVIDIA H200"}, "throughput": {"H": 32, "D": 128, "points": []}}),
     "lacks the kernel sections"),
    (json.dumps({"environment": {"name": "NVIDIA H200"}, "throughput": {"H": 32, "D": 128,
                                                                         "points": [{"S": 4096, "tflops": -1}]}}),
     "throughput.points[0].tflops = -1 must be a positive number"),
    (json.dumps({"environment": {"name": "Some GPU"}, "throughput": {"H": 32, "D": 128,
                                                                      "points": [{"S": 4096, "tflops": 300}]}}),
     "no built-in cluster describes the run's device 'Some GPU'"),
])
def test_a_bad_run_exits_2_naming_what_is_missing(tmp_path, capsys, content, words):
    src = tmp_path / "run.json"
    src.write_text(content)
    out = tmp_path / "cluster.toml"
    assert loongtrain_main(["plan", "--calibrate-from", str(src), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("loongtrain plan: error: ") and words in err, err
    assert not out.exists()


@pytest.mark.parametrize("key, value", [("matmul_tflops", "0.0"), ("memory_gbyte_s", "-5.0"),
                                        ("attention_tflops", "nan"), ("a2a_efficiency", "inf"),
                                        ("attention_rates", "[[128, 4096, 0.0]]")])
def test_a_cluster_file_with_a_bad_rate_exits_2_naming_the_key(tmp_path, capsys, key, value):
    text = (Path(__file__).resolve().parents[2] / "loongtrain" / "plan" / "clusters" / "h200.toml").read_text()
    lines = [line for line in text.splitlines() if not line.startswith(key)]
    if key == "attention_rates":  # the table spans lines: drop them all
        lines = [line for line in lines if not line.startswith(("  [", "]"))]
    path = tmp_path / "bad.toml"
    path.write_text("\n".join(lines).replace("[cluster]", f"[cluster]\n{key} = {value}", 1) + "\n")
    assert loongtrain_main(["plan", "--model", "1b", "--gpus", "1", "--seq-len", "8K", "--cluster", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and key in err, err
