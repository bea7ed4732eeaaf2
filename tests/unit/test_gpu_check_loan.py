"""gpu_check fits its loan (benchmarks/gpu_check/run.py, first.py, speed.py, train.py; docs/kernels.md):
the sections in the issue's order with maxima inside the 420 s loan, the budget counted from the process's start,
a row that never starts without its estimated time, and a mixed kernel choice that scores a number (through the
CUDA emulation)."""

from __future__ import annotations

import math
import time

import torch

from benchmarks.gpu_check import run as gpu_check
from benchmarks.gpu_check import speed, train
from benchmarks.gpu_check.run import SECTIONS, Context
from loongtrain.attn import kernel_choice
from loongtrain.attn.cuda_kernels import CUDA_CUDNN, CUDA_FLASH
from loongtrain.attn.kernel_choice import combined
from tests.helpers.cuda_emulation import install

IMPORTED = time.monotonic()  # when this test module was imported


def context(seconds: float, results: dict | None = None) -> Context:
    return Context(torch.device("cpu"), "cpu", results or {}, time.monotonic() + seconds, lambda: None)


def test_the_sections_come_in_the_issues_order_and_their_maxima_fit_the_loan():
    """The first device run's questions, then what was built since (MoE, post-training, gpt-oss), then the rates and
    the training rows; every section's GPU maximum together within a 420 s budget (torch's import and CUDA's start
    inside it); on CPU, the new sections fit well inside a 60 s budget after the first two."""
    names = [s.name for s in SECTIONS]
    assert names[:9] == ["environment", "kernel_probes", "moe", "post_training", "gpt_oss", "attention", "matmul",
                         "memory_bandwidth", "training"]
    assert sum(s.gpu[1] for s in SECTIONS) <= 420 - 20
    assert sum(s.cpu[1] for s in SECTIONS[:5]) <= 30
    assert all(least <= most for s in SECTIONS for least, most in (s.gpu, s.cpu))
    assert [s.name for s in SECTIONS if s.always] == ["environment"]


def test_the_budget_counts_from_the_process_start():
    """The process started before this module was imported (an order of clock readings, not a duration)."""
    assert gpu_check.process_start() <= IMPORTED <= time.monotonic()


def test_a_training_row_never_starts_without_its_estimated_time(monkeypatch):
    built = []
    monkeypatch.setattr("loongtrain.train.trainer.Trainer", lambda *a, **k: built.append(a))
    ctx = context(0.2)
    need = train.row_estimate_s(ctx, train.CPU_SMALL, train.ParallelConfig(), 128, train.SIZES["cpu"]["steps"] + 1)
    assert need > 0.2
    assert train.train_row(ctx, "cpu-small", 128, train.ParallelConfig()) is None
    assert not built and ctx.skipped == [f"cpu-small S=128: out of time (section budget, {ctx.left():.0f} s left)"]


def test_a_mixed_kernel_choice_scores_a_number(monkeypatch):
    """cuDNN's dense calls with flash's varlen op (``cuda_cudnn+cuda_flash``), the emulated CUDA kernels on CPU
    tensors: timed as it runs, not looked up among the single kernels (which gave NaN)."""
    install(monkeypatch, allow_fp64=False)
    mixed = combined(CUDA_CUDNN, CUDA_FLASH)
    assert mixed.name == "cuda_cudnn+cuda_flash"
    monkeypatch.setattr(speed, "safe_kernels", lambda *args: ([CUDA_FLASH, CUDA_CUDNN], {}))
    monkeypatch.setattr(speed, "choose_kernel", lambda *args: mixed)
    monkeypatch.setitem(speed.SIZES, "cpu", {**speed.SIZES["cpu"], "choice": (1, 64, 4, 2, 16)})
    monkeypatch.setattr(speed, "chosen_kernels", lambda: {"bfloat16 d16 4/2 heads, blocks <= 64": mixed.name})
    out = speed.check_kernel_choice(context(60))
    assert out["chosen"] == "cuda_cudnn+cuda_flash" and mixed.name in out["candidates"]
    for kind in ("dense", "documents"):
        ratio = out[f"chosen_over_fastest_{kind}"]
        assert math.isfinite(ratio) and ratio > 0, (kind, out)
    assert out["attention_kernels"] == {"bfloat16 d16 4/2 heads, blocks <= 64": "cuda_cudnn+cuda_flash"}
    kernel_choice.clear_choices()


def test_rows_of_one_model_build_its_weights_once(monkeypatch):
    """initial_weights_once: a second trainer of the same model and seed takes a copy of the first's initial
    weights (the real init runs once), bit for bit the weights it would have built, and not shared storage."""
    from benchmarks.gpu_check.train import initial_weights_once
    from loongtrain.model.config import get_preset
    from loongtrain.model.llama import Transformer
    from loongtrain.train import model_setup

    built = []
    real = model_setup.Transformer
    monkeypatch.setattr(model_setup, "Transformer", lambda config, **kw: built.append(kw) or real(config, **kw))
    config, patched = get_preset("tiny"), model_setup.Transformer
    with initial_weights_once():
        a, b = (model_setup.Transformer(config, seed=3) for _ in range(2))
        other = model_setup.Transformer(config, seed=4)
    assert built == [{"seed": 3}, {"seed": 4}]
    assert model_setup.Transformer is patched  # restored when the context ends
    fresh = Transformer(config, seed=3)
    for (name, p), (_, q), (_, r) in zip(a.named_parameters(), b.named_parameters(), fresh.named_parameters(),
                                         strict=True):
        assert torch.equal(p, r) and torch.equal(q, r), name
        assert p.data_ptr() != q.data_ptr(), name
    assert not torch.equal(next(other.parameters()), next(fresh.parameters()))


# ---------------------------------------------------------------- what the device may run, and its probes


BF16 = torch.bfloat16


def test_sections_run_only_what_the_table_and_the_probe_let_through(gpu, monkeypatch):
    """torch 2.13, cuDNN 9.26 on an H100/H200 (faked; the kernels through the CUDA emulation): cuDNN's varlen op is
    refused and its dense calls narrowed (one-row calls on FA2), FA2's window refused by its probe; the attention
    rates time exactly the forms that may run and record why the others do not: cuDNN's ragged op never runs."""
    from benchmarks.gpu_check import rates, safety
    from loongtrain.attn.kernel_probe import Versions

    device = gpu((9, 0), cudnn=92600)
    monkeypatch.setattr(safety, "current_versions", lambda: Versions((2, 13), 92600))
    monkeypatch.setattr(safety, "BatchProbe", lambda *a, **k: lambda kernel, kind: "wrong band" if kind == "window"
                        else None)
    kernels, refused = safety.safe_kernels(device, BF16, 16, 4, 2, 64)
    assert [k.name for k in kernels] == ["cuda_flash", "cuda_cudnn_rows2", "cuda_efficient"]
    assert kernels[0].varlen_forward is CUDA_FLASH.varlen_forward and not kernels[0].windowed
    assert set(refused) == {"varlen:cuda_cudnn", "window:cuda_flash", "dense:cuda_cudnn (narrowed)"}
    ops = install(monkeypatch, allow_fp64=False)
    monkeypatch.setattr(rates, "safe_kernels", lambda *args: (kernels, refused))
    monkeypatch.setitem(rates.SIZES, "cpu", {**rates.SIZES["cpu"], "attn_seqs": (64,), "attn_heads": (4, 2, 16),
                                             "dtype": BF16, "chosen": ()})
    out = rates.check_attention(context(60))
    assert set(out["candidates"]) == {k.name for k in kernels} and out["refused_kernels"] == refused
    assert all("error" not in row for rows in out["candidates"].values() for row in rows), out["candidates"]
    assert "_cudnn_attention_forward" not in ops.calls and "_scaled_dot_product_cudnn_attention" in ops.calls


def test_the_sections_take_kernels_only_through_the_safety_gate():
    """No section module lists kernel candidates itself (only ``safety.safe_kernels``, the environment's listing
    and the probes' plan): a new section cannot time a kernel the run would refuse."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check"
    calls = {}
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                    "kernel_candidates", "known_bad", "needs_probe"):
                calls.setdefault(path.name, []).append(node.lineno)
    assert set(calls) == {"safety.py", "first.py"} and len(calls["first.py"]) == 2, calls


def test_the_probes_section_checks_every_shape_of_the_run_in_one_process(gpu, monkeypatch):
    """On a (faked) GPU: one probe process for every call shape the sections use, shapes that share a length bucket
    (at most 16K) and head layout probed once, the table's refusals and narrowings recorded beside the verdicts."""
    from benchmarks.gpu_check import first
    from loongtrain.attn import probe_batch
    from loongtrain.attn.kernel_probe import PROBE_MAX_BLOCK, Versions

    gpu((9, 0), cudnn=92600)
    monkeypatch.setattr(first, "current_versions", lambda: Versions((2, 13), 92600))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    batches = []

    def fake_batch(specs, versions, command=None, cache_dir=None, timeout_s=None, start_timeout_s=None):
        batches.append(list(specs))
        return {s.key(): None for s in specs}

    monkeypatch.setattr(probe_batch, "probe_batch", fake_batch)
    ctx = Context(torch.device("cuda", 0), "gpu", {}, time.monotonic() + 60, lambda: None)
    out = first.check_kernel_probes(ctx)
    (specs,) = batches
    keys = [s.key() for s in specs]
    assert len(keys) == len(set(keys)) and max(s.block_len for s in specs) == PROBE_MAX_BLOCK
    assert len(out["shapes"]) == len(first.run_shapes("gpu")) > len({(s.dtype, s.head_dim, s.heads, s.kv_heads,
                                                                       s.block_len) for s in specs})
    assert {s.kernel for s in specs} == {"cuda_flash", "cuda_cudnn_rows2", "cuda_efficient"}
    assert not any(s.kernel == "cuda_cudnn" for s in specs)  # its varlen op refused by the table, dense narrowed
    assert any(k.startswith("varlen:cuda_cudnn") for k in out["table"]) and set(out["verdicts"]) == set(keys)


def test_a_section_that_breaks_the_device_ends_the_run_with_its_results_written(tmp_path, monkeypatch):
    """A sticky device error (an illegal address) after a section: that section keeps its results and the error,
    every later one is recorded as skipped with it (none runs into the broken context), the file is written."""
    import json

    from benchmarks.gpu_check.run import Section

    ran = []
    monkeypatch.setattr(gpu_check, "device_error", lambda device: "AcceleratorError: CUDA error: an illegal memory "
                        "access was encountered" if ran else None)
    monkeypatch.setattr(gpu_check, "SECTIONS", (
        Section("first", lambda ctx: {"fine": True}, (0, 1), (0, 1)),
        Section("breaks", lambda ctx: ran.append(1) or {"measured": 1.0}, (0, 1), (0, 1)),
        Section("after", lambda ctx: ran.append(2) or {"measured": 2.0}, (0, 1), (0, 1))))
    out = tmp_path / "check.json"
    assert gpu_check.main(["--cpu", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["first"]["fine"] and "device_error" not in result["first"]
    assert result["breaks"]["measured"] == 1.0 and "illegal memory access" in result["breaks"]["device_error"]
    assert "error state since an earlier section" in result["after"]["skipped"] and ran == [1]
