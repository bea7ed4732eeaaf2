"""The planner's predicted attention times beside measured ones: are the ratios between configs right?

    .venv/bin/python -m benchmarks.plan_check testbed [--json benchmarks/results/testbed-*.json]
    .venv/bin/python -m benchmarks.plan_check local [--cluster C.toml --json attention.json]

``testbed``: the scaled two-node testbed (benchmarks/testbed/run.py --json): world 8 = 2 nodes x 4, one
shaped NIC per rank, loopback inside a node. Every config is predicted with the cluster it ran on: the
per-rank attention FLOP/s calibrated just before it (all 8 ranks computing at once) and the NIC rate
derived from that, so drift of the machine's speed during the run is in the prediction too. The
testbed's transport is gloo, whose connections move one direction at a time, so the cluster is
half-duplex (``duplex = false``, what ``loongtrain plan --calibrate`` writes for gloo); the full-duplex
prediction (an NCCL cluster) is printed beside it.

``local``: ``benchmarks/attention.py --json`` on this machine (world ranks, loopback) against a cluster
from ``loongtrain plan --calibrate --calibrate-world <world>``.

A ratio is a config's time over the reference config's (the plain ring, or hp=1 x cp=world) in the
same run; the check is ``|predicted ratio / measured ratio - 1| <= 20%``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from benchmarks.common import ROOT
from loongtrain.parallel.layout import Layout
from loongtrain.plan.attention_cost import AttnShape, predict_attention_time
from loongtrain.plan.cluster import Cluster, load_cluster

TOLERANCE = 0.20
DATA = ROOT / "benchmarks" / "results"


def testbed_cluster(flops: float, nic_bit_s: float, per_node: int, duplex: bool) -> Cluster:
    """The testbed as a cluster: ``flops`` per rank, one NIC of ``nic_bit_s`` per rank, loopback inside."""
    tflops = flops / 1e12
    return Cluster(
        name="testbed", gpus_per_node=per_node, memory_gib=24, peak_tflops=tflops, matmul_tflops=tflops,
        attention_tflops=tflops, intra_node_gbyte_s=1.0, nic_gbit_s=nic_bit_s / 1e9, nics_per_node=per_node,
        link_efficiency=1.0, intra_latency_us=50.0, inter_latency_us=200.0, duplex=duplex,
    )


def _itemsize(dtype: str) -> int:
    """Bytes per element of a torch dtype name as the benchmarks record it (``float32``, ``bfloat16``)."""
    return getattr(torch, dtype).itemsize


def _name(path: Path) -> str:
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _verdict(pred_ratio: float, meas_ratio: float) -> tuple[float, str]:
    q = pred_ratio / meas_ratio
    return q, "yes" if abs(q - 1) <= TOLERANCE else "**no**"


def check_testbed(path: Path, phase: str) -> tuple[int, int]:
    run = json.loads(path.read_text())
    shape = AttnShape(batch=1, seq_len=run["seq_len"], num_heads=run["heads"], num_kv_heads=run["kv_heads"],
                      head_dim=run["head_dim"], dtype_bytes=_itemsize(run["dtype"]))
    world = 2 * run["per_node"]
    rows = []
    for cfg in run["configs"]:
        if phase not in cfg["ms"]:
            continue
        layout = Layout(world, hp=cfg["hp"], cp=cfg["cp"], inner_ring=cfg["inner_ring"], placement=cfg["placement"])
        flops = cfg["flops_per_rank"][phase]
        pred = {duplex: predict_attention_time(layout, shape, testbed_cluster(flops, cfg["nic_bit_s"],
                                                                              run["per_node"], duplex))
                for duplex in (False, True)}
        rows.append((cfg, flops, pred, cfg["ms"][phase] / 1e3))
    ref_cfg, _, ref_pred, ref_meas = rows[0]
    print(f"\n{_name(path)} (`run.py {' '.join(run['argv'])}`), phase {phase}; reference {ref_cfg['name']}\n")
    print(_row(["config", "GFLOP/s/rank", "NIC Mbit/s", "predicted s", "measured s", "predicted ratio",
                "measured ratio", "pred/meas", "within 20%", "full-duplex ratio (NCCL-like)"]))
    print("|---|" + "---:|" * 8 + "---:|")
    ok = 0
    for cfg, flops, pred, meas in rows:
        ratio, meas_ratio = pred[False] / ref_pred[False], meas / ref_meas
        q, good = _verdict(ratio, meas_ratio)
        ok += good == "yes"
        print(_row([cfg["name"], f"{flops / 1e9:.1f}", f"{cfg['nic_bit_s'] / 1e6:.1f}", f"{pred[False]:.2f}",
                    f"{meas:.2f}", f"{ratio:.2f}", f"{meas_ratio:.2f}", f"{q:.2f}", good,
                    f"{pred[True] / ref_pred[True]:.2f}"]))
    return ok, len(rows)


def check_local(cluster_path: Path, path: Path) -> tuple[int, int]:
    cluster = load_cluster(cluster_path)
    run = json.loads(path.read_text())
    sh, world = run["shape"], run["world"]
    if world != cluster.gpus_per_node:
        raise SystemExit(f"{cluster_path} describes {cluster.gpus_per_node} ranks, the run used {world}: "
                         f"calibrate with --calibrate-world {world}")
    ok = total = 0
    print(f"\n{_name(path)} (`{run['command']}`) against {_name(cluster_path)} ({cluster.description})\n")
    print(_row(["Hkv", "config", "predicted s", "measured s", "predicted ratio", "measured ratio",
                "pred/meas", "within 20%"]))
    print("|---:|---|" + "---:|" * 5 + "---|")
    for kv in sorted({c["kv_heads"] for c in run["cases"]}, reverse=True):
        cases = [c for c in run["cases"] if c["kind"] == "loongtrain" and c["kv_heads"] == kv and c["total_s"]]
        shape = AttnShape(batch=sh["batch"], seq_len=sh["seq_len"], num_heads=sh["heads"], num_kv_heads=kv,
                          head_dim=sh["head_dim"], dtype_bytes=_itemsize(sh["dtype"]))
        preds = [predict_attention_time(Layout(world, hp=c["hp"], cp=c["cp"], inner_ring=c["inner_ring"]), shape,
                                        cluster)
                 for c in cases]
        meas = [statistics.median(c["total_s"]) for c in cases]
        for c, p, m in zip(cases, preds, meas):
            q, good = _verdict(p / preds[0], m / meas[0])
            ok, total = ok + (good == "yes"), total + 1
            label = f"hp={c['hp']} cp={c['cp']}" + (f" w{c['inner_ring']}" if c["inner_ring"] > 1 else "")
            print(_row([str(kv), label, f"{p:.3f}", f"{m:.3f}", f"{p / preds[0]:.2f}", f"{m / meas[0]:.2f}",
                        f"{q:.2f}", good]))
    return ok, total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    tb = sub.add_parser("testbed", help="against benchmarks/testbed/run.py --json")
    tb.add_argument("--json", type=Path, nargs="+", default=sorted(DATA.glob("testbed-*.json")))
    tb.add_argument("--phase", default="shaped", help="shaped (library behaviour) or shaped-split")
    lo = sub.add_parser("local", help="against benchmarks/attention.py --json on this machine")
    lo.add_argument("--cluster", type=Path, default=DATA / "cluster-this-machine-world4.toml",
                    help="from loongtrain plan --calibrate")
    lo.add_argument("--json", type=Path, default=DATA / "attention-world4.json")
    args = parser.parse_args(argv)
    if args.mode == "testbed":
        results = [check_testbed(p, args.phase) for p in args.json]
        ok, total = sum(r[0] for r in results), sum(r[1] for r in results)
    else:
        ok, total = check_local(args.cluster, args.json)
    print(f"\nwithin {TOLERANCE:.0%}: {ok} of {total}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
