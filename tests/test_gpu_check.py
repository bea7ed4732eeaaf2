"""benchmarks/gpu_check.py runs on CPU at tiny sizes (``--cpu``), so the one-shot device check cannot rot,
and its ring check can fail: a planted fault in the in-process ring shows up in its ratios."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gpu_check():
    return _load_gpu_check()


def test_cpu_run_writes_every_section(gpu_check, tmp_path):
    out = tmp_path / "check.json"
    assert gpu_check.main(["--cpu", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    for name, _ in gpu_check.SECTIONS:
        assert "error" not in result[name], result[name].get("error")
    for dtype in ("bfloat16", "float16"):
        errs = result["kernels"][dtype]["max_abs_err"]
        assert set(errs) == {"out", "lse", "dq", "dk", "dv"} and max(errs.values()) < 0.1, errs
    ring = result["ring"]
    assert len(ring["cases"]) == 2 * len(gpu_check.RING_CASES)
    assert {(c["hp"], c["cp"]) for c in ring["cases"]} >= {(1, 2), (1, 4), (1, 8), (4, 2)}
    assert ring["worst_ratio"] < 4, ring["worst_ratio"]  # the sharding adds (almost) nothing to rounding
    docs = result["documents"]
    assert {(c["window"], c["cp"]) for c in docs["cases"]} == {(w, cp) for w in (None, 32) for cp in (2, 4, 8)}
    assert docs["worst_ratio"] < 4, docs["worst_ratio"]
    assert 0 < docs["timing_window_None"]["visible_fraction"] < 0.5
    assert [p["S"] for p in result["throughput"]["points"]] == list(gpu_check.SIZES["cpu"]["tput_seqs"])
    assert all(p["tflops"] > 0 for p in result["throughput"]["points"])
    run = result["training"]["runs"][0]
    assert run["model"] == "tiny" and run["tokens_per_s"] > 0 and run["mfu"] > 0
    assert run["predicted_gib"]["total"] > 0
    assert result["determinism"]["deterministic"]["bitwise_equal"]
    choice = result["kernel_choice"]
    assert choice["chosen"] in choice["candidates"] and choice["fastest_documents"] in choice["candidates"]
    assert all(t["dense_forward_s"] > 0 and t["documents_backward_s"] > 0 for t in choice["candidates"].values())
    assert result["loss"]["ratio"] > 0
    compiled = result["compile"]
    assert compiled["max_loss_diff"] < 1e-4 and 1 <= compiled["graphs"] <= 2, compiled  # shared by the blocks
    assert compiled["eager_mfu"] > 0 and compiled["compiled_tokens_per_s"] > 0
    assert [r["seq_len"] for r in result["training"]["runs"]] == [1024, 512]  # the longest, and the mid length
    offload = result["offload"]["modes"]
    assert set(offload) == set(gpu_check.SIZES["cpu"]["offload"][3])
    assert all(r["ratio"] > 0 and r["tokens_per_s"] > 0 for r in offload.values())
    moved = offload["offload activations + mlp tiles auto"]
    assert moved["offloaded_mib_per_step"] > 0 and moved["device_activations_mib"] < moved["baseline_activations_mib"]


def test_sharded_attention_matches_the_unsharded_kernel_exactly_in_fp64(gpu_check):
    """The head-split x ring emulation itself (fp64 on CPU: the same math as one kernel call)."""
    from loongtrain.attn.kernels import REFERENCE

    gen = torch.Generator().manual_seed(0)
    q, dout = (gpu_check._bshd(1, 64, 4, 8, torch.float64, torch.device("cpu"), gen) for _ in range(2))
    k, v = (gpu_check._bshd(1, 64, 2, 8, torch.float64, torch.device("cpu"), gen) for _ in range(2))
    want = gpu_check.run_kernel(REFERENCE, q, k, v, dout, 0.3)
    for hp, cp, window in gpu_check.RING_CASES:
        got = gpu_check.sharded_attention(q, k, v, dout, hp, cp, window, 0.3)
        for name in ("out", "dq", "dk", "dv"):
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-10, msg=f"{hp}x{cp}w{window} {name}")


def test_a_wrong_head_split_is_caught(gpu_check, monkeypatch):
    """Planted fault: KV heads assigned to the wrong head rank; the comparison must fail."""
    from loongtrain.attn.kernels import REFERENCE

    gen = torch.Generator().manual_seed(1)
    q, dout = (gpu_check._bshd(1, 32, 4, 8, torch.float64, torch.device("cpu"), gen) for _ in range(2))
    k, v = (gpu_check._bshd(1, 32, 2, 8, torch.float64, torch.device("cpu"), gen) for _ in range(2))
    want = gpu_check.run_kernel(REFERENCE, q, k, v, dout, 0.3)
    right = gpu_check._head_slice
    monkeypatch.setattr(gpu_check, "_head_slice", lambda h, hkv, hp, j: (right(h, hkv, hp, j)[0], slice(0, 1)))
    got = gpu_check.sharded_attention(q, k, v, dout, 4, 2, 1, 0.3)
    assert (got["out"] - want["out"]).abs().max() > 1e-3
