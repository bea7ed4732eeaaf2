"""The longest sequence per GPU count, planned and simulated at full size (docs/planner.md).

For each model (a Llama-3-8B-shaped config.json, 7b-gqa, 1b) and GPU count (1, 8, 64 H200s):

- the planner's longest sequence (``loongtrain.plan.search.max_seq_len``) without the offload/tiling modes
  and with them (``modes="auto"``), each with its best configuration, device GiB per rank and host GiB per
  node;
- the simulation (``loongtrain.launch.simulate.simulate_by_depth``: the trainer's step under FakeTensorMode with
  the fake process group at two small depths extended to the model's, MemTracker's peak for one rank) of the
  best configuration at the planner's maximum (and at ``--fractions`` of it), beside the prediction: device
  GiB per rank and, with the offload modes, host GiB per rank (the planner's ``host``; the simulation's host peak).

Run: ``python -m benchmarks.max_seq [--models ...] [--gpus 1 8 64] [--modes off auto]
[--out max_seq.json]``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from loongtrain.launch.simulate import simulate_by_depth
from loongtrain.plan.cluster import load_cluster
from loongtrain.plan.max_seq import max_seq_len
from loongtrain.plan.search import plan, resolve_model

LLAMA3_8B = str(Path(__file__).with_name("inputs") / "llama3-8b" / "config.json")
MODELS = {"llama3-8b": LLAMA3_8B, "7b-gqa": "7b-gqa", "1b": "1b"}


def row(name: str, model, cluster, gpus: int, modes: str, fraction: float, simulate: bool, grid: int = 1) -> dict:
    length, best = max_seq_len(model, cluster, gpus=gpus, modes=modes)
    seq = length if fraction == 1 else _on_grid(int(length * fraction), 2 * gpus)
    seq = _on_grid(seq, grid) if grid > 1 else seq
    cand = best if seq == length else plan(model, cluster, gpus=gpus, seq_len=seq, modes=modes)[0]
    out = {"model": name, "gpus": gpus, "modes": modes, "planner_max_seq_len": length, "seq_len": seq,
           "configuration": cand.config.label(), "fits": cand.fits,
           "predicted_device_gib": cand.memory["total"] / 2**30,
           "predicted_host_gib_per_rank": cand.memory["host"] / 2**30,
           "predicted_host_gib_per_node": cand.host_per_node / 2**30,
           "predicted_parts_gib": {k: v / 2**30 for k, v in cand.memory.items()}}
    if not simulate:
        return out
    start = time.perf_counter()
    sim = simulate_by_depth(model, cand.config, gpus, seq_len=seq)
    out.update(sim.to_dict(), simulate_s=time.perf_counter() - start)
    out["predicted_over_simulated"] = out["predicted_device_gib"] / out["simulated_device_gib"]
    return out


def _on_grid(n: int, unit: int) -> int:
    return max(unit, n // unit * unit)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--gpus", nargs="+", type=int, default=[1, 8, 64])
    p.add_argument("--cluster", default="h200")
    p.add_argument("--modes", nargs="+", default=["off", "auto"], choices=["off", "auto", "on"])
    p.add_argument("--fractions", nargs="+", type=float, default=[1.0])
    p.add_argument("--grid", type=int, default=1,
                   help="round the simulated length down to a multiple of this (e.g. 65536: local token counts "
                        "that --mlp-tiles auto divides into few tiles)")
    p.add_argument("--no-simulate", action="store_true", help="planner only")
    p.add_argument("--out", default="max_seq.json")
    args = p.parse_args()
    cluster = load_cluster(args.cluster)
    rows = []
    for name in args.models:
        _, model = resolve_model(MODELS[name])
        for gpus in args.gpus:
            for modes in args.modes:
                for fraction in args.fractions:
                    r = row(name, model, cluster, gpus, modes, fraction, not args.no_simulate, args.grid)
                    rows.append(r)
                    sim = r.get("why", "")
                    if "simulated_device_gib" in r:
                        sim = (f"simulated {r['simulated_device_gib']:.2f} GiB "
                               f"(pred/sim {r['predicted_over_simulated']:.3f}), host per rank predicted "
                               f"{r['predicted_host_gib_per_rank']:.1f} simulated {r['simulated_host_gib']:.1f} GiB")
                    print(f"{name:10s} gpus={gpus:<3d} modes={modes:<4s} seq={r['seq_len']:>10d} "
                          f"({r['seq_len'] / 2**20:6.2f}M) {r['configuration']}: predicted "
                          f"{r['predicted_device_gib']:.2f} GiB/device, host {r['predicted_host_gib_per_node']:.1f} "
                          f"GiB/node; {sim}", flush=True)
                    Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
