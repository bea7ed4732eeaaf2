"""gpu_check's speed sections (``python -m benchmarks.gpu_check``):

- ``kernel_choice``: every candidate kernel's forward and backward time, separately, on a dense causal call
  and on packed documents (the documents path: flash packs a step's pieces into varlen calls, a kernel
  without varlen ops runs one dense call per piece), the kernel ``choose_kernel`` picks, and the fastest
  candidate of each kind (the choice should be the fastest where it is >= 10% faster than the rule's); a mixed
  choice (``cuda_cudnn+cuda_flash``: one kernel's dense calls, another's varlen op) is timed as it runs, so it
  scores a number.
- ``loss``: the fused chunked cross-entropy against the unchunked loss, forward + backward, side by side
  (``benchmarks/loss_speed.py``), at V=128K, 16K tokens, d=4096 on the GPU (target: ratio <= 1.2).
- ``compile``: ``Trainer`` eager against ``--compile on`` (inductor) on the same packed-document batches,
  per round an eager step right before a compiled one (``benchmarks/compile.py``): tokens/s, MFU, the ratio,
  the compilation's warm-up time, dynamo's graph count, and the largest loss difference.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

from benchmarks.gpu_check.safety import refusal_rows, safe_kernels
from loongtrain.attn.kernel_choice import choose_kernel, chosen_kernels
from loongtrain.attn.kernel_timing import median_seconds
from loongtrain.attn.kernels import Kernel
from loongtrain.attn.masking import AttnMask
from loongtrain.attn.ring import RingCall, local_ring_backward, local_ring_forward
from loongtrain.plan.document_work import lognormal_documents

Tensor = torch.Tensor

SIZES: dict[str, dict[str, Any]] = {
    "gpu": {"choice": (1, 16384, 32, 8, 128), "loss": (131072, 16384, 4096), "loss_chunk": None,
            "loss_rounds": (3, 2), "compile": ("1b", 16384, 3, 2, "auto")},
    "cpu": {"choice": (1, 256, 4, 2, 32), "loss": (2048, 256, 32), "loss_chunk": 128, "loss_rounds": (1, 1),
            "compile": ("tiny", 128, 1, 1, "fp32")},
}


#: the compile section's whole measurement: compiling the model's block, warm-up and timed steps, eager beside
COMPILE_S = {"gpu": 30.0, "cpu": 8.0}


def probe_shapes(kind: str) -> list[tuple]:
    _, s, h, hkv, d = SIZES[kind]["choice"]
    name, seq = SIZES[kind]["compile"][:2]
    from benchmarks.gpu_check.train import preset

    model = preset(name)
    dtype = torch.bfloat16 if kind == "gpu" else torch.float32
    return [(torch.bfloat16, d, h, hkv, s), (dtype, model.head_dim, model.num_heads, model.num_kv_heads, seq)]


def _inputs(b: int, s: int, h: int, hkv: int, d: int, dtype: torch.dtype, device: torch.device) -> tuple:
    gen = torch.Generator().manual_seed(7)

    def rand(heads: int) -> Tensor:  # [B, S, H, D] storage seen as [B, H, S, D], as the ring passes it
        return torch.randn(b, s, heads, d, generator=gen).to(device=device, dtype=dtype).transpose(1, 2)

    return rand(h), rand(hkv), rand(hkv), rand(h)


def _kernel_times(kernel: Kernel, q: Tensor, k: Tensor, v: Tensor, dout: Tensor, mask: AttnMask,
                  device: torch.device) -> dict[str, float]:
    scale = q.shape[-1] ** -0.5
    out, lse = kernel.forward(q, k, v, True, scale)
    times = {"dense_forward_s": median_seconds(lambda: kernel.forward(q, k, v, True, scale), device),
             "dense_backward_s": median_seconds(lambda: kernel.backward(dout, q, k, v, out, lse, True, scale),
                                                device)}
    (dout_, q_, k_, v_) = ([t] for t in (dout, q, k, v))
    call = RingCall(mask, scale, kernel)
    fwd = local_ring_forward(q_, k_, v_, 1, call)
    outs, lses = [fwd[0][0]], [fwd[0][1]]
    times["documents_forward_s"] = median_seconds(
        lambda: local_ring_forward(q_, k_, v_, 1, call), device)
    times["documents_backward_s"] = median_seconds(
        lambda: local_ring_backward(dout_, q_, k_, v_, outs, lses, 1, call), device)
    times["varlen"] = kernel.varlen_forward is not None
    return times


def check_kernel_choice(ctx) -> dict[str, Any]:
    device, size = ctx.device, SIZES[ctx.kind]
    b, s, h, hkv, d = size["choice"]
    dtype = torch.bfloat16
    q, k, v, dout = _inputs(b, s, h, hkv, d, dtype, device)
    docs = tuple(lognormal_documents(s, max(1, s // 16)))
    mask = AttnMask(True, None, (docs,) * b)
    out: dict[str, Any] = {"S": s, "H": h, "Hkv": hkv, "D": d, "dtype": str(dtype), "documents": len(docs) - 1,
                           "candidates": {}}
    kernels, refused = safe_kernels(device, dtype, d, h, hkv, s)  # never one the run itself would refuse
    out.update(refusal_rows(refused))
    for kernel in kernels:
        if not ctx.enough(0.0, kernel.name):
            continue
        try:
            out["candidates"][kernel.name] = ctx.attempt(
                kernel.name, lambda kernel=kernel: _kernel_times(kernel, q, k, v, dout, mask, device))
        except Exception as exc:  # noqa: BLE001 - a candidate that cannot run is reported, not fatal
            out["candidates"][kernel.name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    chosen = choose_kernel(device, dtype, d, h, hkv, s)
    out["chosen"] = chosen.name
    out["attention_kernels"] = chosen_kernels()
    if chosen.name not in out["candidates"] and ctx.enough(0.0, chosen.name):  # a mixed choice: timed as it runs
        try:
            out["candidates"][chosen.name] = ctx.attempt(
                chosen.name, lambda: _kernel_times(chosen, q, k, v, dout, mask, device))
        except Exception as exc:  # noqa: BLE001
            out["candidates"][chosen.name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    timed = {n: t for n, t in out["candidates"].items() if t and "error" not in t}
    for kind in ("dense", "documents"):
        total = {n: t[f"{kind}_forward_s"] + t[f"{kind}_backward_s"] for n, t in timed.items()}
        if total:
            out[f"fastest_{kind}"] = min(total, key=total.get)
            out[f"chosen_over_fastest_{kind}"] = total.get(out["chosen"], float("nan")) / min(total.values())
    return out


def check_loss(ctx) -> dict[str, Any]:
    from benchmarks.loss_speed import side_by_side

    device, size = ctx.device, SIZES[ctx.kind]

    vocab, tokens, dim = size["loss"]
    dtype = "bf16" if device.type == "cuda" else "fp32"
    rounds, iters = size["loss_rounds"]
    r = side_by_side(vocab, tokens, dim, size["loss_chunk"], dtype, str(device), rounds=rounds, iters=iters)
    return {"V": vocab, "tokens": tokens, "d": dim, "dtype": dtype, "unchunked_s": statistics.median(r["unchunked"]),
            "chunked_s": statistics.median(r["chunked"]), "ratio": statistics.median(r["ratio"]),
            "ratio_range": [min(r["ratio"]), max(r["ratio"])]}


def check_compile(ctx) -> dict[str, Any]:
    from benchmarks.compile import side_by_side
    from loongtrain.model.config import get_preset
    from loongtrain.parallelize import compile as compile_step

    device, size = ctx.device, SIZES[ctx.kind]

    name, seq, steps, warmup, dtype = size["compile"]
    if not ctx.enough(COMPILE_S[ctx.kind], f"{name} S={seq} eager against compiled"):
        return {"skipped": f"out of time: compiling and timing need about {COMPILE_S[ctx.kind]:g} s"}
    backend = compile_step.BACKEND if device.type == "cuda" else "aot_eager"  # CPU: fast, the same graphs
    before, compile_step.BACKEND = compile_step.BACKEND, backend
    try:
        model = get_preset(name)
        r = side_by_side(model, seq, steps, warmup, dtype, "selective", device)
    finally:
        compile_step.BACKEND = before
    peak = _peak_tflops(device)
    eager, compiled = statistics.median(r["eager"]), statistics.median(r["compiled"])
    flops_per_token = statistics.median(r["flops"]) / seq  # visible attention pairs only (documents)
    return {"model": name, "S": seq, "backend": backend, "eager_tokens_per_s": eager,
            "compiled_tokens_per_s": compiled, "eager_mfu": eager * flops_per_token / 1e12 / peak,
            "compiled_mfu": compiled * flops_per_token / 1e12 / peak, "ratio": statistics.median(r["ratio"]),
            "ratio_range": [min(r["ratio"]), max(r["ratio"])], "warmup_s": r.get("warmup_s"),
            "graphs": r["graphs"], "max_loss_diff": r["loss_diff"]}


def _peak_tflops(device: torch.device) -> float:
    """Dense bf16 peak TFLOP/s by CUDA device name; on CPU the measured matmul rate."""
    from loongtrain.train.metrics import cuda_peak_tflops, measure_cpu_tflops

    if device.type == "cuda":
        return cuda_peak_tflops(device) or float("nan")
    return measure_cpu_tflops()

