"""gpu_check's sections for what was built since the first device run (``python -m benchmarks.gpu_check``):

- ``moe``: a mixture-of-experts feed-forward (Qwen3-30B-A3B's shape on the GPU: 2048 wide, 128 experts of 768,
  top 8, bf16), forward + backward, the grouped GEMMs (``torch._grouped_mm``, where ``grouped_mm_supported``)
  against the loop over experts: seconds, tokens/s and their largest difference; two experts that no token picks
  get exactly zero gradients on each path; one compiled step (inductor on the GPU) against eager, its compile
  seconds included.
- ``gpt_oss``: gpt-oss's attention (64 query heads, 8 KV heads of 64, sinks, a 128-token window) through
  ``loongtrain.attention`` in one process at 32K and 128K: forward and backward seconds, the kernel chosen, the
  same call without the window beside it (the window's speed-up), and out and dQ of the last rows against fp64.

Each takes a :class:`benchmarks.gpu_check.run.Context` and checks its deadline between measurements.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from loongtrain.attn.kernel_timing import median_seconds
from loongtrain.model.moe import ExpertWeights, MoESpec, expert_width, grouped_mm_supported, moe_forward

Tensor = torch.Tensor

SIZES: dict[str, dict[str, Any]] = {
    "gpu": {"moe": (16384, 2048, 128, 8, 768, torch.bfloat16), "gpt_oss": ((32768, 131072), 64, 8, 64, 128,
                                                                           torch.bfloat16)},
    "cpu": {"moe": (64, 16, 8, 2, 8, torch.float32), "gpt_oss": ((256, 512), 4, 2, 16, 32, torch.float32)},
}
COMPILE_S = {"gpu": 40.0, "cpu": 2.0}  # compiling one MoE forward + backward (inductor on the GPU, aot_eager on CPU)
TAIL = 256  # rows of the gpt-oss rows checked against fp64 (at most half the sequence)


def probe_shapes(kind: str) -> list[tuple]:
    seqs, heads, kv_heads, head_dim, _, dtype = SIZES[kind]["gpt_oss"]
    return [(dtype, head_dim, heads, kv_heads, s) for s in seqs]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------- moe


def moe_weights(spec: MoESpec, dim: int, ffn: int, dtype: torch.dtype, device: torch.device,
                never: int = 2) -> ExpertWeights:
    """Random expert weights (Qwen3-MoE's layout); the router's first ``never`` rows strongly negative, so those
    experts are in no token's top k for positive inputs."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> Tensor:
        return (torch.randn(*shape, generator=g) * shape[-1] ** -0.5).to(device=device, dtype=dtype).requires_grad_()

    router = rand(spec.num_experts, dim)
    with torch.no_grad():
        router[:never] = -100.0
    return ExpertWeights(router, rand(spec.num_experts, 2 * ffn, dim), rand(spec.num_experts, dim, ffn))


def _moe_step(weights: ExpertWeights, spec: MoESpec, x: Tensor, grad: Tensor, grouped: bool, fn=None) -> list[Tensor]:
    for w in weights:
        if w is not None:
            w.grad = None
    xx = x.detach().requires_grad_()
    y = (fn or moe_forward)(xx, weights, spec, grouped=grouped)
    y.backward(grad)
    return [y.detach(), xx.grad, *(w.grad for w in weights if w is not None)]


def check_moe(ctx) -> dict[str, Any]:
    device = ctx.device
    tokens, dim, experts, top_k, ffn, dtype = SIZES[ctx.kind]["moe"]
    spec = MoESpec(experts, top_k, normalize_top_k=True)
    weights = moe_weights(spec, dim, ffn, dtype, device)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, dim, generator=g).abs().to(device=device, dtype=dtype)
    grad = torch.randn(tokens, dim, generator=g).to(device=device, dtype=dtype)
    out: dict[str, Any] = {"tokens": tokens, "dim": dim, "experts": experts, "top_k": top_k, "expert_width": ffn,
                           "dtype": str(dtype), "rows": {}}
    supported = grouped_mm_supported(x, expert_width(weights, spec))
    results = {}
    for grouped in (False, True):
        label = "grouped" if grouped else "looped"
        if grouped and not supported:
            out["rows"][label] = {"skipped": "grouped_mm_supported is false here (CUDA sm90 up to sm120, bf16, "
                                             "widths multiples of 8)"}
            continue
        if not ctx.enough(0.0, label):
            continue
        results[label] = ctx.attempt(label, lambda grouped=grouped: _moe_step(weights, spec, x, grad, grouped))
        if results[label] is None:
            continue
        seconds = median_seconds(lambda grouped=grouped: _moe_step(weights, spec, x, grad, grouped), device, 3)
        empty = [float(t[:2].abs().max()) for t in results[label][3:]]
        out["rows"][label] = {"seconds": seconds, "tokens_per_s": tokens / seconds,
                              "empty_experts_zero_gradients": all(e == 0.0 for e in empty)}
    if len(results) == 2 and all(results.values()):
        out["grouped_max_abs_diff"] = max(float((a.float() - b.float()).abs().max())
                                          for a, b in zip(results["looped"], results["grouped"]))
        out["grouped_over_looped"] = out["rows"]["grouped"]["seconds"] / out["rows"]["looped"]["seconds"]
    out["compiled"] = _compiled_moe(ctx, weights, spec, x, grad, supported, results)
    return out


def _compiled_moe(ctx, weights: ExpertWeights, spec: MoESpec, x: Tensor, grad: Tensor, grouped: bool,
                  eager: dict[str, list[Tensor] | None]) -> dict[str, Any]:
    """One compiled forward + backward (the path the device takes), its compile seconds, against eager."""
    if not ctx.enough(COMPILE_S[ctx.kind], "compiled"):
        return {"skipped": "out of time"}
    backend = "inductor" if ctx.device.type == "cuda" else "aot_eager"
    torch._dynamo.reset()
    compiled = torch.compile(moe_forward, backend=backend)
    t0 = time.perf_counter()
    got = ctx.attempt("compiled", lambda: _moe_step(weights, spec, x, grad, grouped, compiled))
    _sync(ctx.device)
    if got is None:
        return {"skipped": "allocation failure"}
    first = time.perf_counter() - t0
    seconds = median_seconds(lambda: _moe_step(weights, spec, x, grad, grouped, compiled), ctx.device, 3)
    want = eager.get("grouped" if grouped else "looped")
    row = {"backend": backend, "grouped": grouped, "first_step_s": first, "seconds": seconds,
           "empty_experts_zero_gradients": all(float(t[:2].abs().max()) == 0.0 for t in got[3:])}
    if want is not None:
        row["max_abs_diff_to_eager"] = max(float((a.float() - b.float()).abs().max()) for a, b in zip(got, want))
    return row


# ---------------------------------------------------------------- gpt-oss's attention


def _tail(seq: int) -> int:
    return min(TAIL, seq // 2)


def _tail_reference(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, dout: Tensor, window: int) -> list[Tensor]:
    """fp64 out and dq of the last :func:`_tail` rows (``dout`` zero before them), from the last ``tail + window``
    tokens (at most all): softmax over the window's keys and the sink."""
    tail = _tail(q.shape[1])
    span = min(tail + window, q.shape[1])
    q, k, v, dout = (t[:, -span:].double() for t in (q, k, v, dout))
    q.requires_grad_()
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    scores = torch.einsum("bihd,bjhd->bhij", q, k) * q.shape[-1] ** -0.5
    i = torch.arange(span, device=q.device)
    visible = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < window)
    scores = scores.masked_fill(~visible, float("-inf"))
    logits = torch.cat([scores, sinks.double().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)], dim=-1)
    out = torch.einsum("bhij,bjhd->bihd", torch.softmax(logits, dim=-1)[..., :-1], v)
    (dq,) = torch.autograd.grad(out, q, dout)
    return [out[:, -tail:].detach(), dq[:, -tail:]]


def _attention_step(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor, dout: Tensor, window: int | None) -> list[Tensor]:
    from loongtrain.attn.api import attention

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = attention(*leaves, None, sliding_window=window, sinks=sinks)
    (dq,) = torch.autograd.grad(out, leaves[0], dout)
    return [out.detach(), dq]


def check_gpt_oss(ctx) -> dict[str, Any]:
    seqs, heads, kv_heads, head_dim, window, dtype = SIZES[ctx.kind]["gpt_oss"]
    out: dict[str, Any] = {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "window": window,
                           "dtype": str(dtype), "rows": []}
    last = 0.0
    for s in seqs:
        if not ctx.enough(last, f"S={s}"):
            continue
        start = time.perf_counter()
        row = _gpt_oss_row(ctx, s)
        if row is not None:
            out["rows"].append(row)
        ctx.flush()
        last = time.perf_counter() - start
    return out


def _gpt_oss_row(ctx, s: int) -> dict[str, Any] | None:
    """One length's row (module docstring); None when it ran out of memory."""
    from loongtrain.attn.kernel_choice import chosen_kernels

    device = ctx.device
    _, heads, kv_heads, head_dim, window, dtype = SIZES[ctx.kind]["gpt_oss"]
    g = torch.Generator().manual_seed(s)
    q, dout = (torch.randn(1, s, heads, head_dim, generator=g).to(device=device, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(1, s, kv_heads, head_dim, generator=g).to(device=device, dtype=dtype) for _ in range(2))
    sinks = torch.randn(heads, generator=g).to(device=device, dtype=dtype)
    dout[:, :-_tail(s)] = 0
    got = ctx.attempt(f"S={s}", lambda: _attention_step(q, k, v, sinks, dout, window))
    if got is None:
        return None
    want = _tail_reference(q, k, v, sinks, dout, window)
    row: dict[str, Any] = {"S": s, "attention_kernels": chosen_kernels(),
                           "tail_max_abs_err": {n: float((a[:, -_tail(s):].double() - b).abs().max())
                                                for n, a, b in zip(("out", "dq"), got, want)}}
    row["window_s"] = median_seconds(lambda: _attention_step(q, k, v, sinks, dout, window), device, 2)
    if ctx.enough(row["window_s"] * min(s / (2 * window), 20.0), f"S={s} without the window"):
        full = ctx.attempt(f"S={s} full", lambda: median_seconds(
            lambda: _attention_step(q, k, v, sinks, dout, None), device, 1))
        if full:
            row.update(full_causal_s=full, window_speedup=full / row["window_s"])
    return row
