"""FlashAttention 3 and 4 as ring kernels (loongtrain/attn/flash_kernels.py, docs/attention.md#kernels), through an
emulation of their call signatures (tests/helpers/flash_emulation.py): candidates only where installed and where
their rules admit the device, probed and chosen like the others (never by rule), exact in the ring (dense, varlen
and window calls, documents, rings of 1-3, the one-call path of a ring of one member)."""

from __future__ import annotations

import random

import pytest
import torch

from loongtrain.attn import kernel_choice
from loongtrain.attn.flash_kernels import CUDA_FA3, CUDA_FA4
from loongtrain.attn.kernel_choice import choose_kernel, kernel_candidates, refused_kernels
from loongtrain.attn.kernel_probe import ProbeSpec, Versions, check_cases
from loongtrain.attn.kernels import REFERENCE
from loongtrain.attn.masking import AttnMask
from loongtrain.attn.ring import Ring, RingCall, ring_backward, ring_forward
from tests.helpers.cuda_emulation import install
from tests.helpers.flash_emulation import install_flash
from tests.helpers.ring_cases import ring_results
from tests.unit.test_documents import random_docs

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(kernel_choice, "current_versions", lambda: Versions((2, 14), 92700))
    kernel_choice.clear_choices()
    yield
    kernel_choice.clear_choices()


def names(device, dtype=BF16, head_dim=128) -> list[str]:
    return [k.name for k in kernel_candidates(device, dtype, head_dim)]


def test_candidates_only_where_installed_and_admitted(gpu, monkeypatch):
    assert names(gpu((9, 0))) == ["cuda_flash", "cuda_cudnn", "cuda_efficient"]  # not installed
    install_flash(monkeypatch)
    assert names(gpu((9, 0))) == ["cuda_flash", "cuda_cudnn", "cuda_fa3", "cuda_fa4", "cuda_efficient"]
    assert names(gpu((10, 0))) == ["cuda_flash", "cuda_cudnn", "cuda_fa4", "cuda_efficient"]  # FA3: Hopper only
    assert names(gpu((10, 0)), head_dim=192) == ["cuda_flash", "cuda_efficient"]  # FA4 on sm100: <= 128 or 256
    assert names(gpu((8, 0))) == ["cuda_flash", "cuda_efficient"]
    assert names(gpu((9, 0)), dtype=torch.float32) == ["cuda_efficient"]


def test_without_the_modules_the_kernels_are_not_offered(gpu, monkeypatch):
    install_flash(monkeypatch, which=("cuda_fa3",))
    assert names(gpu((9, 0))) == ["cuda_flash", "cuda_cudnn", "cuda_fa3", "cuda_efficient"]


class Timer:
    """Fixed seconds per kernel name (``faster``: those at 0.5, the rest 1.0), both call kinds."""

    def __init__(self, *faster: str) -> None:
        self.faster, self.timed = faster, []

    def __call__(self, kernel, kind):
        self.timed.append((kernel.name, kind))
        own_op = kind == "dense" or kernel.varlen_forward is not None
        return 0.5 if kernel.name in self.faster and own_op else 1.0


def test_probed_and_chosen_like_the_others(gpu, monkeypatch):
    """FA4 measured fastest: it runs both call kinds with its window; its probes (dense, varlen, window) ran first.
    Refused by its probe, FA3 (next fastest) is taken; equal times keep the rule's FA2."""
    install_flash(monkeypatch)
    device = gpu((9, 0), cudnn=92700)
    probed = []

    def passes(kernel, kind):
        probed.append((kernel.name, kind))

    chosen = choose_kernel(device, BF16, 128, 16, 4, 4096, measure=Timer("cuda_fa4"), probe=passes)
    assert chosen is CUDA_FA4 and chosen.windowed
    assert {("cuda_fa4", kind) for kind in ("dense", "varlen", "window")} <= set(probed)
    assert {("cuda_fa3", kind) for kind in ("dense", "varlen", "window")} <= set(probed)
    kernel_choice.clear_choices()
    fa4_crashes = lambda k, kind: "cuda_fa4 probe crashed (signal 11)" if k is CUDA_FA4 else None  # noqa: E731
    chosen = choose_kernel(device, BF16, 128, 16, 4, 4096, measure=Timer("cuda_fa4", "cuda_fa3"), probe=fa4_crashes)
    assert chosen is CUDA_FA3 and "dense:cuda_fa4" in refused_kernels()
    kernel_choice.clear_choices()
    assert choose_kernel(device, BF16, 128, 16, 4, 4096, measure=Timer(), probe=lambda k, kind: None).name == \
        "cuda_flash"


@pytest.mark.parametrize("kernel", [CUDA_FA3, CUDA_FA4], ids=lambda k: k.name)
def test_their_probe_passes_on_every_call_kind(monkeypatch, kernel):
    install_flash(monkeypatch)
    for kind in ("dense", "varlen", "window"):
        spec = ProbeSpec(kernel.name, kind, "bfloat16", 16, 4, 2, 160, "cpu")
        assert check_cases(kernel, spec, torch.device("cpu")) is None, kind


@pytest.mark.parametrize("kernel", [CUDA_FA3, CUDA_FA4], ids=lambda k: k.name)
@pytest.mark.parametrize("seed", range(3))
def test_exact_in_the_ring(monkeypatch, kernel, seed):
    """Documents, windows, causal or not, rings of 1-3 (dense, varlen and band calls): fp64 equal to the reference
    kernel, forward and backward."""
    flash = install_flash(monkeypatch, allow_fp64=True)
    install(monkeypatch, allow_fp64=True)
    rng = random.Random(seed)
    docs = tuple(random_docs(24, rng, rng.randint(1, 6)) for _ in range(2))
    for mask in (AttnMask(rng.random() < 0.7, rng.choice([None, 3, 7]), docs), AttnMask(True, 5, None)):
        for cp in (1, 2, 3):
            got, want = ring_results(kernel, mask, cp), ring_results(REFERENCE, mask, cp)
            for g, w in zip(got, want, strict=True):
                assert (g - w).abs().max() < 1e-10, (mask, cp)
    prefix = "fa3" if kernel is CUDA_FA3 else "fa4"
    assert {c.split("_")[0] for c in flash.calls} == {prefix}


@pytest.mark.parametrize("kernel", [CUDA_FA3, CUDA_FA4], ids=lambda k: k.name)
@pytest.mark.parametrize("v_head_dim", [8, 4, 12])
def test_one_call_for_a_ring_of_one_member(monkeypatch, kernel, v_head_dim):
    """One call each way, also with V's head dim not Q/K's (MLA: the library takes one head dim, as the emulation
    checks, so the narrower is zero-padded to the wider and the padding cut off out and the gradients exactly)."""
    flash = install_flash(monkeypatch, allow_fp64=True)
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 4, 32, 8, generator=g, dtype=torch.float64), torch.randn(1, 2, 32, 8, generator=g,
                                                                                    dtype=torch.float64)
    v = torch.randn(1, 2, 32, v_head_dim, generator=g, dtype=torch.float64)
    dout = torch.randn(1, 4, 32, v_head_dim, generator=g, dtype=torch.float64)
    for mask in (AttnMask(True, 9), AttnMask(True, None, ((0, 5, 6, 32),))):
        flash.calls.clear()
        results = []
        for kern in (kernel, REFERENCE):
            call = RingCall(mask, 0.3, kern)
            out, lse = ring_forward(q, k, v, Ring((0,), 0, 1), call)
            results.append((out, lse, *ring_backward(dout, q, k, v, out, lse, Ring((0,), 0, 1), call)))
        assert len(flash.calls) == 2, flash.calls  # one forward call and one backward call
        for got, want in zip(*results, strict=True):
            assert got.shape == want.shape and (got - want).abs().max() < 1e-10


@pytest.mark.parametrize("kernel", [CUDA_FA3, CUDA_FA4], ids=lambda k: k.name)
def test_another_v_head_dim_exact_in_the_ring(monkeypatch, kernel):
    """MLA's head dims (V's 8 and 24 against Q/K's 16) in rings of 2 and 3 with documents and a window (dense,
    varlen and band calls on the padded heads): fp64 equal to the reference kernel, which takes two head dims."""
    flash = install_flash(monkeypatch, allow_fp64=True)
    install(monkeypatch, allow_fp64=True)
    docs = tuple(random_docs(24, random.Random(seed), 3) for seed in range(2))
    for v_head_dim, mask, cp in ((8, AttnMask(True, 5, docs), 2), (24, AttnMask(True, None, docs), 3),
                                 (8, AttnMask(False, 7, None), 3)):
        got, want = (ring_results(k, mask, cp, v_head_dim) for k in (kernel, REFERENCE))
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape and (g - w).abs().max() < 1e-10, (v_head_dim, mask, cp)
    prefix = "fa3" if kernel is CUDA_FA3 else "fa4"
    assert {c.split("_")[0] for c in flash.calls} == {prefix} and len(set(flash.calls)) == 2, flash.calls
