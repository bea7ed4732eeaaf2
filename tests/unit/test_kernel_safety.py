"""The kernel choice cannot kill the run (loongtrain/attn/kernel_probe.py, kernel_choice.py, docs/kernels.md):
the known-bad table refuses listed versions with their reason; the probe's cases are the ring's call shapes and
its check against fp64 names a planted fault (its subprocess: tests/e2e/test_kernel_probe_process.py); the
choice is kept per length bucket; the chosen kernels are recorded; autocast stays out of the custom ops."""

from __future__ import annotations

import pytest
import torch

from loongtrain.attn import kernel_choice, kernel_probe
from loongtrain.attn.cuda_kernels import CUDA_CUDNN, CUDA_EFFICIENT, CUDA_FLASH
from loongtrain.attn.kernel_choice import choose_kernel, chosen_kernels, length_bucket, refused_kernels
from loongtrain.attn.kernel_probe import (
    KNOWN_BAD,
    ProbeSpec,
    Versions,
    check_cases,
    known_bad,
    needs_probe,
    probe_cases,
)
from tests.helpers.cuda_emulation import install
from tests.helpers.kernel_timers import Timer

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    kernel_choice.clear_choices()
    kernel_probe.clear_verdicts()
    yield
    kernel_choice.clear_choices()
    kernel_probe.clear_verdicts()


def on_versions(monkeypatch, torch_version: tuple[int, int], cudnn: int | None) -> None:
    monkeypatch.setattr(kernel_choice, "current_versions", lambda: Versions(torch_version, cudnn))


# ---------------------------------------------------------------- the known-bad table


def test_the_table_refuses_cudnn_varlen_before_torch_2_14_with_its_reason():
    old, new = Versions((2, 13), 92700), Versions((2, 14), 92700)
    reason = known_bad(CUDA_CUDNN, "varlen", old)
    assert reason is not None and "out of bounds" in reason and "2.13" in reason and "#186142" in reason
    assert known_bad(CUDA_CUDNN, "varlen", new) is None
    assert known_bad(CUDA_FLASH, "varlen", old) is None and known_bad(CUDA_EFFICIENT, "dense", old) is None


def test_the_table_refuses_cudnn_dense_on_cudnn_up_to_9_26():
    assert "NaN dK/dV" in known_bad(CUDA_CUDNN, "dense", Versions((2, 14), 92600))
    assert known_bad(CUDA_CUDNN, "dense", Versions((2, 14), 92700)) is None
    assert known_bad(CUDA_CUDNN, "dense", Versions((2, 14), None)) is None  # no cuDNN: nothing to refuse
    assert all(entry.kind in kernel_choice.CALL_KINDS and entry.reason for entry in KNOWN_BAD)


def test_a_known_bad_version_is_refused_before_anything_runs(gpu, monkeypatch):
    """torch 2.13 with cuDNN 9.26: cuDNN refused (dense, so its varlen op is not offered either), neither
    probed nor timed; flash runs. With cuDNN 9.27 only its varlen op is refused on torch 2.13."""
    on_versions(monkeypatch, (2, 13), 92600)
    probed, timer = [], Timer()
    chosen = choose_kernel(gpu((9, 0), cudnn=92600), BF16, 128, 16, 4, 4096, measure=timer,
                           probe=lambda k, kind: probed.append((k.name, kind)))
    assert chosen is CUDA_FLASH
    assert not any(name.startswith("cuda_cudnn") for name, _ in probed + timer.timed)
    assert list(refused_kernels()) == ["dense:cuda_cudnn"] and "NaN dK/dV" in refused_kernels()["dense:cuda_cudnn"]
    kernel_choice.clear_choices()
    on_versions(monkeypatch, (2, 13), 92700)
    chosen = choose_kernel(gpu((9, 0), cudnn=92700), BF16, 128, 16, 4, 4096, measure=Timer(),
                           probe=lambda k, kind: None)
    assert chosen.name == "cuda_cudnn+cuda_flash"
    assert list(refused_kernels()) == ["varlen:cuda_cudnn"]
    assert "out of bounds" in refused_kernels()["varlen:cuda_cudnn"]


def test_only_cudnn_and_unverified_torch_are_probed():
    assert needs_probe(CUDA_CUDNN, Versions((2, 13), 92700))
    assert not needs_probe(CUDA_FLASH, Versions((2, 13), 92700))
    assert needs_probe(CUDA_FLASH, Versions((2, 14), 92700))  # not yet run on a device here


# ---------------------------------------------------------------- the probe's cases and checks


def test_the_cases_are_the_rings_call_shapes():
    block = 512
    varlen = probe_cases("varlen", block)
    assert any(c.q_lens != c.k_lens for c in varlen)  # distinct cu_seqlens for q and k
    max_q = {max(c.q_lens) for c in varlen + probe_cases("dense", block)}
    assert {1, 128, block} <= max_q
    assert {c.causal for c in varlen} == {True, False}
    assert any(min(c.k_lens) < 16 < block <= max(c.k_lens) for c in varlen)  # short and long documents
    top_left = probe_cases("varlen", block, bottom_right=False)  # cuDNN's: causal only squares
    assert all(c.q_lens == c.k_lens for c in top_left if c.causal)


@pytest.mark.parametrize("fault, kernel", [("varlen_cudnn_lse_head_major", CUDA_CUDNN),
                                           ("varlen_lse_token_major", CUDA_FLASH)])
def test_check_cases_passes_the_emulated_ops_and_names_a_planted_fault(monkeypatch, fault, kernel):
    spec = ProbeSpec(kernel.name, "varlen", "bfloat16", 16, 2, 160, "cpu")
    install(monkeypatch, allow_fp64=False)
    assert check_cases(kernel, spec, torch.device("cpu")) is None
    assert check_cases(CUDA_CUDNN, ProbeSpec("cuda_cudnn", "dense", "bfloat16", 16, 2, 160, "cpu"),
                       torch.device("cpu")) is None
    install(monkeypatch, allow_fp64=False, fault=fault)
    reason = check_cases(kernel, spec, torch.device("cpu"))
    assert reason.startswith(f"{kernel.name} (varlen) wrong on q lengths") and "lse off by" in reason


def test_distinct_cu_seqlens_catch_swapped_sequence_bounds(monkeypatch):
    """A wrapper passing cu_q and cu_k swapped is invisible with one tensor for both (the timing's own check);
    the probe's distinct lengths catch it."""
    install(monkeypatch, allow_fp64=False, fault="varlen_cum_seq_swapped")
    with pytest.raises(AssertionError, match="cum_seq"):
        check_cases(CUDA_FLASH, ProbeSpec("cuda_flash", "varlen", "bfloat16", 16, 2, 160, "cpu"),
                    torch.device("cpu"))


# ---------------------------------------------------------------- kept per length bucket, recorded


def test_the_choice_is_kept_per_length_bucket_and_recorded(gpu, monkeypatch):
    on_versions(monkeypatch, (2, 14), 92700)
    device = gpu((9, 0), cudnn=92700)
    timer = Timer()
    choose_kernel(device, BF16, 128, 16, 4, 4096, measure=timer, probe=lambda k, kind: None)
    n = len(timer.timed)
    choose_kernel(device, BF16, 128, 16, 4, 3000, measure=timer, probe=lambda k, kind: None)  # same bucket
    assert len(timer.timed) == n
    choose_kernel(device, BF16, 128, 16, 4, 16384, measure=timer, probe=lambda k, kind: None)  # a longer one
    assert len(timer.timed) == 2 * n
    assert (length_bucket(1), length_bucket(4096), length_bucket(4097)) == (1, 4096, 8192)
    assert chosen_kernels() == {"bfloat16 d128 16/4 heads, blocks <= 4096": "cuda_cudnn",
                                "bfloat16 d128 16/4 heads, blocks <= 16384": "cuda_cudnn"}


# ---------------------------------------------------------------- autocast stays out of the custom ops


def test_autocast_does_not_reach_inside_the_ring_ops():
    """fp32 attention under bf16 autocast is fp32 attention, forward and backward (documents and a sliding
    window make masked pieces, which run plain matmuls that autocast would take to bf16)."""
    from loongtrain.attn.api import attention  # noqa: PLC0415

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 48, h, 16, generator=g).requires_grad_() for h in (4, 2, 2))
    dout = torch.randn(1, 48, 4, 16, generator=g)

    def run(autocast: bool):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = attention(q, k, v, None, cu_seqlens=[0, 5, 30, 48], sliding_window=7)
        return [out, *torch.autograd.grad(out, (q, k, v), dout)]

    for plain, under in zip(run(False), run(True)):
        assert under.dtype == torch.float32
        assert (plain - under).abs().max() < 1e-6


def test_the_chosen_kernels_are_in_the_metrics_rows_and_the_checkpoint(tmp_path):
    import json  # noqa: PLC0415

    from loongtrain.launch.config import TrainConfig  # noqa: PLC0415
    from loongtrain.model.config import ModelConfig  # noqa: PLC0415
    from loongtrain.parallel.config import ParallelConfig  # noqa: PLC0415
    from loongtrain.parallel.mesh import single_process_mesh  # noqa: PLC0415
    from tests.helpers.training import fit  # noqa: PLC0415

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    cfg = TrainConfig.from_dict(dict(corpus=str(corpus), seq_len=64, steps=1, warmup=0, parallel=ParallelConfig(),
                      out_dir=str(tmp_path / "run"), peak_tflops=1.0, tensorboard=False, plot=False, progress="off",
                      memory_report=False))
    model = ModelConfig(vocab_size=256, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=64)
    records = fit(cfg, single_process_mesh(), torch.device("cpu"), model_config=model)
    assert records[-1]["attention_kernels"] == "cpu_flash"
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["attention_kernels"] == "cpu_flash"
    state = json.loads(next((tmp_path / "run" / "checkpoints").glob("step_*/trainer_state.json")).read_text())
    assert state["attention_kernels"] == {"float32 d8 4/2 heads, blocks <= 64": "cpu_flash"}
    assert state["refused_kernels"] == {}
