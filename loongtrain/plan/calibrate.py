"""Cluster files from measurements: of THIS machine (:func:`calibrate`, ``loongtrain plan --calibrate``), or of a
device run (:func:`calibrate_from_run`, ``loongtrain plan --calibrate-from``, at the end of this file).

This machine as a one-node cluster of ``world`` ranks:

- matmul: ``2 n^3`` FLOPs of an ``n x n`` GEMM per second (best of several runs); memory: bytes read and
  written per second by a large fp32 copy (the memory-bound ops, ``memory_gbyte_s``).
- attention: the kernel the ring uses (:func:`loongtrain.attn.kernel_choice.select_kernel`), causal,
  forward + backward; rate = ``3.5 * 2 * B * S^2 * H * D / seconds`` (the cost model charges the
  forward ``2 B S^2 H D`` and the backward 2.5x at ``attention_tflops``).
- gloo loopback: two local processes exchange a buffer both ways at once (as a ring step does);
  bandwidth = bytes one way / seconds; latency = time of a 4-byte exchange.
Ranks run ``threads`` threads each (tests use 1). When ``world * threads`` exceeds the CPUs, the ranks
share them, so the per-rank FLOP and memory rates are scaled by ``CPUs / (world * threads)`` (what one rank gets
while all compute at once). The measured rates are achieved rates, so ``link_efficiency`` is 1 and
``peak_tflops`` is the matmul rate.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from pathlib import Path

import torch

from loongtrain.attn.kernel_choice import select_kernel
from loongtrain.parallel.workers import run_local
from loongtrain.plan.cluster import Cluster


def _best_time(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_matmul_flops(n: int = 1024, dtype: torch.dtype = torch.float32, repeats: int = 5) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n**3 / _best_time(lambda: torch.mm(a, b), repeats)


def measure_attention_flops(
    seq: int = 1024, heads: int = 4, head_dim: int = 64, dtype: torch.dtype = torch.float32, repeats: int = 3
) -> float:
    kernel = select_kernel(torch.device("cpu"), dtype, head_dim)
    q, k, v = (torch.randn(1, heads, seq, head_dim, dtype=dtype) for _ in range(3))
    scale = head_dim**-0.5

    def run() -> None:
        out, lse = kernel.forward(q, k, v, True, scale)
        kernel.backward(torch.ones_like(out), q, k, v, out, lse, True, scale)

    return 3.5 * 2 * seq**2 * heads * head_dim / _best_time(run, repeats)


def measure_memory_bandwidth(mib: int = 256, repeats: int = 5) -> float:
    """Bytes/s of a large fp32 copy (read + written) on this process's threads: the memory-bound ops' rate."""
    x = torch.randn(mib * 2**20 // 4)
    y = torch.empty_like(x)
    return 2 * x.numel() * 4 / _best_time(lambda: y.copy_(x), repeats)


def _exchange_worker(rank: int, world_size: int, nbytes: int, repeats: int) -> dict[int, float]:
    """Best time of a simultaneous two-way exchange of 4 bytes and of ``nbytes`` with the other rank."""
    import torch.distributed as dist

    times = {}
    for size in (4, nbytes):
        send = torch.zeros(size // 4, dtype=torch.float32)
        recv = torch.empty_like(send)
        peer = 1 - rank

        def step(send=send, recv=recv, peer=peer) -> None:
            ops = [dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        dist.barrier()
        times[size] = _best_time(step, repeats)
    return times


def measure_gloo_loopback(nbytes: int = 32 * 2**20, repeats: int = 5) -> tuple[float, float]:
    """(bytes/s one way, latency seconds) of a simultaneous two-way exchange between 2 local processes."""
    times = run_local(_exchange_worker, 2, nbytes, repeats, backend="gloo", threads=1, timeout=300)[0]
    latency = times[4]
    return nbytes / max(times[nbytes] - latency, 1e-9), latency


def calibrate(world: int = 4, threads: int = 1, name: str = "calibrated") -> Cluster:
    """A one-node cluster of ``world`` ranks with this machine's measured rates."""
    if world < 1 or threads < 1:
        raise ValueError(f"world={world} and threads={threads} must be positive")
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        mm = measure_matmul_flops()
        attn = measure_attention_flops()
        memory = measure_memory_bandwidth()
    finally:
        torch.set_num_threads(previous)
    share = min(1.0, (os.cpu_count() or 1) / (world * threads))  # ranks sharing the CPUs
    mm, attn, memory = mm * share, attn * share, memory * share
    bw, latency = measure_gloo_loopback()
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return Cluster(
        name=name, gpus_per_node=world, memory_gib=round(mem_gib / world, 3),
        peak_tflops=mm / 1e12, matmul_tflops=mm / 1e12, attention_tflops=attn / 1e12,
        intra_node_gbyte_s=bw / 1e9, nic_gbit_s=bw * 8 / 1e9, nics_per_node=world, link_efficiency=1.0,
        intra_latency_us=latency * 1e6, inter_latency_us=latency * 1e6, usable_memory_fraction=0.9,
        host_memory_gib=round(mem_gib, 3), memory_gbyte_s=memory / 1e9,
        duplex=False,  # gloo over TCP
        description=f"this machine, {world} local ranks x {threads} thread(s) on {os.cpu_count()} CPUs "
                    f"(FLOP rates x {share:.2f} for sharing), gloo loopback (measured)",
    )


# --------------------------------------------------------------------------------------------------
# A cluster file from a device run (python -m benchmarks.gpu_check --out FILE)

#: the measurements a cluster file takes from a gpu_check run, by section (nothing else is read: the training
#: section's step times, in particular, are what a calibrated planner is checked against, never an input)
CALIBRATION_SECTIONS = {"attention": "attention kernel FLOP/s by call size", "matmul": "matmul FLOP/s",
                        "memory_bandwidth": "device-memory GB/s"}


def _section(run: dict, name: str, where: str) -> dict | None:
    value = run.get(name)
    if value is None or (isinstance(value, dict) and ("error" in value or value.get("skipped"))):
        return None
    if not isinstance(value, dict):
        raise ValueError(f"{where}: section {name!r} is not an object")
    return value


def _number(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{where} = {value!r} must be a positive number")
    return float(value)


def attention_rows(run: dict, where: str) -> list[tuple[float, float, float]]:
    """``[head_dim, head_tokens, TFLOP/s]`` of the kernel the ring chooses, from the run's ``attention`` section
    (one row per measured call: ``D``, ``S * H``, forward + backward) or, in runs before it, its
    ``throughput`` section (points at ``S`` with its ``H`` and ``D``). Empty when neither is there."""
    section = _section(run, "attention", where)
    if section is not None:
        rows = []
        for i, row in enumerate(section.get("chosen", [])):
            key = f"{where}: attention.chosen[{i}]"
            if not isinstance(row, dict) or not {"D", "S", "H", "tflops"} <= set(row):
                raise ValueError(f"{key} must have D, S, H and tflops")
            rows.append((_number(row["D"], f"{key}.D"), _number(row["S"], f"{key}.S") * _number(row["H"], f"{key}.H"),
                         _number(row["tflops"], f"{key}.tflops")))
        return rows
    section = _section(run, "throughput", where)
    if section is None:
        return []
    heads, dim = (_number(section.get(k), f"{where}: throughput.{k}") for k in ("H", "D"))
    points = section.get("points") or []
    return [(dim, _number(p.get("S"), f"{where}: throughput.points[{i}].S") * heads,
             _number(p.get("tflops"), f"{where}: throughput.points[{i}].tflops")) for i, p in enumerate(points)]


def read_run(path: str | Path) -> dict:
    """A gpu_check run (its JSON output) with attention kernel timings; ValueError naming what is missing
    when the file is not a gpu_check output or lacks the kernel sections."""
    path = Path(path)
    where = f"--calibrate-from {str(path)!r}"
    try:
        run = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{where}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{where}: not a gpu_check JSON output ({exc})") from None
    if not isinstance(run, dict) or not isinstance(run.get("environment"), dict):
        raise ValueError(f"{where}: not a gpu_check output (no 'environment' section; write one with "
                         f"`python -m benchmarks.gpu_check --out FILE`)")
    if not attention_rows(run, where):
        raise ValueError(f"{where}: lacks the kernel sections: no attention kernel timings ('attention' or "
                         f"'throughput' with points)")
    return run


def calibrate_from_run(path: str | Path, base: Cluster) -> tuple[Cluster, list[str]]:
    """:func:`calibrated` from the gpu_check JSON at ``path`` (:func:`read_run`'s errors for a bad file)."""
    path = Path(path)
    return calibrated(read_run(path), base, path.name, where=f"--calibrate-from {str(path)!r}")


def calibrated(run: dict, base: Cluster, source: str, where: str = "gpu_check run") -> tuple[Cluster, list[str]]:
    """``base`` with the rates the gpu_check ``run`` measured (:data:`CALIBRATION_SECTIONS`): the attention kernel's
    rates by call size (``attention_rates``; ``attention_tflops`` the rate of its largest call), the matmul
    rate (the median of the measured shapes) and the device-memory bandwidth; what the run did not measure
    stays the base's, and the returned notes say which. ``source`` names the run in the description."""
    rows = attention_rows(run, where)
    if not rows:
        raise ValueError(f"{where}: lacks the kernel sections: no attention kernel timings")
    values: dict[str, object] = {"attention_rates": tuple(rows),
                                 "attention_tflops": max(rows, key=lambda r: (r[0] == 128, r[1]))[2]}
    notes = [f"attention_rates, attention_tflops: {len(rows)} measured call sizes"]
    matmul = _section(run, "matmul", where)
    if matmul and matmul.get("points"):
        rates = sorted(_number(p.get("tflops"), f"{where}: matmul.points[{i}].tflops")
                       for i, p in enumerate(matmul["points"]))
        values["matmul_tflops"] = rates[len(rates) // 2]
        notes.append(f"matmul_tflops: median of {len(rates)} measured shapes")
    else:
        notes.append(f"matmul_tflops: {base.matmul_tflops:g} from {base.name} (not measured in this run)")
    memory = _section(run, "memory_bandwidth", where)
    if memory and "gbyte_s" in memory:
        values["memory_gbyte_s"] = _number(memory["gbyte_s"], f"{where}: memory_bandwidth.gbyte_s")
        notes.append("memory_gbyte_s: measured copy bandwidth")
    else:
        notes.append(f"memory_gbyte_s: {base.memory_gbyte_s:g} from {base.name} (not measured in this run)")
    env = run["environment"]
    device = env.get("name", env.get("device", "?"))
    values["description"] = (f"{base.description}; rates calibrated from {source} ({device}, torch "
                             f"{env.get('torch', '?')}): " + "; ".join(notes))
    return dataclasses.replace(base, **values), notes
