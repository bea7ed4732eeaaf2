"""The trainer's stream over the seq-len stages (docs/context-extension.md#seq-len-stages; the schedule itself is
:mod:`loongtrain.sections.stages`): :class:`StageStream` opens each stage's data at the step it starts from,
:func:`stage_config` gives the run's options at a stage's length and batch, :func:`check_stage_layouts` checks
every stage against the run's one layout."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from loongtrain.parallel.config import ParallelConfig, validate_parallel
from loongtrain.sections.stages import Stage, stage_at
from loongtrain.train.config import TrainSections

Sections = TypeVar("Sections", bound=TrainSections)


def check_stage_layouts(stages: tuple[Stage, ...], staged: bool, parallel: ParallelConfig, world: int,
                        num_heads: int, num_kv_heads: int, model: str) -> None:
    """Every stage's length suits the one layout of the run (:func:`~loongtrain.parallel.config.validate_parallel`:
    divisible by ``2*hp*cp``, and by the MLP tiles); ValueError naming the stage and the rule."""
    for stage in stages:
        where = f"--seq-len {stage.seq_len}" if not staged else \
            f"--seq-len-stages stage {stage.index + 1} ({stage.seq_len} tokens)"
        try:
            validate_parallel(parallel, world, seq_len=stage.seq_len, num_heads=num_heads, num_kv_heads=num_kv_heads)
        except ValueError as exc:
            raise ValueError(f"--nproc/world size {world}, --hp {parallel.hp} --cp {parallel.cp}, {where}, "
                             f"model {model!r}: {exc}") from exc




def stage_config(cfg: Sections, stage: Stage) -> Sections:
    """``cfg`` with the stage's ``seq_len``, ``batch_size`` and ``grad_accum`` (``cfg`` itself when equal): what the
    data, the validation and the layout checks of that stage use."""
    data = cfg.data
    if (data.seq_len, data.batch_size, data.grad_accum) == (stage.seq_len, stage.batch_size, stage.grad_accum):
        return cfg
    return dataclasses.replace(cfg, data=dataclasses.replace(data, seq_len=stage.seq_len, batch_size=stage.batch_size,
                                                             grad_accum=stage.grad_accum))




#: ``(stage_cfg, start_micro_step) -> iterator of this replica's micro-batches`` (the trainer's batch source)
OpenStream = Callable[[Any, int], Iterator[Any]]


class StageStream:
    """This replica's micro-batches across the stages: the stream of the stage being trained, opened at the
    step it starts from (``step * grad_accum``, module docstring) and replaced at each stage boundary.

    It also keeps ``tokens_seen`` (input tokens each corpus supplied to all replicas): the closed stages'
    tokens plus the open stream's since its stage began (a stream counts from its own step 0). A
    checkpoint records the stage and that total (:meth:`state`), so :meth:`start` continues it."""

    def __init__(self, cfg: TrainSections, stages: tuple[Stage, ...], open_stream: OpenStream) -> None:
        self.cfg, self.stages, self.open_stream = cfg, stages, open_stream
        self.stage = stages[0]
        self.batches: Iterator[Any] = iter(())
        self._closed: dict[str, int] = {}  # tokens of the stages before this one
        self._opened_at: dict[str, int] = {}  # the open stream's count at its stage's first step

    def start(self, step: int, state: dict[str, Any]) -> None:
        """Open the stream of optimizer step ``step`` (0-based); ``state``: the checkpoint's trainer state
        (``{}`` fresh). Its saved data position is checked and restored when it is this stage's (a
        checkpoint on a boundary holds the previous stage's, and the new stream starts from the step)."""
        self._open(stage_at(self.stages, step), step)
        if state.get("data") is not None and state.get("stage", 0) == self.stage.index \
                and hasattr(self.batches, "load_state_dict"):
            self.batches.load_state_dict(state["data"])  # checks the global batch and seed did not change
        if "tokens_seen" in state:
            mine = self._stage_tokens(step)
            self._closed = {k: v - mine.get(k, 0) for k, v in state["tokens_seen"].items()}

    def at(self, step: int) -> Stage:
        """The stage of optimizer step ``step``, its stream opened (the next stage's, past a boundary)."""
        if step >= self.stage.end_step and self.stage.index + 1 < len(self.stages):
            done = self._stage_tokens(step)
            self._closed = {k: self._closed.get(k, 0) + done.get(k, 0) for k in [*done, *self._closed]}
            self._open(stage_at(self.stages, step), step)
        return self.stage

    def micro_batches(self) -> list[Any]:
        """The next optimizer step's ``grad_accum`` micro-batches."""
        return [next(self.batches) for _ in range(self.stage.grad_accum)]

    def peek(self, step: int) -> Any | None:
        """The first micro-batch of optimizer step ``step`` without advancing (None: the source cannot)."""
        batch = getattr(self.batches, "batch", None)
        return batch(step * self.stage.grad_accum) if batch is not None else None

    def tokens_seen(self) -> dict[str, int] | None:
        """Input tokens each corpus supplied to all replicas so far (None: the source does not count)."""
        if not hasattr(self.batches, "tokens_by_corpus"):
            return None
        now = self.batches.tokens_by_corpus()
        names = [*now, *(k for k in self._closed if k not in now)]
        return {k: self._closed.get(k, 0) + now.get(k, 0) - self._opened_at.get(k, 0) for k in names}

    def state(self) -> dict[str, Any]:
        """What a checkpoint records: the stream's position, its stage and ``tokens_seen``."""
        data = self.batches.state_dict() if hasattr(self.batches, "state_dict") else None
        seen = self.tokens_seen()
        return {"data": data, "stage": self.stage.index, **({"tokens_seen": seen} if seen is not None else {})}

    def _open(self, stage: Stage, step: int) -> None:
        self.stage = stage
        self.batches = self.open_stream(stage_config(self.cfg, stage), step * stage.grad_accum)
        self._opened_at = self._count_at(stage.first_step)

    def _stage_tokens(self, step: int) -> dict[str, int]:
        """The open stream's tokens from its stage's first step to ``step``."""
        now = self._count_at(step)
        return {k: v - self._opened_at.get(k, 0) for k, v in now.items()}

    def _count_at(self, step: int) -> dict[str, int]:
        count = getattr(self.batches, "tokens_by_corpus", None)
        return count(step * self.stage.grad_accum) if count is not None else {}
