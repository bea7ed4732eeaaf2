"""gpu_check's exactness sections (``python -m benchmarks.gpu_check``): kernels, the ring, documents, determinism.

- ``kernels``: every candidate kernel's forward (out, lse) and gradients in bf16 and fp16 against fp64
  autograd through the reference kernel (max abs error per tensor), and the kernel the ring chooses
  (``loongtrain.attn.kernel_choice.choose_kernel``: measured when several qualify).
- ``ring``: the in-process ring (``loongtrain.attn.ring.local_ring_forward/backward``: every member in
  this process, the distributed executor's schedule, transfers as hand-offs) on zigzag shards for
  ``cp`` = 2, 4, 8 (double-ring inner rings included) and head splits emulated by slicing heads per head
  rank (GQA, ``hp`` > ``num_kv_heads`` replicating KV heads, their gradients summed back). Per tensor:
  the error against fp64 divided by the unsharded kernel's own error (``ratio``; 1 = the sharding adds
  nothing), and the difference to the unsharded kernel.
- ``documents``: packed documents (and documents with a sliding window) through the in-process ring for
  cp = 2, 4, 8 (on CUDA the flash kernel packs a step's pieces into varlen calls), error ratios as in
  ``ring``, and the masked call's time against full causal at the same S beside the visible fraction.
- ``determinism``: the attention backward run twice on the same inputs, bitwise equal or not, without
  and with ``torch.use_deterministic_algorithms(True)``, and the deterministic slowdown.

Each takes a :class:`benchmarks.gpu_check.run.Context` and checks its deadline between cases.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.gpu_check.safety import refusal_rows, safe_kernels
from loongtrain.attn.kernel_choice import choose_kernel
from loongtrain.attn.kernel_timing import median_seconds
from loongtrain.attn.kernels import REFERENCE, Kernel
from loongtrain.attn.masking import AttnMask, dense_mask
from loongtrain.attn.ring import RingCall, local_ring_backward, local_ring_forward
from loongtrain.parallel.documents import visible_pairs
from loongtrain.parallel.zigzag import shard_indices
from loongtrain.plan.document_work import lognormal_documents

Tensor = torch.Tensor

SIZES: dict[str, dict[str, Any]] = {
    "gpu": {"exact": (1, 4096, 8, 2, 128), "ring_seq": 8192, "ring_heads": (8, 2, 128), "det_seq": 8192},
    "cpu": {"exact": (1, 256, 4, 2, 32), "ring_seq": 256, "ring_heads": (4, 2, 32), "det_seq": 256},
}
RING_CASES = ((1, 2, 1), (1, 4, 1), (1, 4, 2), (1, 8, 1), (1, 8, 4), (2, 4, 2), (4, 2, 1))  # (hp, cp, inner_ring)


def probe_shapes(kind: str) -> list[tuple]:
    size = SIZES[kind]
    _, s, h, hkv, d = size["exact"]
    rh, rhkv, rd = size["ring_heads"]
    dtypes = (torch.bfloat16, torch.float16)
    return ([(dt, d, h, hkv, s) for dt in dtypes] + [(dt, rd, rh, rhkv, size["ring_seq"]) for dt in dtypes]
            + [(torch.bfloat16, 128 if kind == "gpu" else 32, 8, 2, size["det_seq"])])


def _randn(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32, device="cpu").to(device=device, dtype=dtype)


def _bshd(b: int, s: int, h: int, d: int, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> Tensor:
    """A ``[B, H, S, D]`` transposed view of a ``[B, S, H, D]`` tensor (the model's layout)."""
    return _randn((b, s, h, d), dtype, device, gen).transpose(1, 2)


def _max_err(got: Tensor, ref: Tensor) -> float:
    return float((got.double() - ref.double()).abs().max())


def reference64(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, scale: float,
                mask: AttnMask | None = None) -> dict[str, Tensor]:
    """out, lse, dq, dk, dv of causal attention (or under ``mask``: documents, sliding window) in fp64 (autograd
    through the reference kernel)."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    if mask is None:
        out, lse = REFERENCE.forward(q64, k64, v64, True, scale)
    else:
        out, lse = REFERENCE.forward(q64, k64, v64, False, scale, dense_mask(q.shape[2], mask).to(q.device))
    dq, dk, dv = torch.autograd.grad(out, (q64, k64, v64), dout.double())
    return {"out": out.detach(), "lse": lse.detach(), "dq": dq, "dk": dk, "dv": dv}


def run_kernel(kernel: Kernel, q: Tensor, k: Tensor, v: Tensor, dout: Tensor, scale: float) -> dict[str, Tensor]:
    out, lse = kernel.forward(q, k, v, True, scale)
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, True, scale)
    return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


def check_kernels(ctx) -> dict[str, Any]:
    device, size = ctx.device, SIZES[ctx.kind]
    b, s, h, hkv, d = size["exact"]
    out: dict[str, Any] = {"shape": {"B": b, "S": s, "H": h, "Hkv": hkv, "D": d}}
    for dtype in (torch.bfloat16, torch.float16):
        gen = torch.Generator().manual_seed(0)
        q, dout = (_bshd(b, s, h, d, dtype, device, gen) for _ in range(2))
        k, v = (_bshd(b, s, hkv, d, dtype, device, gen) for _ in range(2))
        kernel = choose_kernel(device, dtype, d, h, hkv, s)
        ref = reference64(q, k, v, dout, d ** -0.5)
        errs: dict[str, Any] = {}
        candidates, refused = safe_kernels(device, dtype, d, h, hkv, s)  # never one the run itself would refuse
        out.update(refusal_rows(refused))
        for cand in candidates + ([kernel] if kernel.name not in {c.name for c in candidates} else []):
            try:
                got = run_kernel(cand, q, k, v, dout, d ** -0.5)
                errs[cand.name] = {name: _max_err(got[name], ref[name]) for name in ref}
            except Exception as exc:  # noqa: BLE001 - report a candidate that cannot run, keep going
                errs[cand.name] = f"error: {type(exc).__name__}: {exc}"[:300]
        out[str(dtype).replace("torch.", "")] = {"kernel": kernel.name, "max_abs_err": errs[kernel.name],
                                                  "candidates": errs}
    return out


def _zigzag(x: Tensor, cp: int, rank: int) -> Tensor:
    """Member ``rank``'s ``[B, H, S_c, D]`` shard (a view) of a ``[B, H, S, D]`` tensor."""
    return x.transpose(1, 2)[:, shard_indices(x.shape[2], 1, cp, rank, 0).to(x.device)].transpose(1, 2)


def _head_slice(num_heads: int, num_kv_heads: int, hp: int, j: int) -> tuple[slice, slice]:
    """Query and KV heads of head rank ``j`` (docs/attention.md#the-gqa-rule: KV heads split, or replicated)."""
    hq = num_heads // hp
    if num_kv_heads >= hp:
        hk = num_kv_heads // hp
        return slice(j * hq, (j + 1) * hq), slice(j * hk, (j + 1) * hk)
    kv = j // (hp // num_kv_heads)
    return slice(j * hq, (j + 1) * hq), slice(kv, kv + 1)


def sharded_attention(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, hp: int, cp: int, inner_ring: int,
                      scale: float, kernel: Kernel | None = None, mask: AttnMask | None = None) -> dict[str, Tensor]:
    """out, dq, dk, dv of causal attention (or under ``mask``) over ``hp`` head ranks x a ``cp`` ring, all
    in this process."""
    seq = q.shape[2]
    acc = torch.float64 if k.dtype == torch.float64 else torch.float32  # dK/dV sum over head ranks
    res = {"out": torch.empty_like(q), "dq": torch.empty_like(q),
           "dk": torch.zeros(k.shape, dtype=acc, device=k.device),
           "dv": torch.zeros(v.shape, dtype=acc, device=v.device)}
    call = RingCall(mask or AttnMask(True), scale, kernel)
    for j in range(hp):
        hq, hk = _head_slice(q.shape[1], k.shape[1], hp, j)
        qs, ks, vs, douts = ([_zigzag(t[:, heads], cp, r) for r in range(cp)]
                             for t, heads in ((q, hq), (k, hk), (v, hk), (dout, hq)))
        fwd = local_ring_forward(qs, ks, vs, inner_ring, call)
        outs, lses = [o for o, _ in fwd], [lse for _, lse in fwd]
        bwd = local_ring_backward(douts, qs, ks, vs, outs, lses, inner_ring, call)
        for r in range(cp):
            idx = shard_indices(seq, 1, cp, r, 0).to(q.device)
            res["out"][:, hq, idx] = outs[r]
            res["dq"][:, hq, idx] = bwd[r][0]
            res["dk"][:, hk, idx] += bwd[r][1].to(acc)  # replicated KV heads: sum over head ranks
            res["dv"][:, hk, idx] += bwd[r][2].to(acc)
    res["dk"], res["dv"] = res["dk"].to(k.dtype), res["dv"].to(v.dtype)
    return res


def check_ring(ctx) -> dict[str, Any]:
    device, size = ctx.device, SIZES[ctx.kind]
    h, hkv, d = size["ring_heads"]
    s = size["ring_seq"]
    out: dict[str, Any] = {"shape": {"B": 1, "S": s, "H": h, "Hkv": hkv, "D": d}, "cases": []}
    worst = 0.0
    for dtype in (torch.bfloat16, torch.float16):
        gen = torch.Generator().manual_seed(1)
        q, dout = (_bshd(1, s, h, d, dtype, device, gen) for _ in range(2))
        k, v = (_bshd(1, s, hkv, d, dtype, device, gen) for _ in range(2))
        ref = reference64(q, k, v, dout, d ** -0.5)
        kernel = choose_kernel(device, dtype, d, h, hkv, s)
        base = run_kernel(kernel, q, k, v, dout, d ** -0.5)
        base_err = {n: _max_err(base[n], ref[n]) for n in ("out", "dq", "dk", "dv")}
        for hp, cp, inner_ring in RING_CASES:
            if not ctx.enough(0.0, f"ring {dtype} hp={hp} cp={cp} w={inner_ring}"):
                continue
            got = sharded_attention(q, k, v, dout, hp, cp, inner_ring, d ** -0.5, kernel)
            case = {"dtype": str(dtype).replace("torch.", ""), "hp": hp, "cp": cp, "inner_ring": inner_ring,
                    "kernel": kernel.name, "ratio": {}, "vs_kernel": {}}
            for n in base_err:
                err = _max_err(got[n], ref[n])
                case["ratio"][n] = err / base_err[n] if base_err[n] > 0 else float("inf") * (err > 0)
                case["vs_kernel"][n] = _max_err(got[n], base[n])
            worst = max(worst, *case["ratio"].values())
            out["cases"].append(case)
        out[f"kernel_err_{str(dtype).replace('torch.', '')}"] = base_err
    out["worst_ratio"] = worst
    return out


def check_documents(ctx) -> dict[str, Any]:
    """Packed documents (lognormal, median S/16) and documents with a window S/8 through the in-process
    ring (on CUDA the flash kernel packs a step's pieces into varlen calls): error against fp64 over the
    unsharded kernel path's own error (cp=1: the same pieces in one process), and the time of the
    masked call against full causal attention at the same S (it should track the visible fraction)."""
    device, size = ctx.device, SIZES[ctx.kind]
    h, hkv, d = size["ring_heads"]
    s = size["ring_seq"]
    docs = tuple(lognormal_documents(s, max(1, s // 16)))
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(4)
    q, dout = (_bshd(1, s, h, d, dtype, device, gen) for _ in range(2))
    k, v = (_bshd(1, s, hkv, d, dtype, device, gen) for _ in range(2))
    kernel = choose_kernel(device, dtype, d, h, hkv, s)
    out: dict[str, Any] = {"S": s, "H": h, "Hkv": hkv, "D": d, "documents": len(docs) - 1, "kernel": kernel.name,
                           "cases": [], "worst_ratio": 0.0}
    scale = d ** -0.5
    unsharded = functools.partial(sharded_attention, q, k, v, dout, 1, 1, 1, scale, kernel)  # cp=1: one process
    causal_s = median_seconds(unsharded, device, 3)
    for window in (None, s // 8):
        mask = AttnMask(True, window, (docs,))
        ref = reference64(q, k, v, dout, scale, mask)
        base = unsharded(mask=mask)
        base_err = {n: _max_err(base[n], ref[n]) for n in base}
        for cp in (2, 4, 8):
            if not ctx.enough(0.0, f"documents window={window} cp={cp}"):
                continue
            got = sharded_attention(q, k, v, dout, 1, cp, 1, scale, kernel, mask)
            ratio = {n: _max_err(got[n], ref[n]) / base_err[n] if base_err[n] > 0 else 1.0 for n in got}
            out["cases"].append({"window": window, "cp": cp, "ratio": ratio, "kernel_err": base_err})
            out["worst_ratio"] = max(out["worst_ratio"], *ratio.values())
        visible = visible_pairs(list(docs), s, sliding_window=window) / visible_pairs(None, s)
        masked_s = median_seconds(functools.partial(unsharded, mask=mask), device, 3)
        out[f"timing_window_{window}"] = {"visible_fraction": visible, "masked_s": masked_s, "causal_s": causal_s,
                                          "speedup": causal_s / masked_s, "ideal_speedup": 1 / visible}
    return out


def _fwd_bwd(kernel: Kernel, q: Tensor, k: Tensor, v: Tensor, dout: Tensor) -> Callable[[], Any]:
    scale = q.shape[-1] ** -0.5

    def fn() -> Any:
        out, lse = kernel.forward(q, k, v, True, scale)
        return kernel.backward(dout, q, k, v, out, lse, True, scale)

    return fn


def check_determinism(ctx) -> dict[str, Any]:
    device, size = ctx.device, SIZES[ctx.kind]
    s, d = size["det_seq"], (128 if device.type == "cuda" else 32)
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(3)
    q, dout = (_bshd(1, s, 8, d, dtype, device, gen) for _ in range(2))
    k, v = (_bshd(1, s, 2, d, dtype, device, gen) for _ in range(2))
    out: dict[str, Any] = {"S": s}
    before = torch.are_deterministic_algorithms_enabled()
    try:
        for flag in (False, True):
            key = "deterministic" if flag else "default"
            try:
                torch.use_deterministic_algorithms(flag)
                kernel = choose_kernel(device, dtype, d, 8, 2, s)  # deterministic mode: the rule's kernel
                fn = _fwd_bwd(kernel, q, k, v, dout)
                runs = [fn() for _ in range(3)]
                equal = all(torch.equal(a, b) for r in runs[1:] for a, b in zip(runs[0], r))
                out[key] = {"kernel": kernel.name, "bitwise_equal": equal, "seconds": median_seconds(fn, device, 3)}
            except Exception as exc:  # noqa: BLE001 - e.g. an op without a deterministic version
                out[key] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
    finally:
        torch.use_deterministic_algorithms(before)
    if "seconds" in out["default"] and "seconds" in out["deterministic"]:
        out["slowdown"] = out["deterministic"]["seconds"] / out["default"]["seconds"]
    return out
