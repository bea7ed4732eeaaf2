"""The sections every training run has (:class:`TrainSections`) and the run the launcher resolves from them
(:class:`Run`); docs/configuration.md.

``loongtrain train``'s config is :class:`~loongtrain.launch.config.TrainConfig`: these sections and the
objective's own (from :mod:`loongtrain.objectives`' registry). Its options keep their flat names on the command
line and in TOML files (the parser flattens the sections: ``--seq-len`` sets ``data.seq_len``, ``--hp`` sets
``parallel.hp``); :meth:`TrainSections.to_dict` and :meth:`TrainSections.from_dict` speak those flat names (what
checkpoints record), :meth:`TrainSections.replace` changes options by them.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, TypeVar

from loongtrain._options import option
from loongtrain.model.config import ModelConfig
from loongtrain.parallel.config import ParallelConfig
from loongtrain.sections.data import DataSection
from loongtrain.sections.model import ModelSection
from loongtrain.sections.stages import stage_totals
from loongtrain.sections.training import EvaluationSection, OptimSection, OutputSection, RuntimeSection

if TYPE_CHECKING:
    from loongtrain.data.tokenizer import Tokenizer

#: ``loongtrain train``'s parallel defaults: 4 workers as hp=2 x cp=2 (ParallelConfig's own are 1 x 1); without
#: ``--hp``/``--cp`` the command line's layout follows the world size instead (:func:`world_layout`)
DEFAULT_PARALLEL = ParallelConfig(hp=2, cp=2)
#: the options that give a run's layout; given neither, ``loongtrain train`` takes :func:`world_layout`
LAYOUT_OPTIONS = ("hp", "cp")


def world_layout(world: int) -> tuple[int, int]:
    """``(hp, cp)`` of a ``loongtrain train`` run given neither ``--hp`` nor ``--cp`` on ``world`` ranks: hp=2 x
    cp=2 where the world is a multiple of 4 (the CPU quickstart's four workers; 4-rank replicas beyond), one
    context ring of 2 where it is even, else one rank a replica (one GPU: hp = cp = 1)."""
    if world % 4 == 0:
        return DEFAULT_PARALLEL.hp, DEFAULT_PARALLEL.cp
    return (1, 2) if world % 2 == 0 else (1, 1)
#: the one section recorded nested (``"parallel": {...}``) in :meth:`TrainSections.to_dict`, as always
NESTED = "parallel"
_MLP = {"gate_proj", "up_proj", "down_proj", "w1", "w2", "w3", "all-linear"}

Sections = TypeVar("Sections", bound="TrainSections")

#: what a resumed run may do with an option (``option(..., resume=RULE)``): ``keep`` it (it changes the loss, the
#: data the loss is computed on, or the optimizer's update rule), ``new_run``: keep it on a resume, while a new run
#: from the weights (``--init-from``) may change it (the length and the RoPE), or ``free``ly change it (the layout,
#: the run's length, logging, intervals)
RESUME_RULES = {"keep": "a resumed run must keep it",
                "new_run": "a resumed run must keep it; --init-from starts a new run that may change it",
                "free": "a resumed run may change it"}


@dataclass
class TrainSections:
    """The options of a training run by section; each section's fields are options of their own (``--seq-len``
    sets ``data.seq_len``)."""

    model: ModelSection = option(factory=ModelSection, help="the model and how it computes")
    data: DataSection = option(factory=DataSection, help="the corpus, the sequences and the batch")
    optim: OptimSection = option(factory=OptimSection, help="steps, AdamW, the schedule, seeds")
    parallel: ParallelConfig = option(DEFAULT_PARALLEL, "degrees, placement, ZeRO and recompute", resume="free")
    runtime: RuntimeSection = option(factory=RuntimeSection, help="processes, the plan, timeouts, restarts",
                                     resume="free")
    output: OutputSection = option(factory=OutputSection, help="the output directory, checkpoints and logging",
                                   resume="free")
    evaluation: EvaluationSection = option(factory=EvaluationSection, help="validation and in-loop evaluations",
                                           resume="free")

    def validate(self) -> None:
        """Raise ValueError for values that are wrong whatever the machine (ranges, choices, combinations)."""
        if not isinstance(self.parallel, ParallelConfig):  # a ParallelConfig validated itself when built
            raise ValueError(f"parallel={self.parallel!r} must be a ParallelConfig")
        self.data.validate(self.optim.steps)
        self.optim.validate()
        self.runtime.validate()
        self.output.validate()
        self.evaluation.validate()
        self.model.validate()
        lora = self.model.lora_config()
        if lora is not None and lora.dropout and str(self.parallel.mlp_tiles) != "1" and _MLP & set(lora.targets):
            raise ValueError(f"--lora dropout={lora.dropout:g} on MLP modules with --mlp-tiles "
                             f"{self.parallel.mlp_tiles}: the tiles' recompute would draw new dropout masks; use "
                             f"--mlp-tiles 1, dropout=0, or attention targets only")

    @classmethod
    def sections(cls) -> dict[str, type]:
        """Each section's field name and its dataclass."""
        return _sections(cls)

    @classmethod
    def resume_rules(cls) -> dict[str, str]:
        """Each option's rule on a resume (:data:`RESUME_RULES`), as its field declares it (``option(...,
        resume=...)``), else as its section's field does for all of the section's options; ValueError naming an
        option that declares none (every option says whether a continuation must keep it)."""
        outer = {f.name: f.metadata.get("resume") for f in fields(cls)}
        rules = {}
        for name, kind in cls.sections().items():
            for g in fields(kind):
                rule = g.metadata.get("resume", outer[name])
                if rule not in RESUME_RULES:
                    raise ValueError(f"option --{g.name.replace('_', '-')} of section {name!r} declares no resume "
                                     f"rule (option(..., resume=...): one of {tuple(RESUME_RULES)})")
                rules[g.name] = rule
        return rules

    @classmethod
    def option_sections(cls) -> dict[str, str]:
        """Each option's name and the section holding it."""
        return {g.name: name for name, kind in cls.sections().items() for g in fields(kind)}

    def to_dict(self) -> dict[str, Any]:
        """Flat option values, ``parallel`` as a nested dict (what checkpoints record; :meth:`from_dict` reads it)."""
        out: dict[str, Any] = {}
        for name in self.sections():
            values = dataclasses.asdict(getattr(self, name))
            if name == NESTED:
                out[name] = values
            else:
                out.update(values)
        return out

    @classmethod
    def from_dict(cls: type[Sections], values: Mapping[str, Any]) -> Sections:
        """A config from option names (underscores): any section's options given flat, ParallelConfig's also as a
        ``parallel`` mapping (flat names win). Options not given keep their defaults (``DEFAULT_PARALLEL`` for the
        parallel ones); a ``--seq-len-stages`` gives ``--steps`` and ``--seq-len`` unless they are given.
        ValueError naming an unknown option."""
        flat = dict(values)
        nested = flat.pop(NESTED, None) or {}
        if isinstance(nested, ParallelConfig):
            nested = dataclasses.asdict(nested)
        where = cls.option_sections()
        unknown = sorted(set(nested) - {k for k, v in where.items() if v == NESTED})
        if unknown:
            raise ValueError(f"unknown parallel option(s) {unknown}; valid: "
                             f"{sorted(k for k, v in where.items() if v == NESTED)}")
        stages = flat.get("seq_len_stages")
        if isinstance(stages, str) and stages:
            steps, longest = stage_totals(stages)  # what the stages make of --steps, --seq-len
            flat.setdefault("steps", steps)
            flat.setdefault("seq_len", longest)
        return cls().replace(**{**nested, **flat})

    @classmethod
    def recorded(cls: type[Sections], values: Mapping[str, Any]) -> Sections:
        """:meth:`from_dict` of a run's recorded options (a checkpoint's ``config``), keeping only the options of
        these sections (the objective's are its own section's)."""
        known = cls.option_sections()
        return cls.from_dict({k: v for k, v in values.items() if k in known or k == NESTED})

    def replace(self: Sections, **options: Any) -> Sections:
        """This config with the options named (flat, as on the command line) changed; ValueError naming an
        unknown one."""
        where = self.option_sections()
        unknown = sorted(set(options) - set(where))
        if unknown:
            raise ValueError(f"invalid TrainConfig option(s) {unknown}")
        changes: dict[str, dict[str, Any]] = {}
        for name, value in options.items():
            changes.setdefault(where[name], {})[name] = value
        return dataclasses.replace(self, **{section: dataclasses.replace(getattr(self, section), **given)
                                            for section, given in changes.items()})


@functools.cache
def _sections(cls: type) -> dict[str, type]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls)}


@dataclass(frozen=True)
class Run:
    """A run resolved once by the launcher before any worker starts (docs/launching.md): the options, the
    model's shape, the objective (a recipe the trainer builds on its step context:
    :class:`~loongtrain.train.objective.ObjectiveRecipe`, from :mod:`loongtrain.objectives`' registry), the
    tokenizer (None: the batch source needs none), the checkpoint to resume from ("" for a fresh start), the
    in-loop evaluations (``--eval-tasks``: callables the launch path builds from the evaluation tasks,
    :class:`~loongtrain.train.validation.Evaluation`; ``train`` does not import them) and the identity of its
    data (the corpus's content and the tokenizer's, which every checkpoint records and a resume compares; None
    when not known). :class:`~loongtrain.train.trainer.Trainer` is built from it."""

    cfg: TrainSections
    model_config: ModelConfig
    objective: Any
    tokenizer: Tokenizer | None = None
    resume: str = ""
    evaluations: tuple[Any, ...] = ()
    data_identity: dict[str, Any] | None = None
