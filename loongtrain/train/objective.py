"""What the trainer asks of the run's objective (docs/design.md#how-to-add-an-objective).

The objectives themselves (pretraining, SFT, DPO, ...) live one floor up, in :mod:`loongtrain.objectives`, whose
registry the launcher asks for the run's :class:`ObjectiveRecipe`; the trainer builds it on its
:class:`~loongtrain.train.step_context.StepContext` and calls the :class:`Objective` below at fixed points of its
one loop. The trainer keeps its step (micro-batches, backward of ``loss / micro_batches``, the gradients averaged
over dp, the loss values averaged over micro-batches and dp replicas); an objective says what a micro-batch's loss
is, which data the run reads, and what a step adds to its record.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch

from loongtrain.model.memory import MemoryTerm
from loongtrain.train.batch import Batch, LocalBatch
from loongtrain.train.config import Run, TrainSections
from loongtrain.train.step_context import StepContext

Tensor = torch.Tensor


class Objective(Protocol):
    """One run's objective on one rank, built on the trainer's step context."""

    def batches(self, cfg: TrainSections, start_micro_step: int) -> Iterator[Batch]:
        """This replica's full-sequence micro-batches of ``cfg``'s data (a stage's options) from
        ``start_micro_step`` on: the run's data reader."""

    def validation_batches(self, cfg: TrainSections, count: int) -> list[Batch]:
        """This replica's ``count`` validation batches at ``cfg``'s length and batch (fewer when the held-out data
        has fewer)."""

    def prepare(self, stream: Any, start: int, end: int) -> None:
        """Before the first step of ``[start, end)`` of ``stream`` (a :class:`~loongtrain.train.stages.StageStream`;
        DPO: the reference's log-probabilities). Collective."""

    def begin_step(self, micro_batches: Sequence[Batch], *, dp_reduce: bool = True) -> bool:
        """Before the forwards of a step (or of one batch on its own, ``dp_reduce=False``): count what the step
        averages over; False: the step has nothing to train on (the trainer skips it)."""

    def loss(self, local: LocalBatch) -> tuple[Tensor, Tensor]:
        """``(loss_for_backward, value)`` of this rank's shard of one micro-batch, scaled so that the trainer's
        averaging over micro-batches and replicas yields the step's loss: the forward and the loss."""

    def step_values(self) -> dict[str, Tensor]:
        """Device scalars of the step's micro-batches that the trainer averages over dp together with the loss and
        records (the router's ``aux_loss``); ``{}`` when none."""

    def metrics(self) -> dict[str, float]:
        """The step's own metrics for its record (collective where they need the other replicas)."""

    def no_targets_message(self, step: int) -> str:
        """The warning for step ``step`` when :meth:`begin_step` found nothing to train on."""

    def validation_loss(self, batches: Sequence[Batch]) -> float:
        """The validation loss of ``batches`` (this replica's; all replicas' together), forward only, identical on
        every rank (collective)."""


class ObjectiveRecipe(Protocol):
    """What the launcher hands the trainer (:attr:`~loongtrain.train.config.Run.objective`): picklable, since local
    workers receive it; :meth:`build` makes the rank's :class:`Objective`."""

    def build(self, ctx: StepContext, run: Run) -> Objective:
        """The objective of ``run`` on this rank's step context."""

    def memory(self) -> tuple[MemoryTerm, ...]:
        """Its memory phases outside the step (the planner's terms: DPO's reference pass), which the start-up memory
        report's prediction counts."""
