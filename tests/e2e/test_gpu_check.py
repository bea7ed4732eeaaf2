"""``python -m benchmarks.gpu_check`` runs on CPU at tiny sizes (``--cpu``), so the device check cannot rot: every
section runs and writes what the planner reads; with a tiny budget the run ends in time and records every
section as run or skipped; an allocation failure is recorded and the run goes on; its ring check can fail (a
planted fault in the in-process ring shows up in its ratios)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from benchmarks.gpu_check import exact as gpu_check_exact
from benchmarks.gpu_check import rates as gpu_check_rates
from benchmarks.gpu_check import run as gpu_check
from benchmarks.gpu_check import train as gpu_check_train
from loongtrain.plan.calibrate import calibrated
from loongtrain.plan.cluster import load_cluster


def test_cpu_run_writes_every_section(tmp_path, monkeypatch):
    """Every section with every row (each section's CPU maximum lifted, so that a loaded machine leaves nothing
    out: the budget's own rules are the tiny-budget test's)."""
    import dataclasses

    monkeypatch.setattr(gpu_check, "SECTIONS", tuple(dataclasses.replace(s, cpu=(s.cpu[0], 20 * s.cpu[1]))
                                                     for s in gpu_check.SECTIONS))
    out = tmp_path / "check.json"
    assert gpu_check.main(["--cpu", "--out", str(out), "--budget-s", "900"]) == 0
    result = json.loads(out.read_text())
    for section in gpu_check.SECTIONS:
        if section.name == "sync_debug":  # CUDA's own debug mode: recorded as not run, with why
            assert "no CUDA device" in result[section.name]["skipped"]
            continue
        assert "error" not in result[section.name] and "skipped" not in result[section.name], result[section.name]
    env = result["environment"]
    assert env["g++"] and env["compile_missing"] is None and env["kernels"]["torch.bfloat16"] == ["cpu_flash"]
    assert result["kernel_probes"]["verdicts"]["dense:cpu_flash:float32:d8:4/2:128"]["ok"]
    # what was built since the first device run: MoE, post-training, gpt-oss's attention
    moe = result["moe"]
    assert moe["rows"]["looped"]["tokens_per_s"] > 0 and moe["rows"]["looped"]["empty_experts_zero_gradients"]
    assert "grouped_mm_supported is false" in moe["rows"]["grouped"]["skipped"]  # CUDA's
    assert moe["compiled"]["empty_experts_zero_gradients"] and moe["compiled"]["max_abs_diff_to_eager"] < 1e-5
    runs = result["post_training"]["runs"]
    assert set(runs) == {"sft", "dpo", "lora"} and all(r["tokens_per_s"] > 0 and r["steps"] == 2 for r in runs.values())
    assert runs["sft"]["targets"] > 0 and runs["dpo"]["pairs"] > 0
    gpt_oss = result["gpt_oss"]["rows"]
    assert [r["S"] for r in gpt_oss] == [256, 512] and all(r["window_s"] > 0 for r in gpt_oss)
    assert all(max(r["tail_max_abs_err"].values()) < 1e-4 for r in gpt_oss)
    rows = result["documents_1b"]["rows"]
    assert set(rows) == {"eager cpu_flash", "compiled"} and all(r["tokens_per_s"] > 0 for r in rows.values())
    assert rows["eager cpu_flash"]["attention_kernels"] and rows["compiled"]["eager_over_compiled"] > 0
    for dtype in ("bfloat16", "float16"):
        errs = result["kernels"][dtype]["max_abs_err"]
        assert set(errs) == {"out", "lse", "dq", "dk", "dv"} and max(errs.values()) < 0.1, errs
    ring = result["ring"]
    assert len(ring["cases"]) == 2 * len(gpu_check_exact.RING_CASES) and ring["worst_ratio"] < 4
    docs = result["documents"]
    assert {(c["window"], c["cp"]) for c in docs["cases"]} == {(w, cp) for w in (None, 32) for cp in (2, 4, 8)}
    assert docs["worst_ratio"] < 4 and 0 < docs["timing_window_None"]["visible_fraction"] < 0.5
    # the rates the planner reads: every candidate at every length, dense and on documents; the chosen rows
    attention = result["attention"]
    for rows in attention["candidates"].values():
        assert [r["S"] for r in rows] == list(gpu_check_rates.SIZES["cpu"]["attn_seqs"])
        assert all(r["dense"]["forward_s"] > 0 and r["documents"]["backward_s"] > 0 for r in rows)
    assert {r["S"] for r in attention["chosen"]} == set(gpu_check_rates.SIZES["cpu"]["chosen"][0][3])
    assert all(p["tflops"] > 0 for p in result["matmul"]["points"]) and result["memory_bandwidth"]["gbyte_s"] > 0
    cluster, notes = calibrated(result, load_cluster("h200"), "this run")
    assert len(cluster.attention_rates) == len(attention["chosen"]) and "matmul_tflops: median" in notes[1]
    # training rows with the planner beside them, memory against the planner, packed documents' MFU
    train_runs = result["training"]["runs"]
    cpu = gpu_check_train.SIZES["cpu"]
    assert [(r["model"], r["seq_len"]) for r in train_runs] == [row[:2] for row in cpu["rows"] + cpu["extra"]]
    assert all(set(r["attention_kernels"].values()) == {"cpu_flash"} for r in train_runs)  # each row's kernels
    assert [r["seq_len"] for r in result["documents_mfu"]["runs"]] == [row[1] for row in cpu["documents"]]
    for run in train_runs + result["documents_mfu"]["runs"]:
        assert run["tokens_per_s"] > 0 and run["mfu"] > 0 and run["predicted_memory_gib"]["total"] > 0
        assert run["planner"]["calibrated"]["planner_over_measured"] > 0
    assert 0 < result["documents_mfu"]["runs"][0]["visible_fraction"] < 1
    assert len(result["summary"]) == 4 and all("builtin_over_measured" in r for r in result["summary"])
    assert result["determinism"]["deterministic"]["bitwise_equal"]
    choice = result["kernel_choice"]
    assert choice["chosen"] in choice["candidates"] and result["loss"]["ratio"] > 0
    compiled = result["compile"]
    assert compiled["max_loss_diff"] < 1e-4 and 1 <= compiled["graphs"] <= 2, compiled  # shared by the blocks
    assert compiled["eager_mfu"] > 0 and compiled["compiled_tokens_per_s"] > 0
    offload = result["offload"]["modes"]
    assert offload and all(r["ratio"] > 0 and r["tokens_per_s"] > 0 for r in offload.values())


@pytest.mark.parametrize("budget", [5, 10])  # the first sections run (the last cut to what is left), the rest skip
def test_a_tiny_budget_is_spent_by_the_recorded_rule_and_every_section_recorded(tmp_path, budget):
    """The process, as a loan runs it: its budget counts from the process's start (torch's import too). What it
    did with the budget is checked on the decisions it recorded, with the clock readings it made them on (no
    wall time measured here: a loaded machine changes which sections run, never whether the rule was kept): the
    sections in order, each run when it had its minimum left and given the lesser of its maximum and what was
    left, each skipped one out of time; inside a section, each measurement run only when it fit."""
    out = tmp_path / "check.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--cpu", "--budget-s", str(budget), "--out",
                           str(out)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # one core: pytest's other worker has the other
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    schedule = result["schedule"]
    assert [d["section"] for d in schedule] == [s.name for s in gpu_check.SECTIONS]
    lefts = [d["left_s"] for d in schedule]
    assert lefts == sorted(lefts, reverse=True) and lefts[0] <= budget - result["started_s"]  # one clock, from start
    for decision, section in zip(schedule, gpu_check.SECTIONS):
        least, most = section.cpu
        assert (decision["least_s"], decision["most_s"]) == (least, most)
        recorded = result[section.name]
        if decision["ran"]:
            assert decision["left_s"] >= least or section.always, decision
            assert decision["given_s"] == max(0.0, min(most, decision["left_s"])), decision
            assert "wall_s" in recorded and not recorded.get("skipped", "").startswith("out of time"), recorded
        else:
            if decision["why"] == "device error":  # a sticky CUDA error in an earlier section (a GPU run only)
                continue
            assert decision["why"] == "out of time" and decision["left_s"] < least and not section.always, decision
            assert recorded["skipped"].startswith(f"out of time: {decision['left_s']:.1f} s of --budget-s"), recorded
        for step in recorded.get("decisions", []):
            assert step["fits"] == (step["left_s"] >= step["need_s"]), step
        left_out = [d["label"] for d in recorded.get("decisions", []) if not d["fits"]]
        assert all(any(note.startswith(f"{label}: out of time") for note in recorded.get("left_out", []))
                   for label in left_out), (left_out, recorded.get("left_out"))
    assert "environment" in [d["section"] for d in schedule if d["ran"]]  # always runs


def test_allocation_failures_are_recorded_and_the_run_goes_on(tmp_path, monkeypatch):
    assert gpu_check.allocation_failure(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED calling cublasCreate"))
    assert gpu_check.allocation_failure(RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"))
    assert gpu_check.allocation_failure(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert not gpu_check.allocation_failure(RuntimeError("shape mismatch"))
    real = gpu_check_rates.time_dense

    def failing(kernel, q, *args):
        if q.shape[2] == 512:  # the longest call: as when the device runs out of memory there
            raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")
        return real(kernel, q, *args)

    monkeypatch.setattr(gpu_check_rates, "time_dense", failing)
    out = tmp_path / "check.json"
    assert gpu_check.main(["--cpu", "--out", str(out), "--sections", "attention,matmul"]) == 0
    result = json.loads(out.read_text())
    attention = result["attention"]
    assert any("S=512 dense: allocation failure" in note for note in attention["left_out"]), attention["left_out"]
    assert [r["S"] for r in attention["chosen"]] == [128, 256]  # the failed size left out, the others measured
    assert result["matmul"]["points"] and result["training"] == {"skipped": "not in --sections"}


def test_sharded_attention_matches_the_unsharded_kernel_exactly_in_fp64():
    """The head-split x ring emulation itself (fp64 on CPU: the same math as one kernel call)."""
    from loongtrain.attn.kernels import REFERENCE

    gen = torch.Generator().manual_seed(0)
    q, dout = (gpu_check_exact._bshd(1, 64, 4, 8, torch.float64, torch.device("cpu"), gen) for _ in range(2))
    k, v = (gpu_check_exact._bshd(1, 64, 2, 8, torch.float64, torch.device("cpu"), gen) for _ in range(2))
    want = gpu_check_exact.run_kernel(REFERENCE, q, k, v, dout, 0.3)
    for hp, cp, inner_ring in gpu_check_exact.RING_CASES:
        got = gpu_check_exact.sharded_attention(q, k, v, dout, hp, cp, inner_ring, 0.3)
        for name in ("out", "dq", "dk", "dv"):
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-10, msg=f"{hp}x{cp}w{inner_ring} {name}")


def test_a_wrong_head_split_is_caught(monkeypatch):
    """Planted fault: KV heads assigned to the wrong head rank; the comparison must fail."""
    from loongtrain.attn.kernels import REFERENCE

    gen = torch.Generator().manual_seed(1)
    q, dout = (gpu_check_exact._bshd(1, 32, 4, 8, torch.float64, torch.device("cpu"), gen) for _ in range(2))
    k, v = (gpu_check_exact._bshd(1, 32, 2, 8, torch.float64, torch.device("cpu"), gen) for _ in range(2))
    want = gpu_check_exact.run_kernel(REFERENCE, q, k, v, dout, 0.3)
    right = gpu_check_exact._head_slice
    monkeypatch.setattr(gpu_check_exact, "_head_slice", lambda h, hkv, hp, j: (right(h, hkv, hp, j)[0], slice(0, 1)))
    got = gpu_check_exact.sharded_attention(q, k, v, dout, 4, 2, 1, 0.3)
    assert (got["out"] - want["out"]).abs().max() > 1e-3


@pytest.mark.parametrize("argv", [["--cpu"], ["--cpu", "--out", "x.json", "--sections", "nope"]])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        gpu_check.main(argv)
    assert exc.value.code == 2
