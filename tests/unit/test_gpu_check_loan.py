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


def context(seconds: float, results: dict | None = None) -> Context:
    return Context(torch.device("cpu"), "cpu", results or {}, time.monotonic() + seconds, lambda: None)


def test_the_sections_come_in_the_issues_order_and_their_maxima_fit_the_loan():
    names = [s.name for s in SECTIONS]
    assert names[:7] == ["environment", "kernel_probes", "documents_1b", "sync_debug", "attention", "matmul",
                         "memory_bandwidth"]
    assert sum(s.gpu[1] for s in SECTIONS) <= 420 - 20  # torch's import and CUDA's start inside --budget-s 420
    assert all(least <= most for s in SECTIONS for least, most in (s.gpu, s.cpu))
    assert [s.name for s in SECTIONS if s.always] == ["environment"]


def test_the_budget_counts_from_the_process_start():
    start = gpu_check.process_start()
    assert start <= time.monotonic() and time.monotonic() - start < 3600


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
    monkeypatch.setattr(speed, "kernel_candidates", lambda device, dtype, d: [CUDA_FLASH, CUDA_CUDNN])
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
