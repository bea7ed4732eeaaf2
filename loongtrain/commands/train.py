"""``loongtrain train [--config FILE] [--option VALUE ...]``: the options are the fields of
:class:`~loongtrain.launch.config.TrainConfig` (docs/configuration.md). Exit codes as every command's
(:mod:`loongtrain.commands.errors`): 0 done, 2 a user error (before any worker starts, or raised inside one),
1 a failure (a worker died, a full disk, the run stopped after ``--max-bad-steps`` non-finite steps),
130 / 143 Ctrl-C / SIGTERM (workers stopped, no partial checkpoint left)."""

from __future__ import annotations

import sys
from pathlib import Path

from loongtrain.commands.errors import guarded
from loongtrain.commands.parser import naming_the_file, parse
from loongtrain.launch.config import TrainConfig

DESCRIPTION = ("Train a LLaMA-style or Hugging Face model with 2D-Attention (hp x cp sequence parallelism, dp "
               "replicas on top).")


def parse_args(argv: list[str]) -> TrainConfig:
    """TrainConfig from command-line arguments (and the TOML file they name), validated; given neither ``--hp`` nor
    ``--cp`` (nor ``--plan auto``, which picks them), the layout follows the run's world size
    (:func:`~loongtrain.train.config.world_layout`: one GPU trains at hp = cp = 1). Raises ValueError."""
    from loongtrain.train.config import LAYOUT_OPTIONS, world_layout

    values = parse(TrainConfig, argv, "loongtrain train", DESCRIPTION, tables=("train",))
    cfg = TrainConfig.from_dict(values)
    cfg.check_options()  # no torch yet: the world size below may need it (the GPUs)
    if not set(LAYOUT_OPTIONS) & set(values) and not cfg.runtime.plan:
        from loongtrain.launch.train_run import world_size_for  # torch: once the command line has parsed

        hp, cp = world_layout(world_size_for(cfg))
        cfg = cfg.replace(hp=hp, cp=cp)
    cfg.validate()
    return cfg


def main(argv: list[str] | None = None) -> int:
    """Parse, validate (before any worker starts) and run; the exit code (module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    out_dir: list[str] = []

    def body() -> None:
        with naming_the_file(TrainConfig, argv, ("train",)):
            cfg = parse_args(argv)  # imports no torch: an argument error answers at once (docs/configuration.md)
            out_dir.append(cfg.output.out_dir)
            from loongtrain.launch.train_run import launch

            launch(cfg)

    def interrupted() -> str:
        removed = remove_partial_checkpoints(out_dir[0]) if out_dir else 0
        return f"removed {removed} partial checkpoint(s)" if removed else ""

    def failed() -> None:  # a save that failed (a full disk) leaves no step_N.tmp
        if out_dir:
            remove_partial_checkpoints(out_dir[0])

    return guarded("train", body, on_interrupt=interrupted, on_failure=failed)


def remove_partial_checkpoints(out_dir: str) -> int:
    """Delete the ``step_N.tmp`` directories an interrupted save left in ``out_dir`` (the workers are
    gone by now); return how many."""
    from loongtrain.train.checkpoint import remove_stale_tmp

    root = Path(out_dir) / "checkpoints"
    return len(remove_stale_tmp(root)) if root.is_dir() else 0


if __name__ == "__main__":
    sys.exit(main())
