"""Which worker failures a restart can fix (docs/design.md §10): :func:`restartable` looks through an
exception, the exceptions it was raised from, and the per-rank failures a wrapper carries, for a cause
that fails every attempt alike (a user error, a full disk, NaN training)."""

from __future__ import annotations

import errno

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
