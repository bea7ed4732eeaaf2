"""What every objective shares (docs/design.md#how-to-add-an-objective): :class:`ObjectiveSpec`, an objective's
registry entry (its options, their validation, the launcher's checks, its recipe, its memory phases, its
simulated batch), and :class:`LossObjective`, the base of the objective a rank runs (the trainer's interface,
:class:`~loongtrain.train.objective.Objective`): the forward on the step context, the objective's loss, and the
router's load-balancing term any objective adds for a model with experts (loongtrain/objectives/router.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from loongtrain.data.tokenizer import Tokenizer
from loongtrain.loss.chunked import FinalNorm
from loongtrain.model.config import ModelConfig
from loongtrain.model.memory import MemoryTerm
from loongtrain.objectives.router import build_router_loss
from loongtrain.train.batch import Batch, LocalBatch
from loongtrain.train.config import Run, TrainSections
from loongtrain.train.objective import ObjectiveRecipe
from loongtrain.train.step_context import StepContext

#: the run's whole config (:class:`loongtrain.launch.config.TrainConfig`: the sections and the objective's, one floor
#: up), as the registry's methods receive it
TrainConfig = Any
Tensor = torch.Tensor


class LossObjective:
    """An objective on one rank (:class:`~loongtrain.train.objective.Objective`): :meth:`loss` runs the forward on
    the step context under its autocast, recording the router's statistics of a model with experts, then
    :meth:`loss_of` (the subclass's loss of the hidden states), then adds the load-balancing term when the model
    trains on it; :meth:`step_values` gives the step's ``aux_loss``. Subclasses give the data reader
    (:meth:`batches`, :meth:`validation_batches`), :meth:`loss_of` and :meth:`validation_loss`."""

    unit = "targets"
    #: whether its :meth:`phases` run between steps, the last step's gradients held (GRPO's generation and reference
    #: forward), rather than before the first step (DPO's reference pass)
    phases_with_gradients = False

    def __init__(self, ctx: StepContext, run: Run) -> None:
        self.ctx, self.run = ctx, run
        self.router = build_router_loss(ctx.model, ctx.mesh)  # MoE: the load-balancing loss

    def batches(self, cfg: TrainSections, start_micro_step: int) -> Any:
        raise NotImplementedError

    def validation_batches(self, cfg: TrainSections, count: int) -> list[Batch]:
        raise NotImplementedError

    def prepare(self, stream: Any, start: int, end: int) -> None:
        pass

    def begin_step(self, micro_batches: Sequence[Batch], *, dp_reduce: bool = True) -> bool:
        if self.router is not None:
            self.router.take()  # drop what forwards outside a step (validation) recorded
        return self.count_targets(micro_batches, dp_reduce=dp_reduce)

    def count_targets(self, micro_batches: Sequence[Batch], *, dp_reduce: bool) -> bool:
        """What the step averages over (:meth:`begin_step`); True: every token of a text corpus is a target."""
        return True

    def loss(self, local: LocalBatch) -> tuple[Tensor, Tensor]:
        router, ctx = self.router, self.ctx
        with ctx.autocast():
            with router.recording() if router is not None else contextlib.nullcontext():
                hidden, head, norm = ctx.forward(local)
            loss, value = self.loss_of(local, hidden, head, norm)
            return router.add(loss, value) if router is not None else (loss, value)

    def loss_of(self, local: LocalBatch, hidden: Tensor, head: Tensor,
                norm: FinalNorm | None) -> tuple[Tensor, Tensor]:
        """``(loss_for_backward, value)`` of the hidden states before the final norm (:meth:`loss`)."""
        raise NotImplementedError

    def whole_loss(self, batch: Batch) -> tuple[Tensor, Tensor]:
        """:meth:`loss` of one full-sequence batch on its own (its targets counted alone)."""
        self.begin_step([batch], dp_reduce=False)
        return self.loss(self.ctx.local(batch))

    def step_values(self) -> dict[str, Tensor]:
        aux = self.router.take() if self.router is not None else None
        return {"aux_loss": aux} if aux is not None else {}

    def metrics(self) -> dict[str, float]:
        return {}

    def no_targets_message(self, step: int) -> str:
        return (f"step {step}: no {self.unit} in any of its sequences (every label is a prompt or padding); the "
                f"step is skipped (no update; the learning-rate schedule advances)")

    def validation_loss(self, batches: Sequence[Batch]) -> float:
        raise NotImplementedError

    def phases(self, row: LocalBatch) -> dict[str, Any]:
        """What the run does outside its steps that the simulation measures as phases of their own, by name, in
        order: callables on one row laid on this rank (DPO: the reference pass; GRPO: the engine's generation). None
        by default."""
        return {}

    def resident(self) -> tuple[torch.nn.Module, ...]:
        """Models it holds beside the policy through the run (GRPO's reference), which the simulation counts in
        every phase. None by default."""
        return ()


class ObjectiveSpec:
    """An objective's registry entry (loongtrain/objectives/registry.py): its ``name`` (``--objective NAME``), a
    ``help`` line, its ``options`` (a dataclass whose fields are options of ``loongtrain train``'s objective
    section, ``--dpo-beta``; options of the same name are shared with other objectives), whether ``loongtrain
    prepare`` makes its corpora (``prepares``), and the methods below, each "nothing" unless overridden. ``cfg``
    is the run's :data:`TrainConfig`."""

    name = ""
    help = ""
    options: type | None = None
    prepares = False
    #: whether its step reads host values of its batches (a post-training objective counts its targets): the
    #: simulation then makes its batch of real tensors
    counts_on_host = False

    def validate(self, cfg: TrainConfig) -> None:
        """ValueError where the objective's options do not suit the rest of the run (before any worker)."""

    def recipe(self, cfg: TrainConfig) -> ObjectiveRecipe:
        """What the trainer builds the rank's objective from (picklable: local workers receive it)."""
        raise NotImplementedError

    def check_model(self, cfg: TrainConfig, model_config: ModelConfig, tokenizer: Tokenizer) -> None:
        """The launcher's checks that need the run's model (DPO: ``--ref-model`` has the policy's shape)."""

    def check_data(self, cfg: TrainConfig, tokenizer: Tokenizer, world: int) -> tuple[list[str], list[str]]:
        """The launcher's checks of the run's corpora: ``(lines to log, warnings)``; ValueError naming the file."""
        return [], []

    def identity(self, cfg: TrainConfig, tokenizer: Tokenizer) -> dict[str, Any]:
        """What the objective adds to the run's data identity (every checkpoint records it; a resume compares)."""
        return {}

    def row_encoder(self, tokenizer: Tokenizer, options: Any) -> Any:
        """How ``loongtrain prepare`` encodes its corpora's rows (:class:`~loongtrain.data.prepared_rows.RowEncoder`;
        None: text, tokenized as pretraining reads it); ``options``: as :meth:`chat_format`'s."""
        return None

    def chat_format(self, tokenizer: Tokenizer, options: Any) -> Any:
        """The chat format its rows are rendered with (None: none); ``options``: its options (``chat_template``,
        ``loss_on``: the objective section's, or ``loongtrain prepare``'s)."""
        return None

    def memory(self, lora: str = "") -> tuple[MemoryTerm, ...]:
        """Its memory phases outside the step as ``loongtrain plan`` counts them, for a run of
        :meth:`planned_options` (a run's own: its recipe's ``memory()``)."""
        return ()

    def planned_options(self, lora: str = "") -> dict[str, Any]:
        """Its options as ``loongtrain plan`` assumes them for a run with ``lora`` (``--lora``; "": none), since it
        takes none of an objective's: what :meth:`memory` counts and ``plan --simulate`` simulates. The defaults
        unless overridden."""
        return {}

    def sample_batch(self, model: ModelConfig, seq_len: int, batch: int) -> Batch:
        """A full batch of its rows for the simulation (real tensors, made before the fake tensors): random tokens,
        every one a target."""
        ids = torch.randint(0, model.vocab_size, (batch, seq_len))
        return {"input_ids": ids, "labels": ids, "position_ids": torch.arange(seq_len).expand(batch, seq_len)}
