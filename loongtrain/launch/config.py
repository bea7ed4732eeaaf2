"""``TrainConfig``: the single source of every ``loongtrain train`` option (docs/configuration.md): the sections
every run has (:class:`~loongtrain.train.config.TrainSections`: model, data, optimisation, parallel, processes,
output, evaluation) and the objective's own (:data:`~loongtrain.objectives.options.ObjectiveSection`, from the
objectives' registry).

The command-line parser, its ``--help`` text and the TOML config file are generated from the sections' fields
(:mod:`loongtrain.commands.parser`), each option under its flat name (``--seq-len``, ``--hp``, ``--dpo-beta``), so a
new option is one new field of its section. Precedence: field default < TOML file < command line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from loongtrain._options import option
from loongtrain.objectives.options import ObjectiveSection, check_objective_section
from loongtrain.train.config import Run, TrainSections

if TYPE_CHECKING:  # the registry holds the objectives' code: imported once a command line has parsed
    from loongtrain.model.config import ModelConfig
    from loongtrain.objectives.base import ObjectiveSpec


@dataclass
class TrainConfig(TrainSections):
    """Every option of a training run, by section (:class:`~loongtrain.train.config.TrainSections`), and the
    objective's section."""

    objective: ObjectiveSection = option(factory=ObjectiveSection, help="the objective and its options",
                                         resume="keep")  # an objective's options change its loss

    def validate(self) -> None:
        """Raise ValueError for values that are wrong whatever the machine (ranges, choices, combinations, the
        objective's rules)."""
        self.check_options()
        from loongtrain.objectives.registry import validate_objective

        validate_objective(self)

    def check_options(self) -> None:
        """The sections' and the objective section's own checks: they import no torch, so their errors answer at
        once (docs/configuration.md)."""
        super().validate()
        check_objective_section(self.objective)

    def spec(self) -> ObjectiveSpec:
        """The objective's registry entry."""
        from loongtrain.objectives.registry import objective_spec

        return objective_spec(self.objective.objective)


def run_of(cfg: TrainConfig, model_config: ModelConfig, **resolved: Any) -> Run:
    """The :class:`~loongtrain.train.config.Run` of ``cfg`` on ``model_config``: its objective's recipe from the
    registry, and what the launcher ``resolved`` (``tokenizer``, ``resume``, ``evaluations``, ``data_identity``)."""
    return Run(cfg, model_config, cfg.spec().recipe(cfg), **resolved)
