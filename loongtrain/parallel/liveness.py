"""Signs of life between the local launcher and its workers: heartbeat and lifeline (docs/launching.md).

Used by :func:`loongtrain.parallel.workers.run_local`, one pair of pipes per worker:

- Heartbeat: each worker's daemon thread writes a byte on its own pipe every ``heartbeat_timeout / 4``
  seconds (at most 1 s, :func:`heartbeat_period`); a rank silent for ``heartbeat_timeout`` seconds is
  stopped (SIGSTOP, a debugger), frozen (a C call holding the GIL) or swapping, and fails the run by
  name (:class:`Heartbeats`, the launcher's side). Its peers, blocked in a collective waiting for it,
  keep beating, so the rank named is the cause.
- Lifeline: workers die with the launcher, however it ends (SIGKILL included). The launcher holds
  the write end of a pipe that it never writes; each worker blocks a watchdog thread on the read
  end, which reads end-of-file the moment the kernel closes the launcher's files, and exits. This
  is plain POSIX, so it is the same on Linux and macOS, and it also covers a launcher that died
  before the worker started. (``prctl(PR_SET_PDEATHSIG)`` would not do: a worker's parent is the
  fork server, not the launcher, and the fork server stays alive as long as any worker does,
  because every forkserver child inherits the fd the server watches for its clients.)

:func:`start_worker_threads` starts a worker's side of both.
"""

from __future__ import annotations

import os
import threading
import time
from multiprocessing.connection import Connection
from typing import Any


def heartbeat_period(heartbeat_timeout: float | None) -> float | None:
    """Seconds between a worker's beats for ``heartbeat_timeout`` (``None``: no heartbeat)."""
    return None if heartbeat_timeout is None else min(1.0, heartbeat_timeout / 4)


# ----------------------------------------------------------------------------- the launcher side


class Heartbeats:
    """Each rank's last sign of life, read from its heartbeat pipe (no pipes when ``timeout`` is None)."""

    def __init__(self, beats: list[Connection], timeout: float | None) -> None:
        self.timeout = timeout
        self.conns = {conn: rank for rank, conn in enumerate(beats)} if timeout is not None else {}
        self.last = {rank: time.monotonic() for rank in range(len(beats))}

    def read(self, ready: Any) -> bool:
        """Take the bytes waiting on ``ready`` if it is a heartbeat pipe (else False)."""
        if ready not in self.conns:
            return False
        self.last[self.conns[ready]] = time.monotonic()
        try:
            while ready.poll():
                ready.recv_bytes()
        except (EOFError, OSError):  # the worker ended; its sentinel or report tells how
            del self.conns[ready]
        return True

    def silent(self, pending: dict[int, Any], now: float) -> list[tuple[int, str]]:
        """``(rank, why)`` of the pending ranks silent for longer than the timeout."""
        if self.timeout is None:
            return []
        return [(rank, f"no heartbeat for {now - self.last[rank]:.1f} s (heartbeat_timeout={self.timeout:g} s)")
                for rank in sorted(pending) if now - self.last[rank] > self.timeout]

    def next_expiry(self, pending: dict[int, Any]) -> float | None:
        if self.timeout is None or not pending:
            return None
        return min(self.last[rank] for rank in pending) + self.timeout + 0.01


# ----------------------------------------------------------------------------- the worker side


def start_worker_threads(lifeline: Connection, beat: Connection, period_s: float | None) -> None:
    """Start the worker's lifeline thread and, unless ``period_s`` is None, its heartbeat thread."""
    threading.Thread(target=_exit_when_closed, args=(lifeline,), name="loongtrain-lifeline", daemon=True).start()
    if period_s is not None:
        threading.Thread(target=_beat, args=(beat, period_s), name="loongtrain-heartbeat", daemon=True).start()


def _beat(beat: Connection, period_s: float) -> None:
    """Write one byte every ``period_s`` seconds until the launcher's end closes."""
    try:
        while True:
            beat.send_bytes(b".")
            time.sleep(period_s)
    except OSError:  # the launcher is gone (the lifeline thread ends this process)
        pass


def _exit_when_closed(lifeline: Connection) -> None:
    """Block until the launcher's end of ``lifeline`` closes (it never writes), then end this worker."""
    try:
        lifeline.recv_bytes()
    except (EOFError, OSError):
        pass
    os._exit(1)
