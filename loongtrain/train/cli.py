"""``loongtrain train [--config FILE] [--option VALUE ...]``: options are the fields of TrainConfig."""

from __future__ import annotations

import sys

from loongtrain.parallel.workers import WorkerError
from loongtrain.train.config import parse_args
from loongtrain.train.launch import launch


def main(argv: list[str] | None = None) -> int:
    """Parse, validate (before any worker starts) and run; 0 on success, 2 on a user error, 1 on a failure
    (a worker failed, or the run stopped after --max-bad-steps non-finite steps)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg = parse_args(argv)
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    except ValueError as exc:
        print(f"loongtrain train: error: {exc}", file=sys.stderr)
        return 2
    try:
        launch(cfg)
    except ValueError as exc:
        print(f"loongtrain train: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("loongtrain train: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - a worker failed: report it, exit non-zero
        print(f"loongtrain train: training failed: {exc}", file=sys.stderr)
        summary = _summary(exc)
        if summary:
            print(f"loongtrain train: {summary}", file=sys.stderr)
        return 1
    return 0


def _summary(exc: Exception) -> str:
    """One closing line for a worker failure: the failing rank and the last line of its traceback."""
    if not isinstance(exc, WorkerError):
        return ""
    lines = [line for line in exc.details.strip().splitlines() if line.strip()]
    return f"rank {exc.rank} failed: {lines[-1].strip() if lines else 'no details'}"


if __name__ == "__main__":
    sys.exit(main())
