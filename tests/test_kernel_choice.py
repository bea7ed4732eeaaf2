"""The ring's kernel choice by measurement (loongtrain/attn/kernel_choice.py, docs/design.md §6)."""

from __future__ import annotations

import pytest
import torch

from loongtrain.attn import kernel_choice
from loongtrain.attn.kernel_choice import MARGIN, choose_kernel, kernel_for, pick_by_time, time_kernel
from loongtrain.attn.kernels import CPU_FLASH, CUDA_CUDNN, CUDA_EFFICIENT, CUDA_FLASH, REFERENCE

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def fresh_choices():
    kernel_choice.clear_choices()
    yield
    kernel_choice.clear_choices()


class Timer:
    """A fake ``measure``: fixed seconds per kernel name, counting calls; ``None`` raises."""

    def __init__(self, **seconds: float | None) -> None:
        self.seconds, self.calls = seconds, []

    def __call__(self, kernel) -> float:
        self.calls.append(kernel.name)
        t = self.seconds[kernel.name]
        if t is None:
            raise RuntimeError("cuDNN rejected the shape")
        return t


def choose(device, measure, head_dim=128, heads=(16, 4)):
    return choose_kernel(device, BF16, head_dim, heads[0], heads[1], 4096, measure=measure)


def test_a_clearly_faster_cudnn_is_chosen_on_hopper_and_remembered(gpu):
    device = gpu((9, 0))
    timer = Timer(cuda_flash=2.0, cuda_cudnn=1.0, cuda_efficient=3.0)
    assert choose(device, timer) is CUDA_CUDNN
    assert sorted(timer.calls) == ["cuda_cudnn", "cuda_efficient", "cuda_flash"]
    assert choose(device, timer) is CUDA_CUDNN and len(timer.calls) == 3  # measured once per key
    choose(device, timer, heads=(16, 16))  # another head count is another key
    assert len(timer.calls) == 6


def test_within_the_margin_the_rule_keeps_its_kernel(gpu):
    device = gpu((9, 0))
    almost = 2.0 * (1 - MARGIN / 2)
    assert choose(device, Timer(cuda_flash=2.0, cuda_cudnn=almost, cuda_efficient=3.0)) is CUDA_FLASH


def test_slower_or_failing_candidates_are_not_chosen(gpu):
    device = gpu((9, 0))
    assert choose(device, Timer(cuda_flash=1.0, cuda_cudnn=None, cuda_efficient=3.0)) is CUDA_FLASH
    kernel_choice.clear_choices()
    assert choose(device, Timer(cuda_flash=None, cuda_cudnn=1.0, cuda_efficient=3.0)) is CUDA_CUDNN


def test_on_ampere_flash_and_efficient_are_timed(gpu):
    timer = Timer(cuda_flash=1.0, cuda_efficient=0.4)
    assert choose(gpu((8, 0)), timer, heads=(8, 8)) is CUDA_EFFICIENT
    assert sorted(timer.calls) == ["cuda_efficient", "cuda_flash"]


def test_when_every_candidate_fails_the_rule_stands(gpu):
    assert choose(gpu((9, 0)), Timer(cuda_flash=None, cuda_cudnn=None, cuda_efficient=None)) is CUDA_FLASH


def test_single_candidate_cpu_and_deterministic_mode_skip_the_timing(gpu, monkeypatch):
    never = Timer()  # any call would KeyError
    assert choose_kernel(torch.device("cpu"), BF16, 64, 4, 4, 256, measure=never) is CPU_FLASH
    assert choose_kernel(torch.device("meta"), torch.float32, 64, 4, 4, 256, measure=never) is REFERENCE
    device = gpu((9, 0))
    assert choose_kernel(device, torch.float32, 128, 4, 4, 256, measure=never) is CUDA_EFFICIENT  # one candidate
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    assert choose(device, never) is CUDA_FLASH
    assert never.calls == []


def test_pick_by_time_is_the_rule_unless_clearly_beaten():
    kernels = [CUDA_FLASH, CUDA_CUDNN]
    assert pick_by_time(kernels, CUDA_FLASH, Timer(cuda_flash=1.0, cuda_cudnn=0.5))[0] is CUDA_CUDNN
    assert pick_by_time(kernels, CUDA_FLASH, Timer(cuda_flash=1.0, cuda_cudnn=0.95))[0] is CUDA_FLASH
    chosen, times = pick_by_time(kernels, CUDA_CUDNN, Timer(cuda_flash=0.5, cuda_cudnn=None))
    assert chosen is CUDA_FLASH and times == {"cuda_flash": 0.5, "cuda_cudnn": float("inf")}


def test_time_kernel_runs_a_real_kernel():
    q = torch.randn(1, 64, 4, 32).transpose(1, 2)
    k = torch.randn(1, 64, 2, 32).transpose(1, 2)
    seconds = time_kernel(CPU_FLASH, q, k, k.clone(), repeats=2)
    assert 0 < seconds < 10


def test_kernel_for_reads_the_blocks_shapes():
    q, k = torch.randn(1, 8, 16, 32), torch.randn(1, 2, 16, 32)
    assert kernel_for(q, k) is CPU_FLASH
