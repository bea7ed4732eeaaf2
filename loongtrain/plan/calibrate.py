"""Measure THIS machine and describe it as a one-node cluster of ``world`` ranks (a TOML file).

- matmul: ``2 n^3`` FLOPs of an ``n x n`` GEMM per second (best of several runs).
- attention: the kernel the ring uses (:func:`loongtrain.attn.kernel_choice.select_kernel`), causal,
  forward + backward; rate = ``3.5 * 2 * B * S^2 * H * D / seconds`` (the cost model charges the
  forward ``2 B S^2 H D`` and the backward 2.5x at ``attention_tflops``).
- gloo loopback: two local processes exchange a buffer both ways at once (as a ring step does);
  bandwidth = bytes one way / seconds; latency = time of a 4-byte exchange.
Ranks run ``threads`` threads each (tests use 1). When ``world * threads`` exceeds the CPUs, the ranks
share them, so the per-rank FLOP rates are scaled by ``CPUs / (world * threads)`` (what one rank gets
while all compute at once). The measured rates are achieved rates, so ``link_efficiency`` is 1 and
``peak_tflops`` is the matmul rate.
"""

from __future__ import annotations

import os
import time

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
    finally:
        torch.set_num_threads(previous)
    share = min(1.0, (os.cpu_count() or 1) / (world * threads))  # ranks sharing the CPUs
    mm, attn = mm * share, attn * share
    bw, latency = measure_gloo_loopback()
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return Cluster(
        name=name, gpus_per_node=world, memory_gib=round(mem_gib / world, 3),
        peak_tflops=mm / 1e12, matmul_tflops=mm / 1e12, attention_tflops=attn / 1e12,
        intra_node_gbyte_s=bw / 1e9, nic_gbit_s=bw * 8 / 1e9, nics_per_node=world, link_efficiency=1.0,
        intra_latency_us=latency * 1e6, inter_latency_us=latency * 1e6, usable_memory_fraction=0.9,
        host_memory_gib=round(mem_gib, 3),
        duplex=False,  # gloo over TCP
        description=f"this machine, {world} local ranks x {threads} thread(s) on {os.cpu_count()} CPUs "
                    f"(FLOP rates x {share:.2f} for sharing), gloo loopback (measured)",
    )
