"""Step-time cost of the memory modes (activation offload, sequence-tiled MLP, parameter offload), side by side.

    python -m benchmarks.offload                      # CPU, one process (this machine)
    python -m benchmarks.offload --seq-len 4096 --rounds 5

One process trains one model with every mode (docs/memory.md). Each round times, per mode, one step of
the mode's baseline (the same ``--recompute`` without the mode) right before one step of the mode, and
records their ratio of wall time and of process CPU time (steadier on a shared machine: with one thread,
the work done); the table shows per mode the median ratios over rounds and their min-max spreads, the
median step times, the bytes offloaded per step and the saved activations left on the device (the
trainer's start-up memory report). Parameter offload runs FSDP2 (``zero=full``) on a one-rank process
group; its baseline is ``zero=full`` without offload. :func:`compare_modes` is also gpu_check's
``offload`` section.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.common import add_common, setup
from loongtrain.data.synthetic import global_batch
from loongtrain.launch.config import TrainConfig, run_of
from loongtrain.model.config import ModelConfig, get_preset
from loongtrain.parallel.config import ParallelConfig
from loongtrain.parallel.mesh import single_process_mesh
from loongtrain.parallelize.offload import activation_offloader
from loongtrain.train.trainer import Trainer

#: mode name -> (its options, its baseline's options); every one on top of --recompute
MODES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "offload activations": ({"offload_activations": True}, {}),
    "mlp tiles auto": ({"mlp_tiles": "auto"}, {}),
    "mlp tiles auto (ac none)": ({"recompute": "none", "mlp_tiles": "auto"}, {"recompute": "none"}),
    "offload activations + mlp tiles auto": ({"offload_activations": True, "mlp_tiles": "auto"}, {}),
    "offload params (zero full)": ({"zero": "full", "offload_params": True}, {"zero": "full"}),
}

BENCH_MODEL = ModelConfig(vocab_size=1024, dim=256, num_layers=4, num_heads=8, num_kv_heads=4, ffn_dim=704)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _trainer(model: ModelConfig, seq: int, device: torch.device, recompute: str, dtype: str,
             opts: dict[str, Any]) -> Trainer:
    cfg = TrainConfig.from_dict(dict(seq_len=seq, steps=1000, warmup=1, dtype=dtype, memory_report=False,
                      parallel=ParallelConfig(**{"recompute": recompute, **opts})))
    return Trainer(run_of(cfg, model), single_process_mesh(), device)


def _step(trainer: Trainer, batch: dict[str, torch.Tensor], device: torch.device) -> tuple[float, int, float]:
    """(wall seconds, peak allocated device bytes: CUDA only, else 0, process CPU seconds) of one step."""
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0, c0 = time.perf_counter(), time.process_time()
    trainer.step([batch])
    _sync(device)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return wall, torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0, cpu


def compare_modes(model: ModelConfig, seq: int, device: torch.device, *, recompute: str = "selective",
                  dtype: str = "auto", rounds: int = 3, modes: dict[str, tuple[dict, dict]] = MODES
                  ) -> dict[str, Any]:
    """Per mode: median ratio (mode step / baseline step timed right before it), spread, median seconds,
    bytes offloaded per step and saved activation bytes left on the device. Needs a process group for
    the parameter-offload mode (:func:`main` starts a one-rank one)."""
    batch = global_batch(0, 1, seq, model.vocab_size, seed=0)
    built: dict[tuple, Trainer] = {}

    def trainer(opts: dict[str, Any]) -> Trainer:
        key = tuple(sorted(opts.items()))
        if key not in built:
            built[key] = _trainer(model, seq, device, recompute, dtype, opts)
            built[key].step([batch])  # warm-up
        return built[key]

    results: dict[str, Any] = {}
    for name, (opts, base_opts) in modes.items():
        mode, base = trainer(opts), trainer(base_opts)
        offloader = activation_offloader(mode.model)
        before = offloader.offloaded_bytes if offloader else 0
        pairs = [(_step(base, batch, device), _step(mode, batch, device)) for _ in range(rounds)]
        ratios = [m[0] / b[0] for b, m in pairs]
        cpu_ratios = [m[2] / b[2] for b, m in pairs]
        results[name] = {
            "ratio": statistics.median(ratios), "spread": [min(ratios), max(ratios)],
            "cpu_ratio": statistics.median(cpu_ratios), "cpu_spread": [min(cpu_ratios), max(cpu_ratios)],
            "baseline_s": statistics.median(b[0] for b, _ in pairs),
            "mode_s": statistics.median(m[0] for _, m in pairs),
            "baseline_peak_gib": max(b[1] for b, _ in pairs) / 2**30,
            "mode_peak_gib": max(m[1] for _, m in pairs) / 2**30,
            "offloaded_mib_per_step": ((offloader.offloaded_bytes - before) / rounds / 2**20) if offloader else 0.0,
            "device_activations_mib": mode.memory_report(batch)["activations"] / 2**20,
            "baseline_activations_mib": base.memory_report(batch)["activations"] / 2**20,
        }
    return results


def format_table(results: dict[str, Any]) -> str:
    lines = ["| mode | step / baseline, wall (median) | spread | CPU time ratio (median) | spread | baseline s | "
             "mode s | offloaded MiB/step | device activations MiB (baseline) | peak GiB (baseline; CUDA) |",
             "|---|---:|---|---:|---|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['ratio']:.3f} | {r['spread'][0]:.3f}-{r['spread'][1]:.3f} | "
                     f"{r['cpu_ratio']:.3f} | {r['cpu_spread'][0]:.3f}-{r['cpu_spread'][1]:.3f} | "
                     f"{r['baseline_s']:.3f} | {r['mode_s']:.3f} | {r['offloaded_mib_per_step']:.1f} | "
                     f"{r['device_activations_mib']:.1f} ({r['baseline_activations_mib']:.1f}) | "
                     f"{r['mode_peak_gib']:.2f} ({r['baseline_peak_gib']:.2f}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="", help="a preset (default: a 4-layer dim-256 model)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--recompute", default="selective")
    parser.add_argument("--dtype", default="auto")
    add_common(parser, rounds=5, threads=1)
    args = parser.parse_args(argv)
    setup(args)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    model = get_preset(args.model) if args.model else BENCH_MODEL
    if not dist.is_initialized():  # parameter offload is FSDP2's: a one-rank group in this process
        backend = "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        results = compare_modes(model, args.seq_len, device, recompute=args.recompute, dtype=args.dtype,
                                rounds=args.rounds)
    finally:
        dist.destroy_process_group()
    print(f"{device}, {args.model or 'dim 256 x 4 layers'}, S={args.seq_len}, recompute={args.recompute}, "
          f"{args.rounds} rounds, {torch.get_num_threads()} threads")
    print(format_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
