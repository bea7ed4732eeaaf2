"""The distributed tests' launcher: :func:`loongtrain.parallel.workers.run_local` on gloo, 1 thread per rank."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from loongtrain.parallel.workers import run_local


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 600.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; return results by rank.

    ``fn`` must be importable (module level). A rank's exception fails the call with its rank and
    traceback (:class:`~loongtrain.parallel.workers.WorkerError`); a hang fails it after ``timeout`` seconds.
    """
    return run_local(fn, world_size, *args, backend="gloo", threads=1, timeout=timeout)
