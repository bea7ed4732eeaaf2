"""Packed documents and sliding windows through ``loongtrain.attention`` (forward + backward), CPU gloo ranks.

Documents: one packed row of lognormal lengths (``--median``, shape ``--sigma``, ``--seed``; stated in
the output). For each case the *limit* is measured right before it, in a process of its own with all
cores: torch's own ``scaled_dot_product_attention`` run on each document alone (what the masked ring
should approach), or on the whole sequence for full causal attention. Cases, each on ``--world`` ranks
(1 thread per rank, every ``hp x cp`` of the world unless ``--configs``):

- ``docs``: causal attention inside each document, zigzag layout;
- ``docs-balanced``: the same on :func:`loongtrain.balanced_chunk_order`'s layout;
- ``causal``: full causal attention of the same sequence (the speedup of ``docs`` over it should track
  the visible fraction);
- ``window``: a ``--window`` sliding window without documents (time and ring bytes against ``causal``).

A time is the median over ``--iters`` iterations (after ``--warmup``) of the slowest rank; ring bytes are
rank 0's K/V and dK/dV bytes per call (forward + backward, :class:`~loongtrain.parallel.comm.CommCounter`).

    .venv/bin/python benchmarks/documents.py                       # S=16384 H=8 D=64 fp32, world 4
    .venv/bin/python benchmarks/documents.py --seq-len 2048 --iters 1 --configs 1x4
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import loongtrain  # noqa: E402
from loongtrain.parallel.comm import CommCounter  # noqa: E402
from loongtrain.parallel.documents import balance_report, lognormal_documents  # noqa: E402
from loongtrain.parallel.launch import run_local  # noqa: E402

CASES = ("docs", "docs-balanced", "causal", "window")


@dataclass(frozen=True)
class Setup:
    seq_len: int
    heads: int
    head_dim: int
    world: int
    median: int
    sigma: float
    seed: int
    window: int
    iters: int
    warmup: int

    def documents(self) -> list[int]:
        return lognormal_documents(self.seq_len, self.median, self.sigma, self.seed)


def _inputs(setup: Setup) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(7)
    shape = (1, setup.seq_len, setup.heads, setup.head_dim)
    return tuple(torch.randn(shape, generator=g) for _ in range(4))


def _timed(step, setup: Setup, distributed: bool) -> float:
    for _ in range(setup.warmup):
        step()
    times = []
    for _ in range(setup.iters):
        if distributed:
            dist.barrier()
        t0 = time.perf_counter()
        step()
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        if distributed:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(t.item())
    return statistics.median(times)


def limit_main(rank: int, world: int, setup: Setup, case: str) -> float:
    """torch SDPA alone in this process (all cores): each document alone, or the whole sequence."""
    q, k, v, dout = (t.transpose(1, 2).contiguous() for t in _inputs(setup))
    bounds = setup.documents() if case.startswith("docs") else [0, setup.seq_len]
    leaves = [t.requires_grad_() for t in (q, k, v)]

    def step() -> None:
        for t in leaves:
            t.grad = None
        for s, e in zip(bounds, bounds[1:]):
            mask = _window_mask(e - s, setup.window) if case == "window" else None  # SDPA has no window:
            out = torch.nn.functional.scaled_dot_product_attention(  # a dense mask (a pessimistic limit)
                *(t[:, :, s:e] for t in leaves), is_causal=mask is None, attn_mask=mask)
            out.backward(dout[:, :, s:e])

    return _timed(step, setup, False)


def _window_mask(n: int, w: int) -> torch.Tensor:
    i = torch.arange(n)
    d = i[None, :] - i[:, None]
    return (d <= 0) & (d > -w)


def rank_main(rank: int, world: int, setup: Setup, hp: int, cp: int, case: str) -> dict:
    mesh = loongtrain.init_mesh(hp, cp)
    docs = setup.documents()
    order = loongtrain.balanced_chunk_order([docs], setup.seq_len, cp, hp) if case == "docs-balanced" else None
    kw = {"cu_seqlens": torch.tensor(docs)} if case.startswith("docs") else {}
    if case == "window":
        kw["sliding_window"] = setup.window
    q, k, v, dout = (loongtrain.shard_sequence(t, mesh, 1, order).contiguous() for t in _inputs(setup))
    leaves = [t.requires_grad_() for t in (q, k, v)]

    def step() -> None:
        for t in leaves:
            t.grad = None
        loongtrain.attention(*leaves, mesh, chunk_order=order, **kw).backward(dout)

    seconds = _timed(step, setup, True)
    with CommCounter() as counter:
        step()
    return {"seconds": seconds, "ring_bytes": counter.bytes["kv"] + counter.bytes["dkv"]}


def _configs(text: str, world: int) -> list[tuple[int, int]]:
    if text == "all":
        return [(hp, world // hp) for hp in range(1, world + 1) if world % hp == 0]
    return [tuple(int(x) for x in c.split("x")) for c in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--median", type=int, default=1024, help="median document length (lognormal)")
    p.add_argument("--sigma", type=float, default=1.0, help="lognormal shape of the document lengths")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--window", type=int, default=1024, help="sliding window of the 'window' case")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--configs", default="all", help="HPxCP,... (default: every hp*cp == world)")
    p.add_argument("--cases", default=",".join(CASES))
    args = p.parse_args(argv)
    setup = Setup(args.seq_len, args.heads, args.head_dim, args.world, args.median, args.sigma, args.seed,
                  args.window, args.iters, args.warmup)
    docs = setup.documents()
    print(f"S={setup.seq_len} H={setup.heads} D={setup.head_dim} fp32 causal, world {setup.world}; "
          f"{len(docs) - 1} documents, lognormal median {setup.median} sigma {setup.sigma} seed {setup.seed}; "
          f"window case w={setup.window}")
    print(f"{'hp x cp':>8} {'case':>14} {'limit s':>9} {'time s':>9} {'ratio':>6} {'ring MiB':>9} "
          f"{'work max/mean':>14}")
    threads = os.cpu_count() or 1
    for hp, cp in _configs(args.configs, setup.world):
        report = balance_report([docs], setup.seq_len, cp, hp)
        for case in args.cases.split(","):
            limit = run_local(limit_main, 1, setup, case, threads=threads, timeout=3600)[0]
            got = run_local(rank_main, setup.world, setup, hp, cp, case, backend="gloo", timeout=3600)[0]
            work = {"docs": report["zigzag_imbalance"], "docs-balanced": report["balanced_imbalance"]}.get(case)
            print(f"{f'{hp}x{cp}':>8} {case:>14} {limit:>9.3f} {got['seconds']:>9.3f} "
                  f"{got['seconds'] / limit:>6.2f} {got['ring_bytes'] / 2**20:>9.2f} "
                  f"{'' if work is None else f'{work:.2f}':>14}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
