"""The kernel probe's subprocess (loongtrain/attn/kernel_probe.py, docs/kernels.md#safety): a crash, a timeout
or a pass in the probe process, each in one line and cached; and the target: a cuDNN varlen candidate that
crashes its probe process is dropped, the varlen calls take flash, and the ring runs exact with it."""

from __future__ import annotations

import sys

import pytest
import torch

from loongtrain.attn import kernel_choice, kernel_probe
from loongtrain.attn.cuda_kernels import CUDA_CUDNN, CUDA_FLASH
from loongtrain.attn.kernel_choice import choose_kernel, refused_kernels
from loongtrain.attn.kernel_probe import ProbeSpec, Versions, probe_in_subprocess
from loongtrain.attn.kernels import REFERENCE
from loongtrain.attn.masking import AttnMask
from loongtrain.attn.ring import local_ring_backward, local_ring_forward
from tests.helpers.cuda_emulation import install
from tests.helpers.kernel_timers import Timer

BF16 = torch.bfloat16
EMULATED = (sys.executable, "-m", "tests.helpers.emulated_probe")


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(kernel_choice, "current_versions", lambda: Versions((2, 14), 92700))  # none listed
    kernel_choice.clear_choices()
    kernel_probe.clear_verdicts()
    yield
    kernel_choice.clear_choices()
    kernel_probe.clear_verdicts()


def test_a_crashing_probe_process_gives_one_line_and_is_cached():
    spec = ProbeSpec("cuda_cudnn", "varlen", "bfloat16", 16, 2, 64, "cuda:0")
    reason = probe_in_subprocess(spec, (*EMULATED, "crash"))
    assert reason.startswith("cuda_cudnn (varlen) probe crashed (signal 6)") and "illegal memory" in reason
    assert "\n" not in reason
    assert probe_in_subprocess(spec, (sys.executable, "-c", "raise SystemExit(3)")) == reason  # kept


def test_a_probe_that_passes_or_times_out(monkeypatch):
    spec = ProbeSpec("cuda_flash", "varlen", "bfloat16", 16, 2, 64, "cuda:0")
    assert probe_in_subprocess(spec, (*EMULATED, "ok")) is None
    kernel_probe.clear_verdicts()
    slow = (sys.executable, "-c", "import time; time.sleep(30)")
    assert probe_in_subprocess(spec, slow, timeout_s=0.5) == "cuda_flash (varlen) probe did not finish in 0 s"


# ---------------------------------------------------------------- the target: a fault drops the candidate


def test_a_faulting_cudnn_varlen_candidate_is_dropped_and_the_ring_runs_flash(gpu, monkeypatch):
    """cuDNN's varlen op crashes its probe process (a sticky illegal address); it is dropped with one line,
    the varlen calls take flash's op although cuDNN timed faster, and the ring then runs exact (fp64
    emulation) with packed documents."""
    device = gpu((9, 0), cudnn=92700)

    def probe(kernel, kind):  # the real subprocess probe; cuDNN's varlen op crashes in it
        mode = "crash" if kernel.name == "cuda_cudnn" and kind == "varlen" else "ok"
        return probe_in_subprocess(ProbeSpec(kernel.name, kind, "bfloat16", 16, 2, 64, "cuda:0"),
                                   (*EMULATED, mode))

    verdicts: dict = {}
    cached = lambda k, kind: verdicts.setdefault((k.name, kind), None) if kind == "dense" else probe(k, kind)  # noqa: E731
    timer = Timer()
    chosen = choose_kernel(device, BF16, 16, 4, 2, 64, measure=timer, probe=cached)
    assert chosen.forward is CUDA_CUDNN.forward  # dense cuDNN passed and is faster
    assert chosen.varlen_forward is CUDA_FLASH.varlen_forward and chosen.name == "cuda_cudnn+cuda_flash"
    assert ("cuda_cudnn", "varlen") not in timer.timed
    assert refused_kernels()["varlen:cuda_cudnn"].startswith("cuda_cudnn (varlen) probe crashed")

    install(monkeypatch, allow_fp64=True)
    mask = AttnMask(True, None, ((0, 1, 7, 13, 24), (0, 24)))
    got, want = ring_results(chosen, mask), ring_results(REFERENCE, mask)
    for g, w in zip(got, want, strict=True):
        assert (g - w).abs().max() < 1e-10


def ring_results(kernel, mask: AttnMask, cp: int = 2) -> list[torch.Tensor]:
    """The in-process ring's out, lse, dq, dk, dv (fp64, 2 batch rows of 24 tokens, 4/2 heads of dim 16) on
    contiguous shards (the ring's math does not depend on the layout's order)."""
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(2, h, 24, 16, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4))
    order = torch.arange(24).view(2 * cp, -1)
    idx = [torch.cat([order[c], order[2 * cp - 1 - c]]) for c in range(cp)]  # zigzag
    qs, ks, vs, ds = ([t[:, :, i] for i in idx] for t in (q, k, v, dout))
    res = local_ring_forward(qs, ks, vs, 1, True, 0.25, kernel, mask=mask)
    grads = local_ring_backward(ds, qs, ks, vs, [o for o, _ in res], [m for _, m in res], 1, True, 0.25, kernel,
                                mask=mask)
    return [torch.cat(list(parts), dim=2) for parts in (*zip(*res), *zip(*grads))]
