"""Planner predictions for the measured setups, printed beside the measured ratios.

    .venv/bin/python benchmarks/plan_check.py [--attn-gflops 16.5] [--nic-mbit 21] [--loop-gbyte 1.0]

Testbed (benchmarks/testbed): world 8 = 2 nodes x 4, one NIC per rank, S=8192, H=8, Hkv=2, D=64,
fp32, causal. The cluster description is built from the testbed's own measured rates (per-rank
attention GFLOP/s with all 8 ranks busy, shaped NIC Mbit/s); intra-node traffic is loopback.
Measured ratios are the testbed run recorded in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse

from loongtrain.parallel.layout import Layout
from loongtrain.plan.attention_cost import AttnShape, predict_attention_time
from loongtrain.plan.cluster import Cluster

# (name, layout kwargs, measured ms, measured ms with --split-directions) from the testbed run
TESTBED = [
    ("ring (hp1 cp8)", dict(hp=1, cp=8, window=1, placement="context_first"), 9560, 10549),
    ("dring-w4", dict(hp=1, cp=8, window=4, placement="context_first"), 3569, 3031),
    ("dring-w2", dict(hp=1, cp=8, window=2, placement="context_first"), 3845, 3851),
    ("2D hp2 cp4 head_first", dict(hp=2, cp=4, window=1, placement="head_first"), 4621, 3810),
    ("2D hp2 cp4 head_first w2", dict(hp=2, cp=4, window=2, placement="head_first"), 3343, 2852),
    ("2D hp2 cp4 context_first", dict(hp=2, cp=4, window=1, placement="context_first"), 5873, 6586),
    ("2D hp2 cp4 context_first w2", dict(hp=2, cp=4, window=2, placement="context_first"), 5590, 6376),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attn-gflops", type=float, default=16.5, help="per-rank attention GFLOP/s")
    parser.add_argument("--nic-mbit", type=float, default=21.0, help="shaped NIC rate, Mbit/s")
    parser.add_argument("--loop-gbyte", type=float, default=1.0, help="intra-node (loopback) GB/s")
    parser.add_argument("--half-duplex", action="store_true",
                        help="model gloo's one-direction-at-a-time connections (cluster duplex = false)")
    args = parser.parse_args()
    cluster = Cluster(
        name="testbed", gpus_per_node=4, memory_gib=24, peak_tflops=args.attn_gflops / 1e3,
        matmul_tflops=args.attn_gflops / 1e3, attention_tflops=args.attn_gflops / 1e3,
        intra_node_gbyte_s=args.loop_gbyte, nic_gbit_s=args.nic_mbit / 1e3, nics_per_node=4,
        link_efficiency=1.0, intra_latency_us=50.0, inter_latency_us=200.0, duplex=not args.half_duplex,
    )
    shape = AttnShape(batch=1, seq_len=8192, num_heads=8, num_kv_heads=2, head_dim=64, dtype_bytes=4)
    times = [predict_attention_time(Layout(8, **kw), shape, cluster) for _, kw, _, _ in TESTBED]
    ring, ring_split = TESTBED[0][2], TESTBED[0][3]
    print(f"cluster: {args.attn_gflops} GFLOP/s per rank, NIC {args.nic_mbit} Mbit/s, loopback {args.loop_gbyte} "
          f"GB/s, duplex={cluster.duplex}")
    print("| config | predicted s | measured s | predicted ratio | measured ratio | pred/meas | "
          "measured ratio (split directions) | pred/meas (split) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for (name, _, ms, ms_split), t in zip(TESTBED, times):
        ratio, meas, meas_split = t / times[0], ms / ring, ms_split / ring_split
        print(f"| {name} | {t:.2f} | {ms / 1e3:.2f} | {ratio:.2f} | {meas:.2f} | {ratio / meas:.2f} | "
              f"{meas_split:.2f} | {ratio / meas_split:.2f} |")


if __name__ == "__main__":
    main()
