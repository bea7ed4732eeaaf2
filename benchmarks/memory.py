"""Per-rank memory and step time of each memory mode vs sequence length, and the longest sequence that trains.

Each (mode, seq_len) point runs in fresh processes (``world`` gloo ranks on CPU, or NCCL when
``--device cuda``) so that peak RSS belongs to that point alone. Per point and rank it records the
tracked memory report (``loongtrain.train.memory_report``: parameters, gradients, optimizer state, saved
activations), the process peak RSS (and CUDA peak allocated on GPU) and the step time (median of the
steps after the first). ``--max-seq`` doubles the sequence from ``--min-seq`` for each mode until a run
fails, reaches ``--seq-limit``, or the next doubling is predicted (linear growth of the memory above the
start-up baseline) to exceed ``--mem-limit-gib`` summed over the ranks, which keeps a shared machine from
being driven into the OOM killer. Prints markdown, starting with the command that produced it.

The trainer's loss is the chunked cross-entropy (loongtrain/loss/chunked.py), so these runs
include its peak; the loss's own peak, chunked against full logits, is measured in one place:
``benchmarks/loss_memory.py`` (figures in benchmarks/results/RESULTS.md, "Loss memory").

    python -m benchmarks.memory --seqs 4096,8192,16384
    python -m benchmarks.memory --max-seq --min-seq 8192 --modes none,selective,full,zero+selective
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import shlex
import statistics
import sys
import time
from typing import Any

import torch

from benchmarks.common import add_common
from loongtrain.parallel.workers import WorkerError, run_local

# mode name -> memory options (ParallelConfig fields)
MODES: dict[str, dict[str, Any]] = {
    "none": {},
    "selective": {"recompute": "selective"},
    "full": {"recompute": "full"},
    "zero": {"zero": "full"},
    "zero+selective": {"zero": "full", "recompute": "selective"},
    "zero+full": {"zero": "full", "recompute": "full"},
}
GIB = 2**30


def _rss_bytes() -> int:
    """Peak resident set size of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _rank_main(rank: int, world: int, args: dict[str, Any]) -> dict[str, Any]:
    """One rank of one point (inside run_local's process group): train, measure, return the numbers."""
    from loongtrain.data.synthetic import global_batch
    from loongtrain.launch.config import TrainConfig, run_of
    from loongtrain.model.config import get_preset
    from loongtrain.parallel.config import ParallelConfig
    from loongtrain.parallel.mesh import init_mesh
    from loongtrain.train.trainer import Trainer

    cuda = args["device"] == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    baseline = _rss_bytes()
    mesh = init_mesh(args["hp"], args["cp"])
    model_config = get_preset(args["model"])
    parallel = ParallelConfig(hp=args["hp"], cp=args["cp"], **MODES[args["mode"]])
    cfg = TrainConfig.from_dict(dict(model=args["model"], seq_len=args["seq"], steps=args["steps"], warmup=1,
                      parallel=parallel, dtype=args["dtype"], seed=0))
    trainer = Trainer(run_of(cfg, model_config), mesh, device)

    def batch(step: int) -> dict[str, torch.Tensor]:
        full = global_batch(step, mesh.dp, args["seq"], model_config.vocab_size, seed=0)
        return {k: v[mesh.dp_rank : mesh.dp_rank + 1] for k, v in full.items()}

    report = trainer.memory_report(batch(0))
    times = []
    for step in range(args["steps"]):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = trainer.step([batch(step)])["loss"]
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return {
        "report": report, "times": times, "loss": loss, "rss": _rss_bytes(), "baseline_rss": baseline,
        "cuda_peak": torch.cuda.max_memory_allocated(device) if cuda else 0,
    }


def run_point(args: argparse.Namespace, mode: str, seq: int) -> dict[str, Any]:
    """Train ``args.steps`` steps of ``mode`` at ``seq`` tokens in fresh processes; per-rank results."""
    point = {"mode": mode, "seq": seq, "hp": args.hp, "cp": args.cp, "model": args.model, "steps": args.steps,
             "dtype": args.dtype, "threads": args.threads, "device": args.device}
    error = None
    try:
        ranks = run_local(_rank_main, args.world, point, backend="nccl" if args.device == "cuda" else "gloo",
                          threads=args.threads, timeout=args.timeout)
    except WorkerError as exc:  # e.g. out of memory: the last line of the traceback, or how the rank died
        error = f"rank {exc.rank}: {exc.details.strip().splitlines()[-1]}"
    except TimeoutError:
        error = f"timed out after {args.timeout} s"
    if error is not None:
        return {"mode": mode, "seq": seq, "ok": False, "error": error}
    step_times = [statistics.median(r["times"][1:] or r["times"]) for r in ranks]
    step = max(step_times)
    return {
        "mode": mode, "seq": seq, "ok": True, "step_s": step,
        "tokens_per_s": seq * (args.world // (args.hp * args.cp)) / step,
        "rss_max": max(r["rss"] for r in ranks), "rss_sum": sum(r["rss"] for r in ranks),
        "baseline_sum": sum(r["baseline_rss"] for r in ranks),
        "cuda_peak_max": max(r["cuda_peak"] for r in ranks),
        "tracked_max": {k: max(r["report"][k] for r in ranks)
                        for k in ("params", "grads", "optimizer_state", "activations", "total")},
        "loss": ranks[0]["loss"],
    }


def _gib(n: float) -> str:
    return f"{n / GIB:.2f}"


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def points_table(points: list[dict[str, Any]], cuda: bool) -> str:
    peak = "CUDA peak GiB (max rank)" if cuda else "peak RSS GiB (max rank / sum)"
    lines = [
        f"| mode | seq | step s | tokens/s | {peak} | params MiB | grads MiB | optim MiB* | "
        "saved act. MiB | tracked total MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in points:
        if not p["ok"]:
            lines.append(f"| {p['mode']} | {p['seq']} | failed: {p['error'][:80]} |||||||")
            continue
        t = p["tracked_max"]
        mem = _gib(p["cuda_peak_max"]) if cuda else f"{_gib(p['rss_max'])} / {_gib(p['rss_sum'])}"
        lines.append(
            f"| {p['mode']} | {p['seq']} | {p['step_s']:.3f} | {p['tokens_per_s']:.0f} | {mem} | "
            f"{_mib(t['params'])} | {_mib(t['grads'])} | {_mib(t['optimizer_state'])} | "
            f"{_mib(t['activations'])} | {_mib(t['total'])} |"
        )
    lines.append("\nTracked columns: max over ranks of `loongtrain.train.memory_report.memory_report` "
                 "(\\* optimizer state estimated as 2 x params before the first step).")
    return "\n".join(lines)


def total_memory_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


def extrapolate_max_seq(points: list[dict[str, Any]], limit: float, world: int, cuda: bool) -> str:
    """Sequence length at which memory (linear in seq from the last two points) reaches ``limit``
    (summed over ranks: the CUDA peak of the largest rank times ``world`` on GPUs, else the RSS sum)."""
    if len(points) < 2:
        return "-"
    (s0, m0), (s1, m1) = ((p["seq"], p["cuda_peak_max"] * world if cuda else p["rss_sum"])
                          for p in points[-2:])
    slope = (m1 - m0) / (s1 - s0)
    if slope <= 0:
        return "-"
    return f"~{int(s1 + (limit - m1) / slope):,}"


def max_seq_search(args: argparse.Namespace, mode: str, limit: float) -> tuple[list[dict[str, Any]], str]:
    """Double the sequence until failure, ``--seq-limit``, or a predicted excess of ``limit`` bytes or of
    ``--max-step-s`` (step-time growth per doubling taken from the last two points, 4x at first)."""
    points: list[dict[str, Any]] = []
    seq = args.min_seq
    reason = ""
    growth = 4.0
    while True:
        point = run_point(args, mode, seq)
        points.append(point)
        print(f"  {mode} seq={seq}: " + (f"{point['step_s']:.2f} s/step, RSS sum {_gib(point['rss_sum'])} GiB"
                                        if point["ok"] else f"failed ({point['error']})"),
              file=sys.stderr, flush=True)
        if not point["ok"]:
            reason = f"failed at {seq}: {point['error'][:60]}"
            break
        used = point["cuda_peak_max"] * args.world if args.device == "cuda" else point["rss_sum"]
        base = 0 if args.device == "cuda" else point["baseline_sum"]
        predicted = base + 2 * (used - base)
        if seq * 2 > args.seq_limit:
            reason = f"reached --seq-limit {args.seq_limit}"
            break
        if predicted > limit:
            reason = f"next ({seq * 2}) predicted {_gib(predicted)} GiB > limit {_gib(limit)} GiB"
            break
        good = [p for p in points if p["ok"]]
        if len(good) >= 2:
            growth = max(2.0, good[-1]["step_s"] / good[-2]["step_s"])
        if point["step_s"] * growth > args.max_step_s:
            reason = (f"next ({seq * 2}) predicted {point['step_s'] * growth:.0f} s/step > "
                      f"--max-step-s {args.max_step_s:.0f} (memory not the limit)")
            break
        seq *= 2
    return points, reason


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=4, help="ranks (dp = world / (hp * cp))")
    parser.add_argument("--hp", type=int, default=2)
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--model", default="tiny", help="model preset")
    parser.add_argument("--dtype", default="fp32", choices=("fp32", "bf16", "fp64", "auto"))
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    add_common(parser, threads=1)  # per rank
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps per point")
    parser.add_argument("--modes", default="none,selective,full,zero,zero+selective",
                        help=f"comma-separated modes from {sorted(MODES)}")
    parser.add_argument("--seqs", default="2048,8192,32768", help="sequence lengths of the sweep")
    parser.add_argument("--max-seq", action="store_true", help="search the longest sequence per mode")
    parser.add_argument("--min-seq", type=int, default=8192, help="--max-seq: first sequence length")
    parser.add_argument("--seq-limit", type=int, default=1 << 22, help="--max-seq: never go beyond")
    parser.add_argument("--mem-limit-gib", type=float, default=0.0,
                        help="--max-seq: memory budget summed over ranks (0: 85%% of MemTotal, or of the "
                        "GPUs' memory with --device cuda)")
    parser.add_argument("--max-step-s", type=float, default=300.0,
                        help="--max-seq: stop when the next step is predicted to take longer (seconds)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per point")
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        if m not in MODES:
            parser.error(f"unknown mode {m!r}; valid modes: {sorted(MODES)}")
    if args.world % (args.hp * args.cp):
        parser.error(f"--world={args.world} must be a multiple of hp*cp={args.hp * args.cp}")
    if args.device == "cuda":
        capacity = torch.cuda.get_device_properties(0).total_memory * args.world
    else:
        capacity = total_memory_bytes()
    limit = args.mem_limit_gib * GIB if args.mem_limit_gib > 0 else 0.85 * capacity

    print(f"```\npython -m benchmarks.memory {shlex.join(sys.argv[1:] if argv is None else argv)}\n```\n")
    print(f"{platform.node()}: {os.cpu_count()} CPUs, {_gib(total_memory_bytes())} GiB RAM, torch "
          f"{torch.__version__}; world {args.world} (hp={args.hp}, cp={args.cp}, "
          f"dp={args.world // (args.hp * args.cp)}), model {args.model}, {args.dtype}, {args.threads} "
          f"thread(s) per rank, {args.steps} steps per point.\n")
    if args.max_seq:
        summary = ["| mode | longest seq trained | step s | peak RSS sum GiB | stopped because | "
                   "memory-bound max seq (extrapolated) |",
                   "|---|---:|---:|---:|---|---:|"]
        all_points = []
        for mode in modes:
            points, reason = max_seq_search(args, mode, limit)
            all_points += points
            good = [p for p in points if p["ok"]]
            best = good[-1] if good else None
            summary.append(f"| {mode} | {best['seq']} | {best['step_s']:.2f} | {_gib(best['rss_sum'])} | "
                           f"{reason} | {extrapolate_max_seq(good, limit, args.world, args.device == 'cuda')} |" if best
                           else f"| {mode} | - | - | - | {reason} | - |")
        print(f"### Longest sequence per mode (budget {_gib(limit)} GiB)\n")
        print("\n".join(summary) + "\n")
        print("### All points\n")
        print(points_table(all_points, args.device == "cuda"))
        return 0
    points = []
    for seq in [int(s) for s in args.seqs.split(",")]:
        for mode in modes:
            points.append(run_point(args, mode, seq))
            print(f"  done {mode} seq={seq}", file=sys.stderr, flush=True)
    print(points_table(points, args.device == "cuda"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
