"""The ring's kernel choice by measurement, one per call kind (loongtrain/attn/kernel_choice.py and
kernel_timing.py, docs/attention.md#kernels)."""

from __future__ import annotations

import pytest
import torch

from loongtrain.attn import kernel_choice
from loongtrain.attn.cuda_kernels import CUDA_CUDNN, CUDA_EFFICIENT, CUDA_FLASH
from loongtrain.attn.kernel_choice import MARGIN, choose_kernel, kernel_for, per_piece, pick_by_time
from loongtrain.attn.kernel_probe import Versions
from loongtrain.attn.kernel_timing import VARLEN_TOLERANCE, make_timer, time_kernel, varlen_error
from loongtrain.attn.kernels import CPU_FLASH, REFERENCE
from tests.helpers.cuda_emulation import install

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def fresh_choices(monkeypatch):
    """Fresh choices, on versions the known-bad table does not list (tests/unit/test_kernel_safety.py tests it)."""
    monkeypatch.setattr(kernel_choice, "current_versions", lambda: Versions((2, 14), 92700))
    kernel_choice.clear_choices()
    yield
    kernel_choice.clear_choices()


def passes(kernel, kind) -> None:
    """A probe every candidate passes."""
    return None


class Timer:
    """A fake ``measure(kernel, kind)``: fixed seconds per kernel name for the dense calls (and ``varlen`` for
    the varlen calls, default: equal for every option), counting calls; ``None`` raises."""

    def __init__(self, varlen: dict[str, float | None] | None = None, **seconds: float | None) -> None:
        self.seconds, self.varlen, self.calls = seconds, varlen or {}, []

    def __call__(self, kernel, kind: str = "dense") -> float:
        self.calls.append((kernel.name, kind))
        t = self.seconds[kernel.name] if kind == "dense" else self.varlen.get(kernel.name, 1.0)
        if t is None:
            raise RuntimeError("cuDNN rejected the shape")
        return t

    def names(self, kind: str = "dense") -> list[str]:
        return sorted(name for name, k in self.calls if k == kind)


def choose(device, measure, head_dim=128, heads=(16, 4)):
    return choose_kernel(device, BF16, head_dim, heads[0], heads[1], 4096, measure=measure, probe=passes)


def parts(kernel) -> tuple:
    """(dense forward, varlen forward) of the ring's kernel: what each call kind runs."""
    return kernel.forward, kernel.varlen_forward


def test_a_clearly_faster_cudnn_is_chosen_on_hopper_and_remembered(gpu):
    device = gpu((9, 0))
    timer = Timer(cuda_flash=2.0, cuda_cudnn=1.0, cuda_efficient=3.0)
    chosen = choose(device, timer)
    assert parts(chosen) == (CUDA_CUDNN.forward, CUDA_FLASH.varlen_forward)  # varlen: the rule's, flash
    assert chosen.name == "cuda_cudnn+cuda_flash"
    assert timer.names() == ["cuda_cudnn", "cuda_efficient", "cuda_flash"]
    assert timer.names("varlen") == ["cuda_cudnn", "cuda_cudnn_per_piece", "cuda_flash"]
    assert choose(device, timer) is chosen and len(timer.calls) == 6  # measured once per key
    choose(device, timer, heads=(16, 16))  # another head count is another key
    assert len(timer.calls) == 12


def test_each_call_kind_takes_its_own_fastest(gpu):
    """cuDNN on both kinds when its ragged op is clearly faster on packed documents too; flash dense with
    cuDNN's ragged op; the rules' flash on both when nothing is clearly faster."""
    device = gpu((9, 0))
    dense = dict(cuda_flash=2.0, cuda_cudnn=1.0, cuda_efficient=3.0)
    assert choose(device, Timer(varlen={"cuda_flash": 2.0, "cuda_cudnn": 1.0}, **dense)) is CUDA_CUDNN
    kernel_choice.clear_choices()
    chosen = choose(device, Timer(varlen={"cuda_flash": 2.0, "cuda_cudnn": 1.0},
                                  cuda_flash=1.0, cuda_cudnn=1.0, cuda_efficient=3.0))
    assert chosen.name == "cuda_flash+cuda_cudnn" and parts(chosen) == (CUDA_FLASH.forward, CUDA_CUDNN.varlen_forward)
    assert not chosen.varlen_bottom_right  # cuDNN's causal alignment goes with its op
    kernel_choice.clear_choices()
    assert choose(device, Timer(cuda_flash=1.0, cuda_cudnn=1.0, cuda_efficient=3.0)) is CUDA_FLASH


def test_without_varlen_only_when_measured_faster_on_the_varlen_calls(gpu):
    """A kernel without a varlen op (one dense call per document) never replaces one with it on the varlen
    calls unless it measured clearly faster there, even when it is the fastest dense kernel."""
    device = gpu((8, 0))  # flash (with varlen) and memory-efficient (without)
    even = Timer(varlen={"cuda_flash": 1.0, "cuda_efficient": 0.95}, cuda_flash=1.0, cuda_efficient=0.4)
    chosen = choose(device, even, heads=(8, 8))
    assert parts(chosen) == (CUDA_EFFICIENT.forward, CUDA_FLASH.varlen_forward)
    assert even.names("varlen") == ["cuda_efficient", "cuda_flash"]
    kernel_choice.clear_choices()
    faster = Timer(varlen={"cuda_flash": 1.0, "cuda_efficient": 0.5}, cuda_flash=1.0, cuda_efficient=0.4)
    assert choose(device, faster, heads=(8, 8)) is CUDA_EFFICIENT  # dense per piece: measured faster
    kernel_choice.clear_choices()
    broken = Timer(varlen={"cuda_flash": None, "cuda_efficient": 3.0}, cuda_flash=1.0, cuda_efficient=3.0)
    assert choose(device, broken, heads=(8, 8)).name == "cuda_flash_per_piece"  # its varlen op raised


def test_within_the_margin_the_rule_keeps_its_kernel(gpu):
    device = gpu((9, 0))
    almost = 2.0 * (1 - MARGIN / 2)
    assert choose(device, Timer(cuda_flash=2.0, cuda_cudnn=almost, cuda_efficient=3.0)) is CUDA_FLASH


def test_slower_or_failing_candidates_are_not_chosen(gpu):
    device = gpu((9, 0))
    assert choose(device, Timer(cuda_flash=1.0, cuda_cudnn=None, cuda_efficient=3.0)) is CUDA_FLASH
    kernel_choice.clear_choices()
    chosen = choose(device, Timer(cuda_flash=None, cuda_cudnn=1.0, cuda_efficient=3.0))
    assert chosen.forward is CUDA_CUDNN.forward


def test_on_ampere_flash_and_efficient_are_timed(gpu):
    timer = Timer(cuda_flash=1.0, cuda_efficient=0.4)
    assert choose(gpu((8, 0)), timer, heads=(8, 8)).forward is CUDA_EFFICIENT.forward
    assert timer.names() == ["cuda_efficient", "cuda_flash"]


def test_when_every_candidate_fails_the_rule_stands(gpu):
    assert choose(gpu((9, 0)), Timer(cuda_flash=None, cuda_cudnn=None, cuda_efficient=None)) is CUDA_FLASH


def test_single_candidate_cpu_and_deterministic_mode_skip_the_timing(gpu, monkeypatch):
    never = Timer()  # any call would KeyError
    assert choose_kernel(torch.device("cpu"), BF16, 64, 4, 4, 256, measure=never, probe=passes) is CPU_FLASH
    assert choose_kernel(torch.device("meta"), torch.float32, 64, 4, 4, 256, measure=never, probe=passes) is REFERENCE
    device = gpu((9, 0))
    one_candidate = choose_kernel(device, torch.float32, 128, 4, 4, 256, measure=never, probe=passes)
    assert one_candidate is CUDA_EFFICIENT
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    assert choose(device, never) is CUDA_FLASH
    assert never.calls == []


def test_every_rank_runs_rank_zeros_choices(gpu, monkeypatch):
    """This rank measured flash fastest on both kinds; rank 0 chose cuDNN dense and flash's varlen op: the
    ring here runs rank 0's pair (kernel_choice._rank0_names is the one all_gather_object)."""
    seen = []

    def rank0(names):
        seen.append(names)
        return ("cuda_cudnn", "cuda_flash")

    monkeypatch.setattr(kernel_choice, "_rank0_names", rank0)
    chosen = choose(gpu((9, 0)), Timer(cuda_flash=1.0, cuda_cudnn=3.0, cuda_efficient=3.0))
    assert seen == [("cuda_flash", "cuda_flash")] and chosen.name == "cuda_cudnn+cuda_flash"


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
    assert seconds > 0


def test_kernel_for_reads_the_blocks_shapes():
    q, k = torch.randn(1, 8, 16, 32), torch.randn(1, 2, 16, 32)
    assert kernel_for(q, k, k) is CPU_FLASH


def test_the_timer_runs_each_call_kind_through_the_emulated_ops(monkeypatch):
    """The real measurement on CPU tensors through the CUDA emulation: dense calls, varlen calls through each
    varlen op (checked against the reference first) and per piece; a varlen op whose layout is wrong (a planted
    fault) is refused by that check, so choose_kernel never takes it."""
    ops = install(monkeypatch, allow_fp64=False)
    q, k, v = (torch.randn(64, h, 16).to(BF16) for h in (4, 2, 2))
    for kernel in (CUDA_FLASH, CUDA_CUDNN):
        assert varlen_error(kernel, q, k, v, 8) < VARLEN_TOLERANCE
    timer = make_timer(torch.device("cpu"), BF16, 16, 4, 2, 64)
    for kernel in (CUDA_FLASH, CUDA_CUDNN, per_piece(CUDA_FLASH)):
        ops.calls.clear()
        assert 0 < timer(kernel, "varlen") < 10 and 0 < timer(kernel, "dense") < 10
        varlen_ops = {"_flash_attention_forward", "_cudnn_attention_forward"} & set(ops.calls)
        assert len(varlen_ops) == (kernel.varlen_forward is not None), (kernel.name, ops.calls)
    install(monkeypatch, allow_fp64=False, fault="varlen_cudnn_lse_head_major")
    with pytest.raises(RuntimeError, match="differ from the reference"):
        timer(CUDA_CUDNN, "varlen")
    assert varlen_error(CUDA_FLASH, q, k, v, 8) < VARLEN_TOLERANCE  # the fault is cuDNN's alone


def test_choose_kernel_never_takes_a_varlen_op_that_failed_its_check(gpu, monkeypatch):
    install(monkeypatch, allow_fp64=False, fault="varlen_cudnn_lse_head_major")
    timer = make_timer(torch.device("cpu"), BF16, 16, 4, 2, 64)
    slow_flash = lambda kernel, kind: timer(kernel, kind) * (100.0 if "flash" in kernel.name else 1.0)  # noqa: E731
    chosen = choose_kernel(gpu((9, 0)), BF16, 16, 4, 2, 64, measure=slow_flash, probe=passes)
    assert chosen.varlen_forward is not CUDA_CUDNN.varlen_forward
