"""Timing the attention kernels for their choice (:mod:`loongtrain.attn.kernel_choice`, docs/attention.md#kernels): a
dense causal call, and packed documents as the varlen calls take them, each forward + backward, with the check
that keeps a varlen op whose results differ from the reference kernel's from being chosen."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from loongtrain.attn.kernels import REFERENCE, Kernel, Seqlens, VarlenMask

Tensor = torch.Tensor

CHECK_SEQ_CAP = 8192  # tokens of the varlen op's check against the reference (keeps its score matrices small)
MEASURE_DOCUMENTS = 8  # equal causal documents the varlen calls are timed on
VARLEN_TOLERANCE = 0.05  # a varlen op's first run vs the reference: max error / max magnitude, half dtypes


def median_seconds(fn: Callable[[], object], device: torch.device, repeats: int = 3) -> float:
    """Median wall seconds of ``fn()`` over ``repeats`` calls after one warm-up call, synchronising
    ``device`` (when CUDA) around each timed call."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_kernel(kernel: Kernel, q: Tensor, k: Tensor, v: Tensor, repeats: int = 3) -> float:
    """:func:`median_seconds` of one causal forward + backward of ``kernel`` on ``q [B, H, S, D]``,
    ``k``/``v`` ``[B, Hkv, S, D]``."""
    scale = q.shape[-1] ** -0.5
    dout = torch.randn_like(q)

    def once() -> None:
        out, lse = kernel.forward(q, k, v, True, scale)
        kernel.backward(dout, q, k, v, out, lse, True, scale)

    return median_seconds(once, q.device, repeats)


def _documents(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, documents: int
               ) -> tuple[list[tuple[Tensor, ...]], Tensor, int]:
    """``q``/``dout`` ``[T, H, D]``, ``k``/``v`` ``[T, Hkv, D]`` cut into equal documents: the per-document
    ``[1, H, L, D]`` views a dense call takes, ``cu_seqlens`` (int32) and the document length."""
    length = q.shape[0] // documents
    pieces = [tuple(t[i * length:(i + 1) * length].unsqueeze(0).transpose(1, 2) for t in (q, k, v, dout))
              for i in range(documents)]
    cu = torch.arange(0, documents * length + 1, length, dtype=torch.int32, device=q.device)
    return pieces, cu, length


def run_varlen(kernel: Kernel, q: Tensor, k: Tensor, v: Tensor, dout: Tensor, documents: int
               ) -> tuple[Tensor, ...]:
    """Causal attention of packed equal documents (``q``/``dout`` ``[T, H, D]``, ``k``/``v`` ``[T, Hkv, D]``),
    forward + backward: ``(out, lse [H, T], dq, dk, dv)`` through ``kernel``'s varlen op, or one dense call per
    document when it has none."""
    scale = q.shape[-1] ** -0.5
    pieces, cu, length = _documents(q, k, v, dout, documents)
    if kernel.varlen_forward is not None and kernel.varlen_backward is not None:
        seqlens, mask = Seqlens(cu, cu, length, length), VarlenMask(True, scale)
        out, lse = kernel.varlen_forward(q, k, v, seqlens, mask)
        grads = kernel.varlen_backward(dout, q, k, v, out, _contiguous(lse), seqlens, mask)
        return (out, lse, *grads)
    results = []
    for pq, pk, pv, pd in pieces:
        out, lse = kernel.forward(pq, pk, pv, True, scale)
        results.append((out, lse, *kernel.backward(pd, pq, pk, pv, out, lse, True, scale)))

    def packed(i: int) -> Tensor:  # [1, H, L, D] per document -> [T, H, D]; lse [1, H, L] -> [H, T]
        parts = [r[i] for r in results]
        return torch.cat([p[0] for p in parts], dim=-1) if i == 1 else torch.cat([p[0].transpose(0, 1) for p in parts])

    return tuple(packed(i) for i in range(5))


def _contiguous(x: Tensor) -> Tensor:
    return x if x.is_contiguous() else x.clone(memory_format=torch.contiguous_format)


def varlen_error(kernel: Kernel, q: Tensor, k: Tensor, v: Tensor, documents: int) -> float:
    """The largest of ``kernel``'s varlen errors against the reference kernel (fp32 math, autocast off) on the
    same packed documents, over out, lse, dq, dk and dv, each as max error / max magnitude: what keeps a varlen
    op whose layout differs from the wrapper's on this build from being chosen (the real ops are not run in
    tests)."""
    dout = torch.randn(q.shape, generator=torch.Generator(q.device).manual_seed(1), device=q.device).to(q.dtype)
    with torch.autocast(q.device.type, enabled=False):
        got = run_varlen(kernel, q, k, v, dout, documents)
        want = run_varlen(REFERENCE, *(t.float() for t in (q, k, v, dout)), documents)
    return max(float((g.float() - w).abs().max() / w.abs().max().clamp(min=1e-6)) for g, w in zip(got, want))


def make_timer(device: torch.device, dtype: torch.dtype, head_dim: int, num_heads: int, num_kv_heads: int,
           seq_len: int) -> Callable[[Kernel, str], float]:
    """Times each option on random inputs shaped like the call's (one batch row, the run's block length
    ``seq_len``): a dense causal call, or the block packed as :data:`MEASURE_DOCUMENTS` documents (``kind ==
    "varlen"``; a varlen op that fails :func:`varlen_error` on the first :data:`CHECK_SEQ_CAP` tokens counts as
    raising)."""
    seq = seq_len
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(heads: int) -> Tensor:  # [S, H, D]
        return torch.randn(seq, heads, head_dim, generator=gen, device=device, dtype=torch.float32).to(dtype)

    packed = (rand(num_heads), rand(num_kv_heads), rand(num_kv_heads))
    dout = rand(num_heads)
    dense = tuple(t.unsqueeze(0).transpose(1, 2) for t in packed)  # [1, H, S, D] views, as the ring passes them
    documents = max(1, min(MEASURE_DOCUMENTS, seq))

    def measure(kernel: Kernel, kind: str) -> float:
        if kind == "dense":
            return time_kernel(kernel, *dense)
        if kernel.varlen_forward is not None:
            check = min(seq, CHECK_SEQ_CAP) // documents * documents or seq
            error = varlen_error(kernel, *(t[:check] for t in packed), documents)
            if not error <= VARLEN_TOLERANCE:
                raise RuntimeError(f"varlen results differ from the reference by {error:.3g} (relative)")
        return median_seconds(lambda: run_varlen(kernel, *packed, dout, documents), device)

    return measure
