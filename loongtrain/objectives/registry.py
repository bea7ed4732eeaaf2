"""The objectives' registry (docs/design.md#how-to-add-an-objective): each ``--objective`` name and its entry
(:class:`~loongtrain.objectives.base.ObjectiveSpec`: its options, their validation, its data reader and checks, its
recipe, its memory phases). The commands, the planner's command and the launcher ask the registry, never the name.

The names, the options and ``loongtrain train``'s objective section are declared apart, without any objective's
code (:mod:`loongtrain.objectives.options`, so that parsing a command line imports nothing heavy); the registry
checks that each entry's options are the ones declared there. :func:`validate_objective` checks the name, the
choices, that an option given belongs to the objective chosen, and then the objective's own rules.
"""

from __future__ import annotations

from loongtrain.model.memory import MemoryTerm
from loongtrain.objectives import dpo, grpo, pretrain, sft
from loongtrain.objectives.base import ObjectiveSpec, TrainConfig
from loongtrain.objectives.options import CATALOGUE, DEFAULT, check_objective_section, objective_names

#: every objective, in the order of ``--objective``'s choices
OBJECTIVES: dict[str, ObjectiveSpec] = {spec.name: spec for spec in (pretrain.SPEC, sft.SPEC, dpo.SPEC, grpo.SPEC)}
assert list(OBJECTIVES) == list(CATALOGUE) and all(spec.options is CATALOGUE[name][0] and spec.help ==
                                                   CATALOGUE[name][1] for name, spec in OBJECTIVES.items()), \
    "each registered objective's options and help are its entry in loongtrain/objectives/options.py's CATALOGUE"
__all__ = ["DEFAULT", "OBJECTIVES", "objective_memory", "objective_names", "objective_spec", "validate_objective"]


def objective_spec(name: str) -> ObjectiveSpec:
    """The entry of ``--objective name``; ValueError naming the choices otherwise."""
    if name not in OBJECTIVES:
        raise ValueError(f"--objective={name!r} is not one of {objective_names()}")
    return OBJECTIVES[name]


def validate_objective(cfg: TrainConfig) -> None:
    """The objective section's own checks (:func:`~loongtrain.objectives.options.check_objective_section`: the
    name, the choices, an option given belongs to the objective chosen), then the objective's rules (before any
    worker)."""
    check_objective_section(cfg.objective)
    objective_spec(cfg.objective.objective).validate(cfg)


def objective_memory(name: str, lora: str = "") -> tuple[MemoryTerm, ...]:
    """The memory phases of ``--objective name`` when planning (:meth:`ObjectiveSpec.memory`)."""
    return objective_spec(name).memory(lora)
