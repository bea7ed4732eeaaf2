"""``loongtrain plan``: rank 2D-Attention configurations for a model, sequence length and cluster
(docs/planner.md). The options are the fields of :class:`~loongtrain.plan.config.PlanConfig`.

Examples::

    loongtrain plan --model 7b-gqa --seq-len 1M --nodes 8 --cluster a100
    loongtrain plan --model 7b-gqa --gpus 1 --cluster h200 --max-seq-len --json
    loongtrain plan --model 1b --gpus 8 --cluster h200 --seq-len 256K --simulate --json
    loongtrain plan --config my_plan.toml --json
    loongtrain plan --calibrate --calibrate-world 4 --out this_machine.toml
    loongtrain plan --calibrate-from gpu_check.json --out h200-measured.toml

Exit codes: 0 ok, 2 an invalid request or nothing fits (the message names the value and alternatives).
"""

from __future__ import annotations

import sys
from typing import Any

from loongtrain.commands.errors import guarded
from loongtrain.commands.parser import build, naming_the_file, parse
from loongtrain.plan.config import PlanConfig

DESCRIPTION = "Rank 2D-Attention configurations for a model, sequence length and cluster with the cost model."


def parse_plan_args(argv: list[str]) -> PlanConfig:
    """PlanConfig from command-line arguments (and the TOML file they name). Raises ValueError."""
    return build(PlanConfig, parse(PlanConfig, argv, "loongtrain plan", DESCRIPTION, tables=("plan",)))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def body() -> int:
        from loongtrain.objectives.registry import objective_spec
        from loongtrain.plan.report import run

        with naming_the_file(PlanConfig, argv, ("plan",)):
            cfg = parse_plan_args(argv)
            return run(cfg, simulate, objective_spec(cfg.objective).memory(cfg.model_options.lora))

    return guarded("plan", body)


def simulate(model: Any, candidate: Any, cfg: PlanConfig) -> dict:
    """``--simulate``: the trainer's own step under fake tensors (imported only when asked for)."""
    from loongtrain.launch.simulate import simulate_candidate

    return simulate_candidate(model, candidate, cfg)


if __name__ == "__main__":
    sys.exit(main())
