"""Attention sinks' cost (docs/attention.md#attention-sinks): ``loongtrain.attention`` forward + backward with
gpt-oss's sinks against the same call without them, side by side in one process per layout, alternating single
steps (one warm-up each). The sinks are folded in once after the ring's last merge, so the ratio should be ~1.

    python -m benchmarks.sinks --rounds 15 --seq-len 4096
    python -m benchmarks.sinks --rounds 9 --seq-len 4096 --world 4 --hp 2 --cp 2

Prints ratios of step time (sinks / none) from the wall clock and the CPU time of the one-thread ranks (slowest
rank): median, quartiles, min-max.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import loongtrain
from benchmarks.common import add_common, header


def _step(mesh, tensors, sinks, window) -> tuple[float, float]:
    q, k, v, dout = tensors
    wall, cpu = time.perf_counter(), time.process_time()
    out = loongtrain.attention(q, k, v, mesh, sinks=sinks, sliding_window=window)
    out.backward(dout)
    times = torch.tensor([time.perf_counter() - wall, time.process_time() - cpu], dtype=torch.float64)
    if mesh.sp_group is not None:
        dist.all_reduce(times, op=dist.ReduceOp.MAX, group=mesh.sp_group)
    return float(times[0]), float(times[1])


def _rank(rank: int, world: int, hp: int, cp: int, seq_len: int, rounds: int, window: int | None) -> dict:
    torch.set_num_threads(1)
    mesh = loongtrain.init_mesh(hp=hp, cp=cp)
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim = 8, 2, 64
    full = [torch.randn(1, seq_len, h, head_dim, generator=g) for h in (heads, kv_heads, kv_heads, heads)]
    tensors = [loongtrain.shard_sequence(t, mesh, 1) for t in full]
    tensors = [t.requires_grad_() if i < 3 else t for i, t in enumerate(tensors)]
    sinks = torch.randn(heads, generator=g).requires_grad_()
    for case in (None, sinks):  # warm-up
        _step(mesh, tensors, case, window)
    results: dict[str, list[tuple[float, float]]] = {"none": [], "sinks": []}
    for r in range(rounds):
        order = [("none", None), ("sinks", sinks)] if r % 2 == 0 else [("sinks", sinks), ("none", None)]
        for name, case in order:
            results[name].append(_step(mesh, tensors, case, window))
    return results


def _summary(values: list[float]) -> str:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return f"{statistics.median(values):.3f} | {q[0]:.3f}-{q[2]:.3f} | {min(values):.3f}-{max(values):.3f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common(parser, rounds=15)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--hp", type=int, default=1)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--window", type=int, default=None, help="sliding window (default: none)")
    args = parser.parse_args(argv)
    if args.world == 1:
        results = [_rank(0, 1, 1, 1, args.seq_len, args.rounds, args.window)]
    else:
        results = loongtrain.run_local(_rank, args.world, args.hp, args.cp, args.seq_len, args.rounds, args.window,
                                       backend="gloo", threads=1)
    res = results[0]
    print(header())
    print("| ratio (step time, sinks / none) | median | quartiles | min-max |\n|---|---:|---:|---:|")
    for i, clock in enumerate(("wall", "CPU")):
        ratios = [a[i] / b[i] for a, b in zip(res["sinks"], res["none"])]
        print(f"| hp{args.hp} x cp{args.cp}, S={args.seq_len} ({clock}) | {_summary(ratios)} |")
    base = statistics.median(b[1] for b in res["none"])
    print(f"(median CPU time of a step without sinks: {base * 1e3:.0f} ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
