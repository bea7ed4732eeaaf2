"""gpu_check's rate sections (``python -m benchmarks.gpu_check``): what ``loongtrain plan --calibrate-from`` reads.

- ``attention``: every kernel candidate's forward and backward time, apart, on one causal call at each of
  ``attn_seqs`` (16K, 64K, 128K on the GPU; H=32, Hkv=8, D=128, bf16), dense and on packed documents
  (lognormal, median S/16: the varlen op where the kernel has one, else a dense call per piece through the
  in-process ring's one-member path), FLOP/s with the causal convention of the planner (forward ``2 S^2 H D``,
  backward 2.5x); and the ring's own kernel (``choose_kernel``) at more call sizes and the head dims of the
  presets (``chosen``: rows ``{kernel, D, H, Hkv, S, forward_s, backward_s, tflops}``, the planner's
  ``attention_rates``). Only the candidates a run may run (the known-bad table, the probe's verdicts:
  ``benchmarks/gpu_check/safety.py``), each in the form it may run; candidates that fail are recorded with their
  error.
- ``matmul``: bf16 GEMMs of the 1b and 7b-gqa shapes (the projections and the MLP, forward and the two
  backward products) at ``mm_tokens`` tokens: seconds and TFLOP/s each.
- ``memory_bandwidth``: GB/s of the streaming ops the memory-bound parts of a step are made of (a bf16 copy, an
  fp32 add, a bf16 -> fp32 cast, an in-place fp32 multiply) over a buffer far larger than the cache: bytes
  read + written over the median time; ``gbyte_s`` is their median.
"""

from __future__ import annotations

import statistics
import time
from functools import partial
from typing import Any

import torch

from benchmarks.gpu_check.safety import refusal_rows, safe_kernels
from loongtrain.attn.kernel_choice import choose_kernel
from loongtrain.attn.kernel_timing import median_seconds
from loongtrain.attn.masking import AttnMask
from loongtrain.attn.ring import RingCall, local_ring_backward, local_ring_forward
from loongtrain.model.config import get_preset
from loongtrain.plan.document_work import lognormal_documents

Tensor = torch.Tensor

SIZES: dict[str, dict[str, Any]] = {
    "gpu": {"attn_seqs": (16384, 65536, 131072), "attn_heads": (32, 8, 128), "dtype": torch.bfloat16,
            # the ring's kernel at the call sizes of ring steps, for the head dims of the presets (1b: 64)
            "chosen": ((128, 32, 8, (2048, 4096, 8192, 16384, 32768, 65536, 131072)),
                       (64, 32, 4, (4096, 16384, 65536, 131072))),
            "mm_tokens": 16384, "mm_models": ("1b", "7b-gqa"), "bandwidth_mib": 2048},
    "cpu": {"attn_seqs": (256, 512), "attn_heads": (4, 2, 32), "dtype": torch.float32,
            "chosen": ((32, 4, 2, (128, 256, 512)),), "mm_tokens": 256, "mm_models": ("tiny",), "bandwidth_mib": 16},
}


def probe_shapes(kind: str) -> list[tuple]:
    size = SIZES[kind]
    h, hkv, d = size["attn_heads"]
    shapes = [(size["dtype"], d, h, hkv, s) for s in size["attn_seqs"]]
    return shapes + [(size["dtype"], d_, h_, hkv_, s) for d_, h_, hkv_, seqs in size["chosen"] for s in seqs]


def _qkv(s: int, h: int, hkv: int, d: int, dtype: torch.dtype, device: torch.device) -> tuple[Tensor, ...]:
    """q, k, v, dout as ``[B, H, S, D]`` views of ``[B, S, H, D]`` storage (the model's layout)."""
    gen = torch.Generator().manual_seed(s)
    return tuple(torch.randn(1, s, heads, d, generator=gen).to(device=device, dtype=dtype).transpose(1, 2)
                 for heads in (h, hkv, hkv, h))


def attention_flops(s: int, h: int, d: int) -> tuple[float, float]:
    """(forward, backward) FLOPs of one causal call, the planner's convention."""
    forward = 2.0 * s * s * h * d
    return forward, 2.5 * forward


def time_dense(kernel, q: Tensor, k: Tensor, v: Tensor, dout: Tensor, device: torch.device,
               repeats: int) -> dict[str, float]:
    scale = q.shape[-1] ** -0.5
    out, lse = kernel.forward(q, k, v, True, scale)
    return {"forward_s": median_seconds(lambda: kernel.forward(q, k, v, True, scale), device, repeats),
            "backward_s": median_seconds(lambda: kernel.backward(dout, q, k, v, out, lse, True, scale), device,
                                         repeats)}


def time_documents(kernel, q: Tensor, k: Tensor, v: Tensor, dout: Tensor, device: torch.device,
                   repeats: int) -> dict[str, Any]:
    """Packed documents through the one-member ring path (varlen calls where the kernel has the op)."""
    s = q.shape[2]
    docs = tuple(lognormal_documents(s, max(1, s // 16)))
    mask = AttnMask(True, None, (docs,))
    scale = q.shape[-1] ** -0.5
    qs, ks, vs, ds = ([t] for t in (q, k, v, dout))
    call = RingCall(mask, scale, kernel)
    fwd = local_ring_forward(qs, ks, vs, 1, call)
    outs, lses = [fwd[0][0]], [fwd[0][1]]
    return {"varlen": kernel.varlen_forward is not None, "documents": len(docs) - 1,
            "forward_s": median_seconds(lambda: local_ring_forward(qs, ks, vs, 1, call), device, repeats),
            "backward_s": median_seconds(lambda: local_ring_backward(ds, qs, ks, vs, outs, lses, 1, call), device,
                                         repeats)}


def _time_chosen(kernel, s: int, h: int, hkv: int, d: int, dtype: torch.dtype, device: torch.device) -> dict:
    return time_dense(kernel, *_qkv(s, h, hkv, d, dtype, device), device, 2)


def check_attention(ctx) -> dict[str, Any]:
    device, size = ctx.device, SIZES[ctx.kind]
    dtype = size["dtype"]
    h, hkv, d = size["attn_heads"]
    out: dict[str, Any] = {"dtype": str(dtype), "H": h, "Hkv": hkv, "D": d, "candidates": {}, "chosen": []}
    last = 0.0  # seconds the previous measurement took (lengths ascend: a lower bound of the next one's)
    for s in size["attn_seqs"]:
        repeats = 3 if s < 100_000 else 2
        inputs = _qkv(s, h, hkv, d, dtype, device)
        fwd, bwd = attention_flops(s, h, d)
        kernels, refused = safe_kernels(device, dtype, d, h, hkv, s)  # never one the run itself would refuse
        out.update(refusal_rows(refused))
        for kernel in kernels:
            label = f"{kernel.name} S={s}"
            if not ctx.enough(last, label):
                continue
            start = time.perf_counter()
            row: dict[str, Any] = {"S": s}
            try:
                dense = ctx.attempt(f"{label} dense", partial(time_dense, kernel, *inputs, device, repeats))
                docs = ctx.attempt(f"{label} documents", partial(time_documents, kernel, *inputs, device, repeats))
            except Exception as exc:  # noqa: BLE001 - a candidate that cannot run is reported, not fatal
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                dense = docs = None
            if dense:
                row.update(dense=dense, dense_tflops=(fwd + bwd) / (dense["forward_s"] + dense["backward_s"]) / 1e12)
            if docs:
                row["documents"] = docs
            out["candidates"].setdefault(kernel.name, []).append(row)
            last = time.perf_counter() - start
        del inputs
    for d_, h_, hkv_, seqs in size["chosen"]:
        last = 0.0
        for s in seqs:  # ascending: the previous call size's time is a lower bound of this one's
            if not ctx.enough(last, f"chosen D={d_} S={s}"):
                continue
            start = time.perf_counter()
            kernel = choose_kernel(device, dtype, d_, h_, hkv_, s)
            times = ctx.attempt(f"chosen D={d_} S={s}", partial(_time_chosen, kernel, s, h_, hkv_, d_, dtype, device))
            if times:
                fwd, bwd = attention_flops(s, h_, d_)
                out["chosen"].append({"kernel": kernel.name, "D": d_, "H": h_, "Hkv": hkv_, "S": s, **times,
                                      "tflops": (fwd + bwd) / (times["forward_s"] + times["backward_s"]) / 1e12})
            last = time.perf_counter() - start
    return out


def _gemm_shapes(name: str, tokens: int) -> dict[str, tuple[int, int, int]]:
    """``(M, K, N)`` of a block's GEMMs at ``tokens`` tokens: forward, and the two backward products."""
    m = get_preset(name)
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    shapes = {}
    for proj, (k_in, n_out) in {"wq": (m.dim, q), "wkv": (m.dim, kv), "wo": (q, m.dim), "w1": (m.dim, m.ffn_dim),
                                "w2": (m.ffn_dim, m.dim)}.items():
        shapes[f"{name}.{proj}"] = (tokens, k_in, n_out)  # forward: [t, in] x [in, out]
        shapes[f"{name}.{proj}.dgrad"] = (tokens, n_out, k_in)  # input gradient: [t, out] x [out, in]
        shapes[f"{name}.{proj}.wgrad"] = (n_out, tokens, k_in)  # weight gradient: [out, t] x [t, in]
    return shapes


def check_matmul(ctx) -> dict[str, Any]:
    device, size = ctx.device, SIZES[ctx.kind]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out: dict[str, Any] = {"dtype": str(dtype), "tokens": size["mm_tokens"], "points": []}
    for name in size["mm_models"]:
        for label, (m, k, n) in _gemm_shapes(name, size["mm_tokens"]).items():
            if not ctx.enough(0.0, label):
                continue

            def one(m=m, k=k, n=n) -> float:
                a, b = (torch.randn(x, y, device=device, dtype=dtype) for x, y in ((m, k), (k, n)))
                return median_seconds(lambda: a @ b, device, 5)

            seconds = ctx.attempt(label, one)
            if seconds:
                out["points"].append({"shape": label, "M": m, "K": k, "N": n, "seconds": seconds,
                                      "tflops": 2 * m * k * n / seconds / 1e12})
    return out


def check_memory_bandwidth(ctx) -> dict[str, Any]:
    device, size = ctx.device, SIZES[ctx.kind]
    n = size["bandwidth_mib"] * 2**20 // 4  # fp32 elements
    x = torch.randn(n, device=device)
    y = torch.empty_like(x)
    h = x.to(torch.bfloat16)
    hb = torch.empty_like(h)
    ops = {"copy bf16": (lambda: hb.copy_(h), 4 * n), "add fp32": (lambda: torch.add(x, x, out=y), 12 * n),
           "cast bf16->fp32": (lambda: y.copy_(h), 6 * n), "scale fp32 in place": (lambda: y.mul_(1.0001), 8 * n)}
    points = {}
    for name, (fn, nbytes) in ops.items():
        seconds = median_seconds(fn, device, 5)
        points[name] = {"bytes": nbytes, "seconds": seconds, "gbyte_s": nbytes / seconds / 1e9}
    return {"mib": size["bandwidth_mib"], "points": points,
            "gbyte_s": statistics.median(p["gbyte_s"] for p in points.values())}
