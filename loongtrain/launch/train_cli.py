"""``loongtrain train [--config FILE] [--option VALUE ...]``: options are the fields of TrainConfig."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from loongtrain._input import user_error
from loongtrain.launch.train_run import launch, under_torchrun
from loongtrain.parallel.workers import WorkerError
from loongtrain.train.config import parse_args


def main(argv: list[str] | None = None) -> int:
    """Parse, validate (before any worker starts) and run; 0 on success, 2 on a user error (also one
    raised inside a worker), 1 on a failure (a worker failed, or the run stopped after --max-bad-steps
    non-finite steps), 128 + the signal on SIGINT/SIGTERM (workers stopped, no partial checkpoint left)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg = parse_args(argv)
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    except ValueError as exc:
        return user_error("train", exc)
    try:
        with stop_on_sigterm():
            launch(cfg)
    except ValueError as exc:
        return user_error("train", exc)
    except KeyboardInterrupt as exc:
        removed = remove_partial_checkpoints(cfg.out_dir)
        what = "terminated (SIGTERM)" if isinstance(exc, Terminated) else "interrupted"
        print(f"loongtrain train: {what}" + (f"; removed {removed} partial checkpoint(s)" if removed else ""),
              file=sys.stderr)
        return 128 + (signal.SIGTERM if isinstance(exc, Terminated) else signal.SIGINT)
    except WorkerError as exc:
        if not exc.restartable:  # the cause, once: a user error, a full disk, NaN training
            print(f"loongtrain train: {'error' if exc.kind == 'ValueError' else 'training failed'}: rank "
                  f"{exc.rank} of {exc.world_size}: {exc.error}", file=sys.stderr)
            return 2 if exc.kind == "ValueError" else 1
        print(f"loongtrain train: training failed: {exc}", file=sys.stderr)
        print(f"loongtrain train: rank {exc.rank} failed: {exc.error}", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - the run failed in this process: report it, exit non-zero
        print(f"loongtrain train: training failed: {exc}", file=sys.stderr)
        return 1
    return 0


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread like SIGINT's KeyboardInterrupt (so the workers are stopped)."""


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """While inside: SIGTERM raises :class:`Terminated` in the main thread (local launcher only; under
    torchrun its agent owns the signals). Elsewhere (a thread, torchrun): nothing changes."""
    if threading.current_thread() is not threading.main_thread() or under_torchrun():
        yield
        return

    def _raise(signum: int, frame: Any) -> None:
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def remove_partial_checkpoints(out_dir: str) -> int:
    """Delete the ``step_N.tmp`` directories an interrupted save left in ``out_dir`` (the workers are
    gone by now); return how many."""
    from loongtrain.train.checkpoint import remove_stale_tmp

    root = Path(out_dir) / "checkpoints"
    return len(remove_stale_tmp(root)) if root.is_dir() else 0


if __name__ == "__main__":
    sys.exit(main())
