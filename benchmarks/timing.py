"""Shared timing for the attention benchmarks (``attention.py``, ``documents.py``).

The *limit* a distributed case is compared with is torch's own ``scaled_dot_product_attention`` (its CPU
flash kernel) in a process of its own with every core, measured right before the case: this machine's
speed drifts by up to 1.5x within minutes, so only side-by-side measurements make a ratio. A case's
time is, per iteration, the wall time of its slowest rank (each iteration starts at a barrier); its CPU
time is process CPU time summed over ranks. A run repeats (limit, case) pairs in rounds; tables show the
median over rounds of the per-round medians and the min–max spread.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from loongtrain.parallel.workers import run_local

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64, "fp64": torch.float64}


# ----------------------------------------------------------------------------- inputs and timing


def random_bshd(batch: int, seq_len: int, heads: int, kv_heads: int, head_dim: int, dtype: str,
                seed: int) -> tuple[torch.Tensor, ...]:
    """The full ``q, k, v, dout`` ``[B, S, heads, D]`` (K/V with ``kv_heads``), the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    dt = DTYPES[dtype]
    q = torch.randn(batch, seq_len, heads, head_dim, generator=g).to(dt)
    k = torch.randn(batch, seq_len, kv_heads, head_dim, generator=g).to(dt)
    v = torch.randn(batch, seq_len, kv_heads, head_dim, generator=g).to(dt)
    dout = torch.randn(batch, seq_len, heads, head_dim, generator=g).to(dt)
    return q, k, v, dout


@dataclass
class Timing:
    """Per-iteration seconds: forward+backward wall, forward wall (both max over ranks), CPU (sum over ranks)."""

    total: list[float] = field(default_factory=list)
    forward: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)

    def medians(self) -> tuple[float, float, float]:
        return statistics.median(self.total), statistics.median(self.forward), statistics.median(self.cpu)


def time_step(step: Callable[[], float], iters: int, warmup: int, distributed: bool) -> Timing:
    """Run ``step`` (forward + backward; returns its forward seconds) ``warmup`` times untimed, then
    ``iters`` times timed. ``distributed``: every iteration starts at a barrier and is reduced over ranks."""
    for _ in range(warmup):
        step()
    out = Timing()
    for _ in range(iters):
        if distributed:
            dist.barrier()
        c0, t0 = time.process_time(), time.perf_counter()
        fwd = step()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        if distributed:
            t = torch.tensor([wall, fwd], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            c = torch.tensor([cpu], dtype=torch.float64)
            dist.all_reduce(c, op=dist.ReduceOp.SUM)
            wall, fwd, cpu = t[0].item(), t[1].item(), c.item()
        out.total.append(wall)
        out.forward.append(fwd)
        out.cpu.append(cpu)
    return out


# ----------------------------------------------------------------------------- the SDPA limit


@dataclass(frozen=True)
class LimitSpec:
    """What the limit process computes: attention of ``q [B, S, heads, D]`` with torch SDPA, each document
    of ``cu_seqlens`` alone (``None``: the whole sequence), inside a ``sliding_window`` if given."""

    seq_len: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str = "float32"
    causal: bool = True
    batch: int = 1
    cu_seqlens: tuple[int, ...] | None = None
    sliding_window: int | None = None
    seed: int = 0

    @property
    def label(self) -> str:
        what = "each document alone" if self.cu_seqlens is not None else "whole sequence"
        win = f", window {self.sliding_window} (masked blocks)" if self.sliding_window else ""
        return f"torch SDPA, {what}{win}"


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
          mask: torch.Tensor | None = None) -> torch.Tensor:
    gqa = k.shape[1] != q.shape[1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                          enable_gqa=gqa)


def _window_segments(s: int, e: int, w: int, causal: bool) -> list[tuple[int, int, int, int, torch.Tensor]]:
    """Query blocks of a window inside document ``[s, e)``: ``(q0, q1, k0, k1, mask)``; the blocks are
    ``w`` queries long. The kernel computes up to twice the visible pairs, yet at w=1024 this ran faster
    than blocks of w/4, w/2 or 2w (S=16384, H=8, D=64: 1.9 s against 3.2, 2.2, 2.3 s); it costs about
    what causal SDPA costs per visible pair."""
    block = w
    out = []
    for q0 in range(s, e, block):
        q1 = min(e, q0 + block)
        k0 = max(s, q0 - w + 1)
        k1 = q1 if causal else min(e, q1 + w - 1)
        d = torch.arange(k0, k1)[None, :] - torch.arange(q0, q1)[:, None]  # key - query
        visible = (d > -w) & ((d <= 0) if causal else (d < w))
        out.append((q0, q1, k0, k1, visible))
    return out


def limit_main(rank: int, world: int, spec: LimitSpec, iters: int, warmup: int) -> Timing:
    """Runs alone in its process: SDPA forward + backward of ``spec``, timed."""
    q, k, v, dout = (t.transpose(1, 2).contiguous() for t in random_bshd(
        spec.batch, spec.seq_len, spec.heads, spec.kv_heads, spec.head_dim, spec.dtype, spec.seed))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    bounds = list(spec.cu_seqlens) if spec.cu_seqlens is not None else [0, spec.seq_len]
    w = spec.sliding_window
    pieces = []  # (q0, q1, k0, k1, mask or None)
    for s, e in zip(bounds, bounds[1:]):
        if w is None or w >= e - s:
            pieces.append((s, e, s, e, None))
        else:
            pieces += _window_segments(s, e, w, spec.causal)

    def step() -> float:
        for t in leaves:
            t.grad = None
        t0 = time.perf_counter()
        outs = [_sdpa(q[:, :, a:b], k[:, :, c:d], v[:, :, c:d], spec.causal, m) for a, b, c, d, m in pieces]
        fwd = time.perf_counter() - t0
        torch.autograd.backward(outs, [dout[:, :, a:b] for a, b, *_ in pieces])
        return fwd

    return time_step(step, iters, warmup, distributed=False)


def measure_limit(spec: LimitSpec, iters: int, warmup: int, timeout: float = 3600.0) -> Timing:
    """The limit, in a fresh process of its own with every core."""
    return run_local(limit_main, 1, spec, iters, warmup, threads=os.cpu_count() or 1, timeout=timeout)[0]


# ----------------------------------------------------------------------------- reporting


def ms(x: float) -> str:
    return f"{x * 1e3:.0f}" if x >= 0.1 else f"{x * 1e3:.1f}"


def spread(values: Sequence[float], fmt: Callable[[float], str]) -> str:
    """``min–max`` of several values ('' for one)."""
    return f"{fmt(min(values))}–{fmt(max(values))}" if len(values) > 1 else ""


def ratios(num: Sequence[float], den: Sequence[float]) -> list[float]:
    """Per-round ratios of two series measured side by side."""
    assert len(num) == len(den), (len(num), len(den))
    return [a / b for a, b in zip(num, den)]


def load_average() -> float:
    return os.getloadavg()[0]


def write_section(path: Path, name: str, text: str) -> None:
    """Put ``text`` between ``<!-- name: begin -->`` / ``end`` markers in ``path`` (replacing an earlier
    section of that name, else appending)."""
    begin, end = f"<!-- {name}: begin -->", f"<!-- {name}: end -->"
    block = f"{begin}\n{text}{end}\n"
    old = path.read_text() if path.exists() else ""
    if begin in old and end in old:
        head, rest = old.split(begin, 1)
        new = head + block + rest.split(end, 1)[1].lstrip("\n")
    else:
        new = (old.rstrip("\n") + "\n\n" if old.strip() else "") + block
    path.write_text(new)
