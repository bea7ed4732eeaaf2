"""Run a function on N local gloo ranks (CPU, 1 thread each) and collect each rank's return value."""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_CTX = mp.get_context("forkserver")
# torch._dynamo: imported by the first custom-op call (about 1.4 s); pay it once in the server
_CTX.set_forkserver_preload(["torch", "torch._dynamo", "loongtrain"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        dist.barrier()
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - report any failure to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 600.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; return results by rank.

    ``fn`` must be importable (module level). A rank's exception fails the call with its traceback;
    a hang fails it after ``timeout`` seconds.
    """
    for attempt in range(3):
        port = free_port()
        queue = _CTX.Queue()
        procs = [
            _CTX.Process(target=_worker, args=(r, world_size, port, fn, args, queue), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        errors = []
        try:
            for _ in range(world_size):
                rank, status, value = queue.get(timeout=timeout)
                if status == "ok":
                    results[rank] = value
                else:
                    errors.append((rank, value))
                    break
        finally:
            for p in procs:
                p.join(timeout=5 if not errors else 0.5)
                if p.is_alive():
                    p.kill()
        if errors and "EADDRINUSE" in errors[0][1] and attempt < 2:
            continue
        if errors:
            rank, tb = errors[0]
            raise AssertionError(f"rank {rank} failed:\n{tb}")
        return [results[r] for r in range(world_size)]
    raise AssertionError("unreachable")
