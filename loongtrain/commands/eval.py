"""``loongtrain eval MODEL --task passkey|position-loss ...`` (docs/evaluation.md): the options are the
fields of :class:`~loongtrain.eval.config.EvalConfig`. Exit codes: 0 ok, 2 bad input (one line, before any
worker starts; ``--out`` in use by another eval), 1 a worker failed or the disk is full (one line),
130 / 143 Ctrl-C / SIGTERM (one line)."""

from __future__ import annotations

import contextlib
import os
import sys

from loongtrain.commands.errors import guarded
from loongtrain.commands.parser import build, naming_the_file, parse
from loongtrain.eval.config import EvalConfig

DESCRIPTION = ("Long-context evaluation of a trained model, sharded with 2D-Attention like training: loss by "
               "position, or passkey retrieval (depth x length).")


def parse_args(argv: list[str]) -> EvalConfig:
    """EvalConfig from the command line (and the TOML file it names); ValueError naming the bad value."""
    return build(EvalConfig, parse(EvalConfig, argv, "loongtrain eval", DESCRIPTION, tables=("eval",)))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def body() -> None:
        from loongtrain._files import OutputLock
        from loongtrain.eval.config import OUTPUT
        from loongtrain.launch.eval_run import launch, prepare
        from loongtrain.launch.torchrun import under_torchrun
        from loongtrain.launch.train_run import setup_logging

        setup_logging(int(os.environ.get("RANK", 0)), False)
        with naming_the_file(EvalConfig, argv, ("eval",)):
            job = prepare(parse_args(argv))
            # one writer of --out (loongtrain._files); under torchrun every rank is its own process
            with contextlib.nullcontext() if under_torchrun() else OutputLock(OUTPUT, job.options.out):
                launch(job)

    return guarded("eval", body)


if __name__ == "__main__":
    sys.exit(main())
