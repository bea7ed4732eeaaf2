"""``loongtrain train [--config FILE] [--option VALUE ...]``: options are the fields of TrainConfig."""

from __future__ import annotations

import sys
from pathlib import Path

from loongtrain._input import Terminated, interrupted, stop_on_sigterm, user_error
from loongtrain.launch.train_run import launch
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
        return interrupted("train", exc, f"removed {removed} partial checkpoint(s)" if removed else "")
    except WorkerError as exc:
        remove_partial_checkpoints(cfg.out_dir)  # a save that failed (a full disk) leaves no step_N.tmp
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


__all__ = ["Terminated", "main", "remove_partial_checkpoints", "stop_on_sigterm"]


def remove_partial_checkpoints(out_dir: str) -> int:
    """Delete the ``step_N.tmp`` directories an interrupted save left in ``out_dir`` (the workers are
    gone by now); return how many."""
    from loongtrain.train.checkpoint import remove_stale_tmp

    root = Path(out_dir) / "checkpoints"
    return len(remove_stale_tmp(root)) if root.is_dir() else 0


if __name__ == "__main__":
    sys.exit(main())
