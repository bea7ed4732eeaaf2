"""Worker failures (docs/launching.md): which ones a restart can fix, and the one tests inject.

:func:`restartable` looks through an exception, the exceptions it was raised from, and the per-rank
failures a wrapper carries, for a cause that fails every attempt alike (a user error, a full disk, NaN
training).

:func:`kill_point` is the test hook that kills one worker at a chosen step, for the restart tests.
``LOONGTRAIN_KILL_AT=RANK:STEP``: global rank RANK sends itself SIGKILL just before it runs optimizer
step STEP (1-based), in a run that started from step 0. ``RANK:STEP:agent`` first kills its parent, the
torchrun agent of its node (as when a node is lost; the node's other workers end with their agent). A
resumed attempt never fires, so a restart from a checkpoint before STEP finishes (with STEP at or before
the first checkpoint, every attempt dies).
"""

from __future__ import annotations

import errno
import functools
import os
import signal
import time

#: errno values a restart cannot fix (the disk stays full)
_PERMANENT_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


def causes(exc: BaseException) -> list[BaseException]:
    """``exc``, its ``__cause__``/``__context__`` chain, and the per-rank failures that wrapper exceptions
    carry (``torch.distributed.checkpoint``'s CheckpointException: ``failures = {rank: (exc, trace)}``)."""
    seen: list[BaseException] = []
    todo = [exc]
    while todo:
        e = todo.pop(0)
        if e is None or any(e is s for s in seen) or len(seen) > 64:
            continue
        seen.append(e)
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [e.__cause__, None if e.__suppress_context__ else e.__context__]
    return [e for e in seen if isinstance(e, BaseException)]


def restartable(exc: BaseException) -> tuple[bool, BaseException]:
    """``(False, cause)`` when ``exc`` (or an exception it wraps) is one a restart cannot fix: a
    ValueError (a user error), an exception class with ``restartable = False`` (e.g. the trainer's
    NonFiniteError), or an OSError of a full disk or read-only filesystem; else ``(True, exc)``."""
    for cause in causes(exc):
        if isinstance(cause, ValueError) or getattr(type(cause), "restartable", True) is False or (
                isinstance(cause, OSError) and cause.errno in _PERMANENT_ERRNOS):
            return False, cause
    return True, exc


def one_line(exc: BaseException) -> str:
    """``"Type: first line of the message"``."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


# ----------------------------------------------------------------------------- the injected failure

ENV = "LOONGTRAIN_KILL_AT"


@functools.lru_cache(maxsize=4)
def _parse(spec: str) -> tuple[int, int, bool]:
    parts = spec.split(":")
    try:
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "agent"):
            raise ValueError
        return int(parts[0]), int(parts[1]), len(parts) == 3
    except ValueError:
        raise ValueError(f"{ENV}={spec!r}: expected RANK:STEP or RANK:STEP:agent, e.g. 3:12") from None


def kill_point(step: int, start_step: int) -> None:
    """SIGKILL this process (and first its parent, with ``:agent``) if ``LOONGTRAIN_KILL_AT`` names its
    rank and ``step`` (only when the run started at step 0)."""
    spec = os.environ.get(ENV)
    if not spec or start_step != 0:
        return
    rank, at, agent = _parse(spec)
    from loongtrain.parallel import runtime  # torch: only where a fault is planted

    me = runtime.rank()
    if step == at and me == rank:
        if agent:  # a lost node: its agent gone first (this process reparented), then its workers
            parent = os.getppid()
            os.kill(parent, signal.SIGKILL)
            deadline = time.monotonic() + 5.0
            while os.getppid() == parent and time.monotonic() < deadline:
                time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)
