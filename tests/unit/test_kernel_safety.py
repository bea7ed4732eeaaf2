"""The kernel choice cannot kill the run (loongtrain/attn/kernel_probe.py, kernel_gate.py, kernel_choice.py,
docs/kernels.md): the known-bad table refuses listed versions with their reason, or narrows cuDNN's dense calls to
the shapes its bug cannot reach; what is probed, on which cases (the ring's call shapes: several KV heads, one-row
sequences, windows, strongly negative scores), against a reference sized to the device; the check names a planted
fault (the probe process: tests/e2e/test_kernel_probe_process.py); never the reference kernel at a length the
device cannot hold; the choice is kept per length bucket and recorded; autocast stays out of the custom ops."""

from __future__ import annotations

import pytest
import torch

from loongtrain.attn import kernel_choice, kernel_gate, probe_batch
from loongtrain.attn.cuda_kernels import CUDA_CUDNN, CUDA_CUDNN_ROWS2, CUDA_EFFICIENT, CUDA_FLASH
from loongtrain.attn.kernel_choice import choose_kernel, chosen_kernels, length_bucket, refused_kernels
from loongtrain.attn.kernel_gate import NoSafeKernel
from loongtrain.attn.kernel_probe import (
    KNOWN_BAD,
    ProbeSpec,
    Versions,
    check_cases,
    known_bad,
    narrowing,
    needs_probe,
    probe_cases,
    probe_heads,
    reference_rows,
)
from loongtrain.attn.kernels import REFERENCE
from tests.helpers.cuda_emulation import install
from tests.helpers.kernel_timers import Timer

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    kernel_choice.clear_choices()
    probe_batch.clear_verdicts()
    yield
    kernel_choice.clear_choices()
    probe_batch.clear_verdicts()


def on_versions(monkeypatch, torch_version: tuple[int, int], cudnn: int | None) -> None:
    monkeypatch.setattr(kernel_choice, "current_versions", lambda: Versions(torch_version, cudnn))


def spec(kernel: str, kind: str, block: int = 160, heads: tuple[int, int] = (4, 2)) -> ProbeSpec:
    return ProbeSpec(kernel, kind, "bfloat16", 16, *heads, block, "cpu")


# ---------------------------------------------------------------- the known-bad table


def test_the_table_refuses_cudnn_varlen_before_torch_2_14_and_up_to_cudnn_9_26():
    old, new = Versions((2, 13), 92700), Versions((2, 14), 92700)
    reason = known_bad(CUDA_CUDNN, "varlen", old)
    assert reason is not None and "out of bounds" in reason and "2.13" in reason and "#186142" in reason
    assert known_bad(CUDA_CUDNN, "varlen", new) is None
    assert "NaN dK/dV" in known_bad(CUDA_CUDNN, "varlen", Versions((2, 14), 92600))  # one-row sequences too
    assert known_bad(CUDA_FLASH, "varlen", old) is None and known_bad(CUDA_EFFICIENT, "dense", old) is None
    assert all(entry.kind in ("dense", "varlen", "window") and entry.reason for entry in KNOWN_BAD)


def test_the_table_narrows_cudnn_dense_to_calls_its_bug_cannot_reach():
    """cuDNN <= 9.26's NaN needs a one-row query: its dense calls of two or more rows stay, one-row calls go to FA2
    (the ring's dense calls of one row: a length-1 document, a lone row of a step)."""
    old = Versions((2, 14), 92600)
    assert known_bad(CUDA_CUDNN, "dense", old) is None
    rows, reason = narrowing(CUDA_CUDNN, "dense", old)
    assert rows == 1 and "NaN dK/dV" in reason and "#1072" in reason
    assert narrowing(CUDA_CUDNN, "dense", Versions((2, 14), 92700)) is None
    assert narrowing(CUDA_FLASH, "dense", old) is None


def test_narrowed_cudnn_sends_one_row_calls_to_flash(monkeypatch):
    ops = install(monkeypatch, allow_fp64=False)
    g = torch.Generator().manual_seed(0)
    for rows, op in ((1, "_scaled_dot_product_flash_attention"), (2, "_scaled_dot_product_cudnn_attention")):
        q = torch.randn(1, 4, rows, 16, generator=g).to(BF16)
        k, v = (torch.randn(1, 2, 9, 16, generator=g).to(BF16) for _ in range(2))
        ops.calls.clear()
        out, lse = CUDA_CUDNN_ROWS2.forward(q, k, v, False, 0.25)
        CUDA_CUDNN_ROWS2.backward(torch.ones_like(out), q, k, v, out, lse, False, 0.25)
        assert ops.calls == [op, op + "_backward"]


def test_a_known_bad_version_is_refused_or_narrowed_before_anything_runs(gpu, monkeypatch):
    """torch 2.13 with cuDNN 9.26: cuDNN's varlen op refused (neither probed nor timed), its dense calls narrowed to
    two or more rows (probed and timed as ``cuda_cudnn_rows2``, taken where faster); with cuDNN 9.27 its dense calls
    are whole, its varlen op still refused on torch 2.13."""
    on_versions(monkeypatch, (2, 13), 92600)
    probed, timer = [], Timer()
    chosen = choose_kernel(gpu((9, 0), cudnn=92600), BF16, 128, 16, 4, 4096, measure=timer,
                           probe=lambda k, kind: probed.append((k.name, kind)))
    assert chosen.name == "cuda_cudnn_rows2+cuda_flash" and chosen.varlen_forward is CUDA_FLASH.varlen_forward
    assert ("cuda_cudnn_rows2", "dense") in probed and ("cuda_cudnn_rows2", "dense") in timer.timed
    assert not any(k == "cuda_cudnn" for k, _ in probed + timer.timed)
    assert set(refused_kernels()) == {"varlen:cuda_cudnn", "dense:cuda_cudnn (narrowed)"}
    assert "out of bounds" in refused_kernels()["varlen:cuda_cudnn"]
    kernel_choice.clear_choices()
    on_versions(monkeypatch, (2, 13), 92700)
    chosen = choose_kernel(gpu((9, 0), cudnn=92700), BF16, 128, 16, 4, 4096, measure=Timer(),
                           probe=lambda k, kind: None)
    assert chosen.name == "cuda_cudnn+cuda_flash" and list(refused_kernels()) == ["varlen:cuda_cudnn"]


def test_what_is_probed():
    """cuDNN and FlashAttention 3/4 always; torch's other CUDA kernels unless the (release, call kind) ran on a
    device here: torch 2.11's dense calls (the H200 run); their varlen and window calls everywhere."""
    v211, v213 = Versions((2, 11), 91900), Versions((2, 13), 92700)
    assert needs_probe(CUDA_CUDNN, "dense", v211) and needs_probe(CUDA_CUDNN_ROWS2, "dense", v211)
    assert not needs_probe(CUDA_FLASH, "dense", v211) and not needs_probe(CUDA_EFFICIENT, "dense", v211)
    assert needs_probe(CUDA_FLASH, "varlen", v211) and needs_probe(CUDA_FLASH, "window", v211)
    assert needs_probe(CUDA_FLASH, "dense", v213)  # never run on a device here
    assert not needs_probe(REFERENCE, "dense", v213)


# ---------------------------------------------------------------- the probe's cases and checks


def test_the_cases_are_the_rings_call_shapes():
    block = 512
    varlen, dense = probe_cases("varlen", block), probe_cases("dense", block)
    assert any(c.q_lens != c.k_lens for c in varlen)  # distinct cu_seqlens for q and k
    assert {1, 128, block} <= {max(c.q_lens) for c in varlen + dense}
    assert {c.causal for c in varlen} == {True, False}
    assert any(min(c.k_lens) < 16 < block <= max(c.k_lens) for c in varlen)  # short and long documents
    assert any(set(c.q_lens) == {1} and len(c.q_lens) > 1 for c in varlen)  # one-row sequences only (FA2's swap)
    assert any(c.negative and c.q_lens[0] > 1 for c in dense)  # narrowed cuDNN meets negative scores at many rows
    top_left = probe_cases("varlen", block, bottom_right=False)  # cuDNN's: causal only squares
    assert all(c.q_lens == c.k_lens for c in top_left if c.causal)
    window = probe_cases("window", block)
    assert all(c.window is not None for c in window) and {len(c.q_lens) for c in window} == {1, 2}
    assert probe_heads(32, 8) == (8, 2) and probe_heads(8, 8) == (2, 2) and probe_heads(64, 1) == (8, 1)


@pytest.mark.parametrize("fault, kernel", [("varlen_cudnn_lse_head_major", CUDA_CUDNN),
                                           ("varlen_lse_token_major", CUDA_FLASH)])
def test_check_cases_passes_the_emulated_ops_and_names_a_planted_fault(monkeypatch, fault, kernel):
    install(monkeypatch, allow_fp64=False)
    assert check_cases(kernel, spec(kernel.name, "varlen"), torch.device("cpu")) is None
    assert check_cases(CUDA_CUDNN_ROWS2, spec("cuda_cudnn_rows2", "dense"), torch.device("cpu")) is None
    install(monkeypatch, allow_fp64=False, fault=fault)
    reason = check_cases(kernel, spec(kernel.name, "varlen"), torch.device("cpu"))
    assert reason.startswith(f"{kernel.name} (varlen) wrong on q lengths") and "lse off by" in reason


def test_fa2s_window_calls_pass_their_probe_and_a_wrong_window_is_named(monkeypatch):
    install(monkeypatch, allow_fp64=False)
    assert check_cases(CUDA_FLASH, spec("cuda_flash", "window"), torch.device("cpu")) is None
    real = CUDA_FLASH.forward
    shifted = kernel_choice.dataclasses.replace(
        CUDA_FLASH, forward=lambda q, k, v, causal, scale, window=None: real(q, k, v, causal, scale,
                                                                            window=(window[0] // 2, window[1])))
    reason = check_cases(shifted, spec("cuda_flash", "window"), torch.device("cpu"))
    assert reason.startswith("cuda_flash (window) wrong on q lengths") and "window=(127, 0)" in reason


def test_distinct_cu_seqlens_catch_swapped_sequence_bounds(monkeypatch):
    """A wrapper passing cu_q and cu_k swapped is invisible with one tensor for both (the timing's own check);
    the probe's distinct lengths catch it."""
    install(monkeypatch, allow_fp64=False, fault="varlen_cum_seq_swapped")
    with pytest.raises(AssertionError, match="cum_seq"):
        check_cases(CUDA_FLASH, spec("cuda_flash", "varlen"), torch.device("cpu"))


def test_the_reference_is_sized_to_the_device(monkeypatch):
    """Rows per fp64 reference call follow the budget (a quarter of the device's free memory in the probe
    process): fewer rows, the same verdict."""
    assert reference_rows(131072, 8, None) == reference_rows(131072, 8, 100 << 30) == 1024
    assert reference_rows(131072, 8, 4 << 30) == (4 << 30) // (6 * 8 * 8 * 131072) == 85  # 6 buffers of 8 x 85 x S
    assert reference_rows(131072, 8, 1 << 20) == 16
    install(monkeypatch, allow_fp64=False)
    calls = []
    real = kernel_choice.REFERENCE.forward.__globals__["reference_forward"]
    monkeypatch.setattr("loongtrain.attn.kernel_probe.reference_forward",
                        lambda q, *a, **kw: calls.append(q.shape[2]) or real(q, *a, **kw))
    assert check_cases(CUDA_FLASH, spec("cuda_flash", "dense"), torch.device("cpu"), budget_bytes=40_000) is None
    assert max(calls) <= reference_rows(160, 4, 40_000) < 160


# ---------------------------------------------------------------- never the reference where it cannot hold


def test_no_fused_kernel_and_no_room_for_the_reference_is_an_error_naming_the_refusals(gpu, monkeypatch):
    on_versions(monkeypatch, (2, 14), 92700)
    device = gpu((9, 0), cudnn=92700)
    monkeypatch.setattr(kernel_gate, "_device_bytes", lambda device: 80 << 30)
    refuse = lambda k, kind: f"{k.name} ({kind}) probe crashed (signal 6): illegal address"  # noqa: E731
    with pytest.raises(NoSafeKernel, match=r"blocks of 65536 tokens .*dense:cuda_flash: cuda_flash \(dense\) probe "
                                           r"crashed.*the reference kernel would need 768.0 GiB of the device's 80.0"):
        choose_kernel(device, BF16, 128, 16, 4, 65536, measure=Timer(), probe=refuse)
    assert choose_kernel(device, BF16, 128, 16, 4, 4096, measure=Timer(), probe=refuse) is REFERENCE  # it fits
    with pytest.raises(NoSafeKernel, match="no fused kernel takes this dtype"):  # fp64: the reference by rule
        choose_kernel(device, torch.float64, 128, 16, 4, 65536, measure=Timer(), probe=refuse)


def test_a_refused_window_keeps_the_kernel_and_cuts_windows(gpu, monkeypatch):
    on_versions(monkeypatch, (2, 14), 92700)
    window_bad = lambda k, kind: "wrong band" if kind == "window" else None  # noqa: E731
    chosen = choose_kernel(gpu((8, 0)), BF16, 128, 16, 4, 4096, measure=Timer(), probe=window_bad)
    assert chosen.forward is CUDA_FLASH.forward and not chosen.windowed
    assert refused_kernels() == {"window:cuda_flash": "wrong band"}
    kernel_choice.clear_choices()
    assert choose_kernel(gpu((8, 0)), BF16, 128, 16, 4, 4096, measure=Timer(), probe=lambda k, kind: None).windowed


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


# ---------------------------------------------------------------- the probe process's body, in this process


def test_the_probe_process_tells_its_own_failures_from_the_kernels(monkeypatch):
    """``run_specs``: a verdict per spec; a kernel that raises gets that as its verdict; an allocation failure is
    the process's own (an ``ERROR`` line and status 3), not a verdict."""
    import dataclasses  # noqa: PLC0415
    import io  # noqa: PLC0415
    import json  # noqa: PLC0415

    from loongtrain.attn.probe_process import OWN_FAILURE, run_specs  # noqa: PLC0415

    install(monkeypatch, allow_fp64=False)

    def failing(exc):
        def forward(*args, **kwargs):
            raise exc
        return dataclasses.replace(CUDA_FLASH, forward=forward)

    kernels = {"cuda_flash": CUDA_FLASH, "bad": failing(RuntimeError("invalid argument\nmore")),
               "oom": failing(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 40 GiB"))}
    out = io.StringIO()
    specs = [spec("cuda_flash", "dense", 32), dataclasses.replace(spec("cuda_flash", "dense", 32), kernel="bad"),
             dataclasses.replace(spec("cuda_flash", "dense", 32), kernel="oom"), spec("cuda_flash", "varlen", 32)]
    assert run_specs(specs, kernels, out) == OWN_FAILURE
    lines = out.getvalue().splitlines()
    assert lines[:2] == ["READY", f"BEGIN {specs[0].key()}"]
    verdicts = [json.loads(x.split(" ", 1)[1]) for x in lines if x.startswith("VERDICT")]
    assert verdicts == [{"key": specs[0].key(), "reason": None},
                        {"key": specs[1].key(), "reason": "bad (dense) raised RuntimeError: invalid argument"}]
    assert lines[-1].startswith("ERROR ") and "OutOfMemoryError" in lines[-1]  # the last spec never ran
