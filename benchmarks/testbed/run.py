"""Scaled emulated cluster on one machine: 2 "nodes" x 4 ranks, one shaped veth "NIC" per rank.

Run as root from the repository root (never in CI)::

    .venv/bin/python benchmarks/testbed/run.py [--seq-len 8192] [--rate MBIT] [--iters 3] ...

It builds the namespaces (netns.py), starts 8 gloo ranks (worker.py, 1 thread each) inside
them, calibrates one rank's attention FLOP/s with all ranks computing at once, shapes every NIC
so that FLOP per transferred element matches a GPU cluster (default: A100, 312 TFLOP/s bf16
dense, 200 Gb/s NIC per GPU), times forward+backward of ``loongtrain.attention`` for each
configuration, optionally again with the NICs unshaped (the compute-only baseline), prints a
markdown table and tears everything down (also on error or Ctrl-C).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))

import netns  # noqa: E402

CONFIGS = [
    # name, hp, cp, inner_ring, placement
    ("ring", 1, 8, 1, "context_first"),
    ("dring-w4", 1, 8, 4, "context_first"),
    ("dring-w2", 1, 8, 2, "context_first"),
    ("2d-hf", 2, 4, 1, "head_first"),
    ("2d-hf-w2", 2, 4, 2, "head_first"),
    ("2d-cf", 2, 4, 1, "context_first"),
    ("2d-cf-w2", 2, 4, 2, "context_first"),
]
MASTER_PORT = 29517  # inside our own namespace: nothing else listens there


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--iters", type=int, default=3, help="timed iterations per config (median reported)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rate", type=float, default=None,
                   help="NIC rate in Mbit/s (per rank, each direction); default: derived from calibration")
    p.add_argument("--gpu-tflops", type=float, default=312.0, help="GPU dense TFLOP/s to emulate (A100 bf16)")
    p.add_argument("--gpu-nic-gbps", type=float, default=200.0, help="GPU cluster NIC Gbit/s per GPU")
    p.add_argument("--gpu-elem-bytes", type=int, default=2,
                   help="bytes per element on the GPU wire (bf16: 2); the rate is scaled by "
                        "(testbed element bytes / this) so FLOP per element sent matches")
    p.add_argument("--delay-ms", type=float, default=0.0, help="one-way NIC delay (needs netem)")
    p.add_argument("--calib-seconds", type=float, default=4.0)
    p.add_argument("--no-baseline", action="store_true", help="skip the unshaped (compute-only) pass")
    p.add_argument("--split-directions", action="store_true",
                   help="extra shaped pass where 2-member ring exchanges send and receive on two "
                        "process groups (one TCP connection per direction); an experiment, see README")
    p.add_argument("--no-recalibrate", action="store_true",
                   help="derive the rate once at the start instead of before every shaped config")
    p.add_argument("--configs", default="all", help="comma-separated config names, or 'all'")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before the run is aborted")
    p.add_argument("--teardown", action="store_true", help="only remove leftover namespaces and exit")
    p.add_argument("--json", type=Path, default=None, help="also write a per-config summary (JSON) here")
    return p.parse_args(argv)


class Cluster:
    """Owns the namespaces and the rank processes; ``close()`` is idempotent and runs at exit."""

    def __init__(self, topo: netns.Topology):
        self.topo = topo
        self.procs: list[subprocess.Popen] = []
        self.tmp = Path(tempfile.mkdtemp(prefix="lt-testbed-"))
        self.tmp.chmod(0o1777)  # HOME/TMPDIR of the unprivileged rank processes
        self.closed = False
        atexit.register(self.close)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for proc in self.procs:  # only processes this run started, by their Popen handle
            if proc.poll() is None:
                proc.terminate()
        deadline = time.time() + 10
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        netns.teardown(self.topo)
        shutil.rmtree(self.tmp, ignore_errors=True)


def start_ranks(cluster: Cluster, spec: dict, events: queue.Queue) -> None:
    topo = cluster.topo
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HOME=str(cluster.tmp),
               TMPDIR=str(cluster.tmp), PYTHONDONTWRITEBYTECODE="1")
    env.pop("GLOO_SOCKET_IFNAME", None)
    for rank in range(topo.world):
        rank_spec = dict(spec, rank=rank, uid=topo.uid(rank), iface=topo.nic(rank))
        uid = str(topo.uid(rank))
        # own uid (for the node's uidrange routing rule), no privileges except reading files:
        # the interpreter may live under a root-only directory (e.g. /root/.pyenv)
        cmd = ["ip", "netns", "exec", topo.node_ns(topo.node_of(rank)),
               "setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
               "--inh-caps=+dac_read_search", "--ambient-caps=+dac_read_search",
               sys.executable, str(HERE / "worker.py"), json.dumps(rank_spec)]
        log = open(cluster.tmp / f"rank{rank}.err", "w")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        cluster.procs.append(proc)
        threading.Thread(target=_pump, args=(rank, proc, events), daemon=True).start()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _pump(rank: int, proc: subprocess.Popen, events: queue.Queue) -> None:
    for line in proc.stdout:
        try:
            events.put(json.loads(line))
        except json.JSONDecodeError:
            print(f"[rank {rank}] {line.rstrip()}", file=sys.stderr)
    events.put({"event": "exit", "rank": rank})


def derive_rate(args: argparse.Namespace, flops_per_rank: float) -> tuple[float, dict]:
    """NIC bit/s that keeps the GPU cluster's FLOP per wire element at this machine's FLOP/s."""
    elem_bytes = 2 if args.dtype == "bfloat16" else 4
    gpu_flops = args.gpu_tflops * 1e12
    gpu_nic_bytes = args.gpu_nic_gbps * 1e9 / 8
    flop_per_byte = gpu_flops / gpu_nic_bytes
    rate_bytes = flops_per_rank / flop_per_byte * elem_bytes / args.gpu_elem_bytes
    info = {
        "gpu_flop_per_byte": flop_per_byte,
        "gpu_flop_per_element": flop_per_byte * args.gpu_elem_bytes,
        "testbed_flop_per_byte": flops_per_rank / rate_bytes,
        "testbed_flop_per_element": flops_per_rank / rate_bytes * elem_bytes,
    }
    return rate_bytes * 8, info


def fmt_mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.2f}"


def print_report(args, argv, results, rate_bps, calib, rate_info, configs, wall, config_rates) -> None:
    by = {}
    for r in results:
        by.setdefault((r["phase"], r["config"]), []).append(r)
    shaped = {name: by[("shaped", name)] for name, *_ in configs}
    base_ms = statistics.median(r["median_s"] for r in shaped[configs[0][0]]) * 1e3
    cmd = " ".join([".venv/bin/python", "benchmarks/testbed/run.py", *argv])
    print()
    print(f"Command: `{cmd}`")
    print(f"Shape: S={args.seq_len}, H={args.heads}, Hkv={args.kv_heads}, D={args.head_dim}, {args.dtype}, "
          f"causal, world 8 = 2 nodes x 4 ranks, 1 thread per rank, {os.cpu_count()} CPUs; "
          f"median of {args.iters} timed fwd+bwd iterations (slowest rank per iteration).")
    print(f"Calibration (all 8 ranks computing at once, {calib['kernel']}): per-rank attention "
          f"{statistics.median(calib['flops']) / 1e9:.2f} GFLOP/s (min {min(calib['flops']) / 1e9:.2f}, "
          f"max {max(calib['flops']) / 1e9:.2f}); one rank alone (same block, 1 thread) "
          f"{calib['alone'] / 1e9:.2f}. Same calibration at the end of the run: "
          f"{statistics.median(calib.get('end', [float('nan')])) / 1e9:.2f} GFLOP/s per rank "
          "(drift = other load on the machine; see the per-config column).")
    if rate_info:
        print(f"NIC rate (last derived): {rate_bps / 1e6:.2f} Mbit/s per rank per direction = testbed "
              f"{rate_info['testbed_flop_per_byte']:.0f} FLOP/byte, "
              f"{rate_info['testbed_flop_per_element']:.0f} "
              f"FLOP/element (GPU: {rate_info['gpu_flop_per_byte']:.0f} FLOP/byte, "
              f"{rate_info['gpu_flop_per_element']:.0f} FLOP/element).")
    elif rate_bps > 0:
        print(f"NIC rate: {rate_bps / 1e6:.2f} Mbit/s per rank per direction (--rate).")
    else:
        print("NIC rate: unshaped (--rate 0).")
    print(f"Total wall time {wall:.0f} s.")
    print()
    head = ("| config | hp x cp | inner_ring | placement | GFLOP/s/rank | NIC Mbit/s | median ms "
            "| split-directions ms | unshaped ms | network ms "
            "| cross-node MB/rank (max / mean) | intra-node MB/rank (mean) | NIC tx MB/rank (max) "
            "| blocked ms (mean) | CPU busy | ratio vs ring |")
    print(head)
    print("|" + "|".join(["---"] * (head.count("|") - 1)) + "|")
    for name, hp, cp, inner_ring, placement in configs:
        rows = shaped[name]
        ms = statistics.median(r["median_s"] for r in rows) * 1e3  # identical on all ranks
        split = by.get(("shaped-split", name))
        split_ms = statistics.median(r["median_s"] for r in split) * 1e3 if split else None
        base = by.get(("unshaped", name))
        ums = statistics.median(r["median_s"] for r in base) * 1e3 if base else None
        cross = [r["cross_bytes"] for r in rows]
        intra = [r["intra_bytes"] for r in rows]
        tx = [r["nic_tx_per_iter"] for r in rows]
        cpu = statistics.mean(r["cpu_frac"] for r in rows)
        blocked = statistics.mean(r["blocked_s"] for r in rows) * 1e3
        cfg_rate, cfg_flops = config_rates.get(name, (rate_bps, statistics.median(calib["flops"])))
        print(f"| {name} | {hp} x {cp} | {inner_ring} | {placement} | {cfg_flops / 1e9:.1f} | {cfg_rate / 1e6:.2f} | "
              f"{ms:.0f} | {f'{split_ms:.0f}' if split_ms else '-'} | "
              f"{f'{ums:.0f}' if ums else '-'} | {f'{ms - ums:.0f}' if ums else '-'} | "
              f"{fmt_mb(max(cross))} / {fmt_mb(statistics.mean(cross))} | {fmt_mb(statistics.mean(intra))} | "
              f"{fmt_mb(max(tx))} | {blocked:.0f} | {cpu:.2f} | {ms / base_ms:.2f} |")
    print()
    cats = ["kv-intra", "kv-cross", "dkv-intra", "dkv-cross", "a2a"]
    print("Blocked time per iteration by category (shaped run, ms; mean over ranks / max over ranks):")
    print()
    print("| config | " + " | ".join(cats) + " |")
    print("|" + "|".join(["---"] * (len(cats) + 1)) + "|")
    for name, *_ in configs:
        rows = shaped[name]
        cells = []
        for cat in cats:
            vals = [r.get("blocked_by", {}).get(cat, 0.0) * 1e3 for r in rows]
            cells.append(f"{statistics.mean(vals):.0f} / {max(vals):.0f}")
        print(f"| {name} | " + " | ".join(cells) + " |")
    print()
    print("GFLOP/s/rank: calibration just before the config (all ranks at once); NIC Mbit/s: the rate "
          "derived from it (unless --rate). median ms: shaped NICs; split-directions ms: shaped, with "
          "--split-directions (2-member ring exchanges on two groups, one per direction); "
          "unshaped ms: same run with no tc shaping (compute + loopback only); "
          "network ms = difference. Bytes are per fwd+bwd iteration, counted by CommCounter "
          "(node = rank // 4); NIC tx = bytes the rank's veth actually sent per timed iteration "
          "(incl. TCP/IP headers and barriers). blocked ms = time a rank waits on ring exchanges "
          "and inside all-to-alls per iteration (shaped run), mean over ranks. CPU busy = process "
          "CPU time / wall time, mean over ranks (8 ranks share the CPUs).")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if os.geteuid() != 0:
        print("benchmarks/testbed/run.py needs root (network namespaces, veth, tc); it is a manual "
              "benchmark and never runs in CI. Run it as root: .venv/bin/python benchmarks/testbed/run.py",
              file=sys.stderr)
        return 2
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            print(f"'{tool}' not found: apt-get install -y iproute2", file=sys.stderr)
            return 2
    topo = netns.Topology()
    if args.teardown:
        print("removed:", netns.teardown(topo) or "nothing")
        return 0
    configs = CONFIGS if args.configs == "all" else [c for c in CONFIGS if c[0] in args.configs.split(",")]
    if not configs or configs[0][0] != "ring":
        configs = [CONFIGS[0]] + [c for c in configs if c[0] != "ring"]  # the ratio's reference
    if args.seq_len % (2 * topo.world) != 0:
        print(f"--seq-len must be a multiple of {2 * topo.world}", file=sys.stderr)
        return 2

    def on_signal(signum, _frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)

    started = time.time()
    alone = _single_rank_flops(args)
    cluster = Cluster(topo)
    try:
        netns.setup(topo, 0, 0.0)  # unshaped while the ranks start and calibrate
        spec = {
            "world": topo.world, "per_node": topo.per_node, "master": topo.address(0), "port": MASTER_PORT,
            "repo": str(REPO), "seq_len": args.seq_len, "heads": args.heads, "kv_heads": args.kv_heads,
            "head_dim": args.head_dim, "dtype": args.dtype, "iters": args.iters,
            "warmup": max(1, args.warmup), "calib_seconds": args.calib_seconds,
            "phases": ["shaped"] + (["shaped-split"] if args.split_directions else [])
                      + ([] if args.no_baseline else ["unshaped"]),
            "recalibrate": not args.no_recalibrate,
            "configs": [dict(zip(("name", "hp", "cp", "inner_ring", "placement"), c, strict=True))
                        for c in configs],
        }
        events: queue.Queue = queue.Queue()
        start_ranks(cluster, spec, events)
        results, calib, rate_bps, rate_info, exited = [], None, None, None, set()
        config_rates: dict[str, tuple[float, float]] = {}
        phase_flops: dict[str, dict[str, float]] = {}  # phase -> config -> calibrated FLOP/s per rank
        phase = ""
        deadline = started + args.timeout
        while len(exited) < topo.world:
            try:
                ev = events.get(timeout=max(1.0, deadline - time.time()))
            except queue.Empty:
                raise RuntimeError(f"timed out after {args.timeout:.0f} s") from None
            kind = ev["event"]
            if kind == "calibration" and ev["when"].startswith("config:"):
                name, flops = ev["when"].split(":", 1)[1], statistics.median(ev["flops"])
                if phase == "shaped-split" and name in config_rates:
                    rate_bps = config_rates[name][0]  # same rate as the config's shaped pass
                    netns.shape(topo, rate_bps, args.delay_ms)
                elif args.rate is None:
                    rate_bps, rate_info = derive_rate(args, flops)
                    netns.shape(topo, rate_bps, args.delay_ms)
                config_rates.setdefault(name, (rate_bps, flops))
                phase_flops.setdefault(phase, {})[name] = flops
                log(f"  {name}: {flops / 1e9:.2f} GFLOP/s per rank -> NIC rate {rate_bps / 1e6:.2f} Mbit/s")
                cluster.procs[0].stdin.write("go\n")
                cluster.procs[0].stdin.flush()
            elif kind == "calibration" and ev["when"] == "end":
                calib["end"] = ev["flops"]
                log(f"calibrated again at the end: {statistics.median(ev['flops']) / 1e9:.2f} GFLOP/s per rank")
            elif kind == "calibration":
                calib = dict(ev, alone=alone)
                if args.rate is not None:
                    rate_bps = args.rate * 1e6
                else:
                    rate_bps, rate_info = derive_rate(args, statistics.median(ev["flops"]))
                log(f"calibrated: {statistics.median(ev['flops']) / 1e9:.2f} GFLOP/s per rank "
                    f"(alone {alone / 1e9:.2f}); NIC rate {rate_bps / 1e6:.2f} Mbit/s")
            elif kind == "ready":
                phase = ev["phase"]
                netns.shape(topo, rate_bps if ev["phase"].startswith("shaped") else 0, args.delay_ms)
                log(f"phase {ev['phase']} ...")
                cluster.procs[0].stdin.write("go\n")
                cluster.procs[0].stdin.flush()
            elif kind == "result":
                results.append(ev)
                if ev["rank"] == 0:
                    log(f"  {ev['phase']:9s} {ev['config']:10s} {ev['median_s'] * 1e3:9.0f} ms "
                        f"{[round(t * 1e3) for t in ev['times_s']]} rank0 blocked "
                        f"{ev['blocked_s'] * 1e3:.0f} ms")
            elif kind == "exit":
                exited.add(ev["rank"])
                code = cluster.procs[ev["rank"]].wait()
                if code != 0:
                    err = (cluster.tmp / f"rank{ev['rank']}.err").read_text()[-3000:]
                    raise RuntimeError(f"rank {ev['rank']} exited with {code}:\n{err}")
        wall = time.time() - started
        if args.json:
            summary = summarize(args, argv, results, configs, config_rates, phase_flops)
            args.json.write_text(json.dumps(summary, indent=1) + "\n")
        print_report(args, argv, results, rate_bps, calib, rate_info, configs, wall, config_rates)
        return 0
    finally:
        cluster.close()


def summarize(args, argv, results, configs, config_rates, phase_flops) -> dict:
    """Per config: layout; NIC rate; per shaped phase, the per-rank FLOP/s calibrated just before it;
    per phase, the median ms (slowest rank per iteration, median over iterations) and the iterations;
    mean blocked ms by category (shaped phase). ``benchmarks/plan_check.py testbed`` reads this."""
    out = {"argv": argv, "seq_len": args.seq_len, "heads": args.heads, "kv_heads": args.kv_heads,
           "head_dim": args.head_dim, "dtype": args.dtype, "iters": args.iters, "per_node": 4, "configs": []}
    for name, hp, cp, inner_ring, placement in configs:
        rate_bps = config_rates.get(name, (0.0, 0.0))[0]
        rows = [r for r in results if r["config"] == name]
        phases = sorted({r["phase"] for r in rows})
        shaped = [r for r in rows if r["phase"] == "shaped"]
        cats = sorted({k for r in shaped for k in r.get("blocked_by", {})})
        out["configs"].append({
            "name": name, "hp": hp, "cp": cp, "inner_ring": inner_ring, "placement": placement,
            "nic_bit_s": rate_bps,
            "flops_per_rank": {ph: f[name] for ph, f in phase_flops.items() if name in f},
            "ms": {ph: statistics.median(r["median_s"] for r in rows if r["phase"] == ph) * 1e3 for ph in phases},
            "times_ms": {ph: [round(t * 1e3) for t in next(r for r in rows if r["phase"] == ph)["times_s"]]
                         for ph in phases},
            "blocked_ms": {c: statistics.mean(r["blocked_by"].get(c, 0.0) for r in shaped) * 1e3 for c in cats},
        })
    return out


def _single_rank_flops(args: argparse.Namespace) -> float:
    """Attention FLOP/s of one process with 1 thread and nothing else of ours running."""
    code = (
        "import sys, time, torch; sys.path.insert(0, sys.argv[1]); torch.set_num_threads(1)\n"
        "from loongtrain.attn.kernel_choice import select_kernel\n"
        "s, h, hk, d, dt, secs = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]),"
        " getattr(torch, sys.argv[6]), float(sys.argv[7])\n"
        "q = torch.randn(1, h, s, d, dtype=dt); k = torch.randn(1, hk, s, d, dtype=dt)\n"
        "v = torch.randn_like(k)\n"
        "kern = select_kernel(q.device, dt, d); n = 0; t = time.perf_counter()\n"
        "while time.perf_counter() - t < secs or n < 2:\n"
        "    o, l = kern.forward(q, k, v, False, d ** -0.5)\n"
        "    kern.backward(o, q, k, v, o, l, False, d ** -0.5)\n"
        "    n += 1\n"
        "print(n * 4 * s * s * h * d * 3.5 / (time.perf_counter() - t))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(REPO), str(args.seq_len // 8), str(args.heads), str(args.kv_heads),
         str(args.head_dim), args.dtype, str(min(args.calib_seconds, 3.0))],
        capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), check=True,
    )
    return float(out.stdout.strip())


if __name__ == "__main__":
    sys.exit(main())
