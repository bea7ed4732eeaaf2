"""``--objective pretrain`` (the default): every token of a text corpus, the chunked cross-entropy through the final
norm and the LM head (no rank holds its logits: :func:`~loongtrain.loss.chunked.chunked_cross_entropy`'s contract),
the mean over every token of the step; the corpus's packed samples (:func:`loongtrain.data.pipeline.build_batches`),
its held-out documents or tail for validation (:mod:`loongtrain.train.validation`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loongtrain.data.checks import check_corpora
from loongtrain.data.pipeline import Batches, build_batches
from loongtrain.data.tokenizer import Tokenizer
from loongtrain.loss.chunked import FinalNorm, chunked_cross_entropy
from loongtrain.model.memory import MemoryTerm
from loongtrain.objectives.base import LossObjective, ObjectiveSpec, TrainConfig
from loongtrain.objectives.options import CATALOGUE, PRETRAIN
from loongtrain.train.batch import Batch, LocalBatch
from loongtrain.train.config import Run, TrainSections
from loongtrain.train.step_context import StepContext
from loongtrain.train.validation import check_validation, validation_batches, validation_loss

Tensor = torch.Tensor


class PretrainObjective(LossObjective):
    """The chunked cross-entropy of every token (module docstring)."""

    unit = "tokens"

    def batches(self, cfg: TrainSections, start_micro_step: int) -> Batches:
        tokenizer, mesh, data = self.run.tokenizer, self.ctx.mesh, cfg.data
        assert tokenizer is not None, "a corpus run needs the tokenizer the launcher resolved (Run.tokenizer)"
        return build_batches(data, tokenizer, cfg.optim.seed, dp_rank=mesh.dp_rank, dp=mesh.dp,
                             start_step=start_micro_step)

    def validation_batches(self, cfg: TrainSections, count: int) -> list[Batch]:
        return validation_batches(cfg, self.ctx.mesh, count)

    def loss_of(self, local: LocalBatch, hidden: Tensor, head: Tensor,
                norm: FinalNorm | None) -> tuple[Tensor, Tensor]:
        return chunked_cross_entropy(hidden, head, local.labels, self.ctx.mesh, norm=norm)

    def validation_loss(self, batches: Sequence[Batch]) -> float:
        return validation_loss(self.whole_loss, self.ctx.model, batches, self.ctx.mesh)


@dataclass(frozen=True)
class PretrainRecipe:
    """Builds :class:`PretrainObjective` (the trainer's :class:`~loongtrain.train.objective.ObjectiveRecipe`)."""

    def build(self, ctx: StepContext, run: Run) -> PretrainObjective:
        return PretrainObjective(ctx, run)

    def memory(self) -> tuple[MemoryTerm, ...]:
        return ()


class Pretrain(ObjectiveSpec):
    name = PRETRAIN
    options, help = CATALOGUE[PRETRAIN]
    prepares = True

    def recipe(self, cfg: TrainConfig) -> PretrainRecipe:
        return PretrainRecipe()

    def check_data(self, cfg: TrainConfig, tokenizer: Tokenizer, world: int) -> tuple[list[str], list[str]]:
        data = cfg.data
        check_corpora(data.corpus, data.val_corpus, tokenizer, data.seq_len, val_fraction=data.val_fraction,
                      seed=cfg.optim.seed, decode_errors=data.decode_errors)
        return [], check_validation(cfg, world, tokenizer)


SPEC = Pretrain()
