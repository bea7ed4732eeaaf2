"""The probe process (loongtrain/attn/probe_batch.py, kernel_probe.py, docs/kernels.md#safety), over the CUDA
emulation: every spec of a run in one process; a crash refuses the spec it hit in one line and a second process
checks the rest; the verdicts are kept on disk per versions (a new process reads them, none is started); a timeout
refuses the spec it hit; a process that fails for its own reasons (it cannot start, it runs out of memory) is an
error naming it, never a refusal; and the target: a crashing cuDNN varlen candidate is dropped, the varlen calls
take flash, and the ring runs exact with it."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from loongtrain.attn import kernel_choice, probe_batch
from loongtrain.attn.cuda_kernels import CUDA_CUDNN, CUDA_FLASH
from loongtrain.attn.kernel_choice import choose_kernel, refused_kernels
from loongtrain.attn.kernel_gate import BatchProbe
from loongtrain.attn.kernel_probe import ProbeSpec, Versions
from loongtrain.attn.kernels import REFERENCE
from loongtrain.attn.masking import AttnMask
from loongtrain.attn.probe_batch import ProbeError, cache_path
from loongtrain.attn.probe_batch import probe_batch as run_batch
from tests.helpers.cuda_emulation import install
from tests.helpers.kernel_timers import Timer
from tests.helpers.ring_cases import ring_results

BF16 = torch.bfloat16
EMULATED = (sys.executable, "-m", "tests.helpers.emulated_probe")
VERSIONS = Versions((2, 14), 92700, "2.14.0+cu130", 13000, "NVIDIA H200")
NOT_STARTED = (sys.executable, "-c", "raise SystemExit(9)")  # a process that would fail were it started


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(kernel_choice, "current_versions", lambda: VERSIONS)  # none listed
    kernel_choice.clear_choices()
    probe_batch.clear_verdicts()
    yield
    kernel_choice.clear_choices()
    probe_batch.clear_verdicts()


def spec(kernel: str, kind: str) -> ProbeSpec:
    return ProbeSpec(kernel, kind, "bfloat16", 16, 4, 2, 64, "cuda:0")


def fake(*lines: str, then: str = "") -> tuple[str, ...]:
    """A stand-in probe process printing ``lines`` (the protocol) and then running ``then`` (no torch: quick)."""
    body = "".join(f"print({line!r}, flush=True)\n" for line in lines) + then
    return (sys.executable, "-c", body)


def test_a_hang_is_refused_when_its_time_is_up():
    key = spec("cuda_cudnn", "varlen").key()
    got = run_batch([spec("cuda_cudnn", "varlen")], VERSIONS, fake("READY", f"BEGIN {key}",
                                                                   then="import time; time.sleep(60)"), timeout_s=0.5)
    assert got == {key: "cuda_cudnn (varlen) probe did not finish in 0 s"}


@pytest.mark.parametrize("lines, then, words", [
    ((), "import flash_attn_3._C", r"could not start \(exit status 1\).*No module named 'flash_attn_3'"),
    ((), "import sys; print('CUDA error: all CUDA-capable devices are busy or unavailable', file=sys.stderr); "
         "raise SystemExit(1)", r"busy or unavailable.*exclusive-process compute mode.*nvidia-smi -c DEFAULT"),
    (("READY", "BEGIN varlen:cuda_cudnn", 'ERROR {"key": "varlen:cuda_cudnn", "error": "OutOfMemoryError: CUDA out '
      'of memory"}'), "raise SystemExit(3)", r"failed for its own reasons while checking varlen:cuda_cudnn: "
                                             r"OutOfMemoryError.*not a verdict on the kernel"),
    (("READY",), "raise SystemExit(1)", r"ended \(exit status 1\) between checks"),
], ids=["import", "exclusive-process", "out-of-memory", "between-checks"])
def test_the_process_failing_for_its_own_reasons_is_an_error_naming_it(lines, then, words, tmp_path):
    with pytest.raises(ProbeError, match=words):
        run_batch([spec("cuda_flash", "dense"), spec("cuda_cudnn", "varlen")], VERSIONS, fake(*lines, then=then),
                  cache_dir=tmp_path)
    assert not cache_path(tmp_path, VERSIONS).exists()  # nothing recorded as a verdict


def test_an_own_failure_reaches_the_choice_as_an_error_not_a_refusal(gpu, monkeypatch):
    device = gpu((9, 0), cudnn=92700)

    class Failing(BatchProbe):
        def prefetch(self, pairs):
            raise ProbeError("the kernel probe process could not start (exit status 1): CUDA error: all CUDA-capable "
                             "devices are busy or unavailable")

    probe = Failing(torch.device("cuda", 0), BF16, 16, 4, 2, 64, VERSIONS, cache_dir=None)
    with pytest.raises(ProbeError, match="busy or unavailable"):
        choose_kernel(device, BF16, 16, 4, 2, 64, measure=Timer(), probe=probe)
    assert refused_kernels() == {}


# ---------------------------------------------------------------- the target: a fault drops the candidate


def test_a_crashing_cudnn_varlen_candidate_is_dropped_and_the_ring_runs_flash(gpu, monkeypatch, tmp_path):
    """The probe process over the CUDA emulation, cuDNN's varlen op crashing it (a sticky illegal address): every
    check of the choice runs in one process up to the crash and a second one for the rest; that one candidate is
    dropped with one line, the varlen calls take flash's op although cuDNN timed faster, the verdicts stay on disk
    (a new process of this run reads them, starting no probe process), and the ring runs exact (fp64 emulation)
    with packed documents."""
    device = gpu((9, 0), cudnn=92700)
    started = []
    real = probe_batch._run_process
    monkeypatch.setattr(probe_batch, "_run_process", lambda specs, *a: started.append(len(specs)) or real(specs, *a))
    probe = BatchProbe(torch.device("cuda", 0), BF16, 16, 4, 2, 64, VERSIONS, cache_dir=tmp_path,
                       command=(*EMULATED, "crash"))
    timer = Timer()
    chosen = choose_kernel(device, BF16, 16, 4, 2, 64, measure=timer, probe=probe)
    assert chosen.forward is CUDA_CUDNN.forward  # dense cuDNN passed and is faster
    assert chosen.varlen_forward is CUDA_FLASH.varlen_forward and chosen.name == "cuda_cudnn+cuda_flash"
    assert ("cuda_cudnn", "varlen") not in timer.timed and set(refused_kernels()) == {"varlen:cuda_cudnn"}
    crash = refused_kernels()["varlen:cuda_cudnn"]
    assert crash.startswith("cuda_cudnn (varlen) probe crashed (signal 6)") and "illegal memory" in crash
    assert "\n" not in crash and len(started) == 2 and started[1] < started[0]  # the rest after the crash
    on_disk = json.loads(cache_path(tmp_path, VERSIONS).read_text())
    assert on_disk["verdicts"] == probe.verdicts and on_disk["versions"]["gpu"] == "NVIDIA H200"
    probe_batch.clear_verdicts()  # a new process of the same versions reads the file
    assert run_batch([probe.spec(CUDA_CUDNN, "varlen")], VERSIONS, NOT_STARTED, cache_dir=tmp_path) == {
        probe.spec(CUDA_CUDNN, "varlen").key(): crash}
    other = Versions((2, 14), 92700, "2.14.0+cu130", 13010, "NVIDIA H200")  # another driver: probed again
    assert cache_path(tmp_path, other) != cache_path(tmp_path, VERSIONS)

    install(monkeypatch, allow_fp64=True)
    mask = AttnMask(True, None, ((0, 1, 7, 13, 24), (0, 24)))
    got, want = ring_results(chosen, mask), ring_results(REFERENCE, mask)
    for g, w in zip(got, want, strict=True):
        assert (g - w).abs().max() < 1e-10
