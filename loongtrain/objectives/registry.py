"""The objectives' registry (docs/design.md#how-to-add-an-objective): each ``--objective`` name and its entry
(:class:`~loongtrain.objectives.base.ObjectiveSpec`: its options, their validation, its data reader and checks, its
recipe, its memory phases). The commands, the planner's command and the launcher ask the registry, never the name.

:data:`ObjectiveSection` is ``loongtrain train``'s objective section: ``objective`` (the name) and every
registered objective's options, each once (options of the same name are shared: ``--chat-template`` is SFT's and
DPO's), in the registry's order. :func:`validate_objective` checks the name, the choices, that an option given
belongs to the objective chosen, and then the objective's own rules.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from loongtrain._options import flag, option
from loongtrain.model.memory import MemoryTerm
from loongtrain.objectives import dpo, grpo, pretrain, sft
from loongtrain.objectives.base import ObjectiveSpec, TrainConfig

#: every objective, in the order of ``--objective``'s choices
OBJECTIVES: dict[str, ObjectiveSpec] = {spec.name: spec for spec in (pretrain.SPEC, sft.SPEC, dpo.SPEC, grpo.SPEC)}
DEFAULT = pretrain.PRETRAIN


def objective_names() -> tuple[str, ...]:
    """The registered names, in order."""
    return tuple(OBJECTIVES)


def objective_spec(name: str) -> ObjectiveSpec:
    """The entry of ``--objective name``; ValueError naming the choices otherwise."""
    if name not in OBJECTIVES:
        raise ValueError(f"--objective={name!r} is not one of {objective_names()}")
    return OBJECTIVES[name]


def _option_fields() -> dict[str, tuple[dataclasses.Field, Any, tuple[str, ...]]]:
    """Every objective option: its field, its type and the objectives it belongs to."""
    out: dict[str, tuple[dataclasses.Field, Any, tuple[str, ...]]] = {}
    for spec in OBJECTIVES.values():
        if spec.options is None:
            continue
        hints = typing.get_type_hints(spec.options)
        for f in dataclasses.fields(spec.options):
            field, kind, owners = out.get(f.name, (f, hints[f.name], ()))
            out[f.name] = (field, kind, (*owners, spec.name))
    return out


_OPTIONS = _option_fields()
_HELP = ("what the run trains on: " + ", ".join(spec.help for spec in OBJECTIVES.values()))

#: ``loongtrain train``'s objective section (module docstring)
ObjectiveSection = dataclasses.make_dataclass(
    "ObjectiveSection",
    [("objective", str, option(DEFAULT, group="post-training", help=_HELP))]
    + [(name, kind, dataclasses.field(default=field.default, metadata=field.metadata))
       for name, (field, kind, _) in _OPTIONS.items()])
ObjectiveSection.__module__ = __name__  # pickled by name (local workers receive the run's config)
ObjectiveSection.__doc__ = "The objective and every registered objective's options (module docstring)."


def option_owners(name: str) -> tuple[str, ...]:
    """The objectives an objective option belongs to."""
    return _OPTIONS[name][2]


def validate_objective(cfg: TrainConfig) -> None:
    """``--objective`` names a registered objective, its options' choices hold, an option given (not its
    default) belongs to the objective chosen, and the objective's own rules (before any worker)."""
    section = cfg.objective
    spec = objective_spec(section.objective)
    for name, (field, _, owners) in _OPTIONS.items():
        value, choices = getattr(section, name), field.metadata.get("choices")
        if choices and value not in choices:
            raise ValueError(f"{flag(name)}={value!r} is not one of {choices}")
        if value != field.default and spec.name not in owners:
            raise ValueError(f"{flag(name)} applies to --objective {' or '.join(owners)}, not "
                             f"--objective {spec.name}")
    spec.validate(cfg)


def objective_memory(name: str) -> tuple[MemoryTerm, ...]:
    """The memory phases of ``--objective name`` when planning (:meth:`ObjectiveSpec.memory`)."""
    return objective_spec(name).memory()
