"""The one local launcher: run a function on N processes of this machine inside one process group.

:func:`run_local` is used by ``loongtrain train`` (local workers), the distributed tests, the benchmarks
and the calibration (docs/launching.md). Design:

- Start: a ``forkserver`` whose server imported torch once; each worker forks from it (fresh
  interpreter state, no N-fold import, safe with CUDA).
- Rendezvous: a ``FileStore`` in a temporary directory (no TCP port to pick, so no port race).
- Results: each worker sends ``("ok", value)`` or ``("error", traceback)`` over its own pipe; the
  launcher also watches every process, so a rank that dies without reporting (killed, segfault,
  out of memory) is noticed at once and named.
- Heartbeat (``parallel/liveness.py``): each worker's thread writes a byte on its own pipe every
  ``min(1 s, heartbeat_timeout / 4)``; a rank silent for ``heartbeat_timeout`` seconds (stopped, frozen
  or swapping) fails the run by name, while its peers, blocked waiting for it, keep beating.
- Failure: the first failure stops the run; the other ranks are killed and :class:`WorkerError`
  carries the failing rank's number and traceback (the cause, not a peer that failed because of
  it), its cause in one line, and whether a restart could fix it (:func:`restartable`: not a user
  error, a full disk, or an exception class marked ``restartable = False``). No result within
  ``timeout`` raises ``TimeoutError``.
- Orphans (``parallel/liveness.py``): workers die with the launcher, however it ends (SIGKILL
  included): each worker's thread waits for end-of-file on a lifeline pipe that only the launcher holds.

Why not ``torch.distributed.elastic.multiprocessing.start_processes``: it does return per-rank values
and stop the other ranks on a failure, but a rank's traceback comes back only through its JSON error
file (an internal format), it needs a log directory spec, logs its own failure report, and it neither
ties workers to the launcher's life nor initialises the process group; the part it would save is
the ~40-line wait loop below.
"""

from __future__ import annotations

import datetime
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from loongtrain.parallel.failures import one_line, restartable
from loongtrain.parallel.liveness import Heartbeats, heartbeat_period, start_worker_threads
from loongtrain.parallel.mesh import destroy_all_meshes

BACKENDS = ("gloo", "nccl", "cuda:nccl,cpu:gloo")  # the last: NCCL, and gloo for host tensors
# torch._dynamo is imported by the first custom-op call (over a second): pay for it once, in the server
_PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "loongtrain", "loongtrain.parallel.workers")
_JOIN_GRACE_S = 60.0
_SETTLE_S = 0.5


class WorkerError(RuntimeError):
    """A rank raised an exception or died; ``rank`` names it, ``details`` is its traceback or exit status.

    ``error``: the cause in one line (``"OSError: [Errno 28] No space left on device"``; for a death, how
    it died); ``kind``: the cause's exception class name ("" for a death); ``restartable``: False when a
    restart would fail the same way (:func:`restartable`)."""

    def __init__(self, rank: int, world_size: int, details: str, error: str = "", kind: str = "",
                 restartable: bool = True) -> None:
        super().__init__(f"rank {rank} of {world_size} failed:\n{details}")
        self.rank, self.world_size, self.details = rank, world_size, details
        self.error = error or (details.strip().splitlines() or ["no details"])[-1].strip()
        self.kind, self.restartable = kind, restartable


@dataclass(frozen=True)
class _Spec:
    """What every worker needs besides its rank, ``fn`` and ``args``."""

    backend: str
    init_method: str
    threads: int | None
    timeout_s: float | None  # of each collective
    beat_s: float | None  # heartbeat period
    env: tuple[tuple[str, str], ...]


def resolve_backend(backend: str | None, world_size: int) -> str:
    """``backend``, or the default: NCCL when there are at least ``world_size`` GPUs, else gloo.

    An explicit ``"nccl"`` with fewer GPUs than ranks is a ValueError (one GPU per rank).
    """
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend is None:
        return "nccl" if gpus >= world_size else "gloo"
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: choose one of {BACKENDS}")
    if backend != "gloo" and gpus < world_size:
        raise ValueError(f"backend='nccl' with world_size={world_size} needs one GPU per rank; "
                         f"this machine has {gpus} (use backend='gloo' or fewer ranks)")
    return backend


def run_local(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str | None = None,
    threads: int | None = 1,
    timeout: float | None = 600.0,
    env: Mapping[str, str] | None = None,
    preload: Sequence[str] = (),
    collective_timeout: float | None = None,
    heartbeat_timeout: float | None = 60.0,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local processes; return its values by rank.

    Every worker runs inside an initialised default process group (``backend``: see
    :func:`resolve_backend`; with gloo the workers see no GPU, so they compute on CPU; with NCCL rank
    ``r`` uses ``cuda:r``) with ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE`` set,
    plus ``env``. ``threads``: torch intra- and inter-op threads per worker (``None``: leave them).
    After ``fn`` returns, the ranks meet in a barrier, then every mesh and the process group are
    destroyed. ``fn``, ``args`` and the results must pickle (``fn`` at module level). ``timeout``
    (seconds, ``None``: none) bounds the whole run; ``collective_timeout`` (default: ``timeout``) each
    collective of the process group. ``heartbeat_timeout`` (seconds, ``None``: off): a rank that shows
    no sign of life that long fails the run. ``preload``: extra modules for the fork server to import
    once (only when this process starts its fork server).

    Raises :class:`WorkerError` for the first rank that fails or stops beating (the others are killed)
    and ``TimeoutError`` when the ranks do not all finish in time.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: must be at least 1")
    if threads is not None and threads < 1:
        raise ValueError(f"threads={threads}: must be at least 1 (or None)")
    for name, value in (("timeout", timeout), ("collective_timeout", collective_timeout),
                        ("heartbeat_timeout", heartbeat_timeout)):
        if value is not None and not 0 < value < float("inf"):
            raise ValueError(f"{name}={value}: must be a positive, finite number of seconds (or None)")
    collective_timeout = timeout if collective_timeout is None else collective_timeout
    backend = resolve_backend(backend, world_size)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([*_PRELOAD, *preload])
    with tempfile.TemporaryDirectory(prefix="loongtrain-rdzv-") as tmp:
        beat_s = heartbeat_period(heartbeat_timeout)
        spec = _Spec(backend=backend, init_method=Path(tmp, "store").resolve().as_uri(), threads=threads,
                     timeout_s=collective_timeout, beat_s=beat_s, env=tuple((env or {}).items()))
        procs: list[Any] = []
        conns: list[Connection] = []
        beats: list[Connection] = []
        lifeline, keep_alive = ctx.Pipe(duplex=False)  # never written: closes when this process ends
        ok = False
        try:
            for rank in range(world_size):
                recv, send = ctx.Pipe(duplex=False)
                beat_recv, beat_send = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=_worker, args=(rank, world_size, spec, fn, args, send, lifeline,
                                                         beat_send),
                                   name=f"loongtrain-rank{rank}", daemon=True)
                proc.start()
                send.close()  # the worker holds the only write end: its exit reads as EOF here
                beat_send.close()
                procs.append(proc)
                conns.append(recv)
                beats.append(beat_recv)
            results = _collect(procs, conns, timeout, beats, heartbeat_timeout)
            ok = True
            return results
        finally:
            _stop(procs, grace_s=_JOIN_GRACE_S if ok else 0.0)
            for conn in (*conns, *beats, lifeline, keep_alive):
                conn.close()


def _collect(procs: list[Any], conns: list[Connection], timeout: float | None, beats: list[Connection],
             heartbeat_timeout: float | None) -> list[Any]:
    """Each rank's value; raise on a failure, a death, a silent rank or the deadline.

    A failing rank usually makes its peers fail too (their collectives lose a partner), so after the
    first failure the launcher waits ``_SETTLE_S`` for more reports and names the cause: a rank that
    died without reporting (its peers' errors follow from it), else the earliest error.
    """
    world_size = len(procs)
    deadline = None if timeout is None else time.monotonic() + timeout
    pending = dict(enumerate(conns))
    results: dict[int, Any] = {}
    failures: list[tuple[bool, float, int, str]] = []  # (reported?, wall time, rank, details)
    infos: dict[int, dict[str, Any]] = {}  # rank -> the error report's summary (see _worker)
    settle = None
    heart = Heartbeats(beats, heartbeat_timeout)
    while pending:
        now = time.monotonic()
        if settle is not None and now >= settle:
            break
        if deadline is not None and now >= deadline:
            if failures:
                break
            raise TimeoutError(f"run_local: ranks {sorted(pending)} of {world_size} gave no result within "
                               f"{timeout:g} s (hang?)")
        if settle is None and (silent := heart.silent(pending, now)):
            for rank, details in silent:  # its peers wait on it: nothing more to learn from them
                pending.pop(rank)
                failures.append((False, time.time(), rank, f"{details}; the worker process (pid "
                                 f"{procs[rank].pid}) is stopped (SIGSTOP, a debugger), frozen or swapping"))
            break
        ends = [t for t in (deadline, settle, None if settle else heart.next_expiry(pending)) if t is not None]
        by_conn = {conn: rank for rank, conn in pending.items()}
        by_sentinel = {procs[rank].sentinel: rank for rank in pending}  # novermin (Process.sentinel: 3.3+)
        for ready in wait([*by_conn, *by_sentinel, *heart.conns], timeout=max(0.0, min(ends) - now) if ends else None):
            if heart.read(ready):
                continue
            rank = by_sentinel[ready] if isinstance(ready, int) else by_conn[ready]
            if rank not in pending:
                continue
            status, value, stamp, *info = _receive(pending.pop(rank), procs[rank])
            infos[rank] = info[0] if info else {}
            if status == "ok":
                results[rank] = value
            else:
                failures.append((status == "error", stamp, rank, value))
                settle = settle or time.monotonic() + _SETTLE_S
    if failures:
        _, _, rank, details = min(failures)
        info = infos.get(rank, {})
        raise WorkerError(rank, world_size, details, info.get("error", ""), info.get("kind", ""),
                          info.get("restartable", True))
    return [results[rank] for rank in range(world_size)]


def _receive(conn: Connection, proc: Any) -> tuple[str, Any, float]:
    """A rank's report ``(status, value, wall time)``, or ``("died", how, now)`` when it exited without one."""
    if conn.poll():
        try:
            return pickle.loads(conn.recv_bytes())
        except EOFError:
            pass
    proc.join(timeout=5)
    code = proc.exitcode
    if code is not None and code < 0:
        how = f"killed by {signal.Signals(-code).name}" + (" (out of memory?)" if -code == signal.SIGKILL else "")
    else:
        how = f"exited with code {code}"
    return "died", f"the worker process {how} without reporting a result", time.time()


def _stop(procs: list[Any], grace_s: float) -> None:
    """Wait up to ``grace_s`` for the workers to exit, then kill the rest."""
    deadline = time.monotonic() + grace_s
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join(timeout=5)


# ----------------------------------------------------------------------------- the worker side


def _worker(rank: int, world_size: int, spec: _Spec, fn: Callable[..., Any], args: tuple,
            conn: Connection, lifeline: Connection, beat: Connection) -> None:
    start_worker_threads(lifeline, beat, spec.beat_s)
    _name_process(f"lt-rank{rank}")
    os.environ.update(dict(spec.env))
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    if spec.backend == "gloo":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # gloo ranks compute on CPU (read when CUDA initialises)
    if spec.threads is not None:
        _set_threads(spec.threads)
    try:
        kwargs: dict[str, Any] = {}
        if spec.timeout_s is not None:
            kwargs["timeout"] = datetime.timedelta(seconds=spec.timeout_s)
        if spec.backend != "gloo":
            torch.cuda.set_device(rank)
            kwargs["device_id"] = torch.device("cuda", rank)  # binds the group to this rank's GPU
        dist.init_process_group(spec.backend, init_method=spec.init_method, rank=rank,
                                world_size=world_size, **kwargs)
        result = fn(rank, world_size, *args)
        dist.barrier()  # nobody tears down groups a slower rank still talks on
        conn.send_bytes(_report("ok", result))
    except BaseException as exc:  # noqa: BLE001 - every failure goes to the launcher, which stops the run
        again, cause = restartable(exc)
        conn.send_bytes(_report("error", traceback.format_exc(),
                                {"error": one_line(cause), "kind": type(cause).__name__, "restartable": again}))
        conn.close()
        os._exit(1)  # skip teardown: the other ranks may be blocked in a collective
    conn.close()
    _teardown()


def _report(status: str, value: Any, info: dict[str, Any] | None = None) -> bytes:
    """A report as plain pickle bytes: tensors travel by value. (The connection's own pickler would send
    them as shared-memory file descriptors, which are lost when the worker exits before the launcher
    has read them: ``ConnectionResetError`` on a busy machine.)"""
    return pickle.dumps((status, value, time.time(), info or {}))


def _teardown() -> None:
    destroy_all_meshes()
    dist.destroy_process_group()


def _set_threads(threads: int) -> None:
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(threads)
    except RuntimeError:  # the inter-op pool already started (only possible if the server used it)
        pass


def _name_process(name: str) -> None:
    """Show ``name`` as this process's name in ps/top (Linux; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
        except (OSError, AttributeError):
            pass
