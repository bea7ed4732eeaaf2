"""Training throughput: world 4 (hp=2 x cp=2, one thread per worker) vs one process, side by side.

Both runs train the same model (default: the tiny preset) at the same sequence length (default 8192)
on the same corpus through the real ``loongtrain train`` launcher, one after the other on the same
machine. The single process runs with one thread and with every core (``os.cpu_count()`` threads);
the ratio uses the faster of the two. The 4 workers use one thread each. Throughput is the mean
tokens/s over the steps after ``--skip`` warm-up steps, read from each run's metrics.jsonl. The ratio
``tokens/s (hp=2 x cp=2) / tokens/s (best 1 process)`` is the parallel efficiency of 2D-Attention on
one machine (target >= 0.85).

    .venv/bin/python -m benchmarks.train [--steps 10] [--skip 2] [--seq-len 8192] [--model tiny]

Run it on a quiet machine: other processes on the same cores distort both columns.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from loongtrain.launch.config import TrainConfig
from loongtrain.launch.train_run import launch
from loongtrain.parallel.config import ParallelConfig
from loongtrain.train.metrics import read_jsonl


def run(name: str, cfg: TrainConfig, skip: int) -> dict:
    t0 = time.perf_counter()
    launch(cfg)
    wall = time.perf_counter() - t0
    records = read_jsonl(Path(cfg.output.out_dir) / "metrics.jsonl")
    timed = records[skip:] or records
    return {
        "name": name,
        "world": cfg.runtime.nproc,
        "threads": cfg.runtime.threads,
        "step_s": statistics.mean(r["step_time_s"] for r in timed),
        "tokens_per_s": statistics.mean(r["tokens_per_s"] for r in timed),
        "tflops": statistics.mean(r["tflops"] for r in timed),
        "mfu": statistics.mean(r["mfu"] for r in timed),
        "first_loss": records[0]["loss"],
        "last_loss": records[-1]["loss"],
        "wall_s": wall,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per run (default 10)")
    parser.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the mean (default 2)")
    parser.add_argument("--seq-len", type=int, default=8192, help="tokens per sequence (default 8192)")
    parser.add_argument("--model", default="tiny", help="model preset (default tiny)")
    parser.add_argument("--corpus", default="stdlib", help="corpus (default stdlib)")
    parser.add_argument("--hp", type=int, default=2)
    parser.add_argument("--cp", type=int, default=2)
    args = parser.parse_args(argv)
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="loongtrain-bench-") as tmp:
        common = dict(model=args.model, corpus=args.corpus, seq_len=args.seq_len, steps=args.steps,
                      warmup=1, progress="off", tensorboard=False, plot=False, ckpt_interval=0)
        sp = args.hp * args.cp
        rows = []
        for threads in sorted({1, cores}):
            single = TrainConfig.from_dict(dict(**common, parallel=ParallelConfig(), nproc=1, threads=threads,
                                 out_dir=f"{tmp}/single{threads}"))
            rows.append(run(f"1 process ({threads} thread{'s' * (threads > 1)})", single, args.skip))
        multi = TrainConfig.from_dict(dict(**common, parallel=ParallelConfig(hp=args.hp, cp=args.cp), nproc=sp,
                                           threads=1,
                            out_dir=f"{tmp}/multi"))
        rows.append(run(f"hp={args.hp} x cp={args.cp} ({sp} x 1 thread)", multi, args.skip))
    print(f"\nmodel {args.model}, seq_len {args.seq_len}, {args.steps} steps (mean over the last "
          f"{args.steps - args.skip}), {cores} CPU cores")
    header = f"{'run':32s} {'step s':>8s} {'tokens/s':>10s} {'TFLOP/s':>9s} {'MFU':>6s} {'loss':>15s}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['name']:32s} {r['step_s']:8.3f} {r['tokens_per_s']:10.0f} {r['tflops']:9.4f} "
              f"{100 * r['mfu']:5.1f}% {r['first_loss']:6.3f} -> {r['last_loss']:5.3f}")
    best = max(rows[:-1], key=lambda r: r["tokens_per_s"])
    ratio = rows[-1]["tokens_per_s"] / best["tokens_per_s"]
    print(f"\nratio tokens/s (hp={args.hp} x cp={args.cp}) / (best single process: {best['name']}) = "
          f"{ratio:.3f} (target >= 0.85)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
