"""How every ``loongtrain`` command ends (docs/configuration.md): one line on stderr and an exit code.

:func:`guarded` runs a command's body and maps what escapes it: 0 done; 2 a user error (``ValueError``, a
missing package with the extra that installs it, an OS error on a path the user gave: read-only, a link
loop, ...), raised in this process or inside a worker; 1 a failure (a full disk, a worker that died,
training that stopped on non-finite steps); 128 + the signal for Ctrl-C or SIGTERM (130, 143), after the
command's own clean-up. The same handler serves one process and many.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["Terminated", "failure", "guarded", "interrupted", "one_line", "stop_on_sigterm", "user_error"]

#: the pip extra that provides each optional package (the one-line hint of a missing import)
EXTRAS = {"transformers": "hf", "safetensors": "hf", "tokenizers": "hf", "datasets": "hf", "peft": "hf",
          "matplotlib": "viz", "tensorboard": "viz", "tqdm": "viz"}


def one_line(exc: BaseException | str) -> str:
    """An error message on one line (libraries' multi-line messages joined with " | ")."""
    return " | ".join(line.strip() for line in str(exc).strip().splitlines() if line.strip())


def user_error(command: str, exc: BaseException | str) -> int:
    """Print ``loongtrain COMMAND: error: MESSAGE`` (:func:`one_line`) to stderr; the exit code of a user
    error, 2."""
    print(f"loongtrain {command}: error: {one_line(exc)}", file=sys.stderr)
    return 2


def failure(command: str, exc: BaseException | str) -> int:
    """Print ``loongtrain COMMAND: failed: MESSAGE`` (:func:`one_line`; e.g. a full disk); exit code 1."""
    print(f"loongtrain {command}: failed: {one_line(exc)}", file=sys.stderr)
    return 1


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread like SIGINT's KeyboardInterrupt (so ``finally`` blocks remove
    temporary files and workers are stopped)."""


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """While inside: SIGTERM raises :class:`Terminated` in the main thread. Elsewhere (a thread), and
    under torchrun (its agent owns the signals), nothing changes."""
    if threading.current_thread() is not threading.main_thread() or ("RANK" in os.environ
                                                                      and "WORLD_SIZE" in os.environ):
        yield
        return

    def _raise(signum: int, frame: Any) -> None:
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def interrupted(command: str, exc: BaseException, detail: str = "") -> int:
    """Print ``loongtrain COMMAND: interrupted`` (SIGINT) or ``terminated (SIGTERM)``, plus ``detail``, on
    one line; the exit code, 128 + the signal (130 or 143)."""
    term = isinstance(exc, Terminated)
    what = "terminated (SIGTERM)" if term else "interrupted"
    print(f"loongtrain {command}: {what}{'; ' + detail if detail else ''}", file=sys.stderr)
    return 128 + (signal.SIGTERM if term else signal.SIGINT)


def missing_package(exc: ImportError) -> str:
    """``ImportError`` as one line naming the package and the extra that installs it."""
    name = (exc.name or "").split(".")[0]
    extra = EXTRAS.get(name)
    hint = f": pip install 'loongtrain[{extra}]'" if extra else ""
    return f"{name or 'a package'} is not installed{hint}" if name else one_line(exc)


def os_error(exc: OSError) -> str:
    """An OS error as one line naming the path and the cause in words (read-only, a link loop, ...)."""
    words = {errno.EROFS: "read-only file system", errno.ELOOP: "a link loop (too many levels of links)",
             errno.EACCES: "permission denied", errno.ENOSPC: "no space left on the device",
             errno.ENOENT: "no such file or directory", errno.ENOTDIR: "not a directory",
             errno.EISDIR: "is a directory"}
    cause = words.get(exc.errno or -1, exc.strerror or str(exc))
    return f"{exc.filename!s}: {cause}" if exc.filename else cause


def guarded(command: str, body: Callable[[], int | None], *,
            on_interrupt: Callable[[], str] | None = None, on_failure: Callable[[], None] | None = None) -> int:
    """Run ``body`` (a command; its return value is the exit code, None for 0) and end as the module
    docstring says. ``on_interrupt``: clean-up after Ctrl-C / SIGTERM, returning the words it adds to the
    line (``"removed 1 partial checkpoint(s)"``); ``on_failure``: clean-up after any other error."""
    from loongtrain._files import DiskFullError

    try:
        with stop_on_sigterm():
            return int(body() or 0)
    except SystemExit as exc:  # --help
        return int(exc.code or 0) if isinstance(exc.code, int) or exc.code is None else user_error(command, exc.code)
    except KeyboardInterrupt as exc:
        return interrupted(command, exc, on_interrupt() if on_interrupt else "")
    except BaseException as exc:  # every other way out: one line, and the clean-up
        from loongtrain.parallel.failures import causes

        stop = next((c for c in causes(exc) if isinstance(c, KeyboardInterrupt)), None)
        if stop is not None:  # an interrupt a library wrapped (DCP's CheckpointException): the same line
            return interrupted(command, stop, on_interrupt() if on_interrupt else "")
        if on_failure is not None:
            with contextlib.suppress(BaseException):
                on_failure()
        return _ending(command, exc, DiskFullError, _worker_error())


class _NoWorkers(Exception):
    """Stands for WorkerError when no worker module was imported (so none can have been raised)."""


def _worker_error() -> type:
    """``loongtrain.parallel.workers.WorkerError`` when that module is loaded: never imported here, since it
    imports torch and a Ctrl-C while torch loads must end in this module's one line."""
    workers = sys.modules.get("loongtrain.parallel.workers")
    return getattr(workers, "WorkerError", _NoWorkers)


def _ending(command: str, exc: BaseException, disk_full: type, worker_error: type) -> int:
    if isinstance(exc, disk_full):
        return failure(command, exc)
    if isinstance(exc, ValueError):
        return user_error(command, exc)
    if isinstance(exc, ImportError):
        return user_error(command, missing_package(exc))
    if isinstance(exc, OSError):
        if exc.errno == errno.ENOSPC:
            return failure(command, os_error(exc))
        return user_error(command, os_error(exc))
    if isinstance(exc, worker_error):
        what = "error" if exc.kind == "ValueError" else "failed"
        print(f"loongtrain {command}: {what}: rank {exc.rank} of {exc.world_size}: {exc.error}", file=sys.stderr)
        return 2 if exc.kind == "ValueError" else 1
    if isinstance(exc, Exception):
        return failure(command, exc)
    raise exc
