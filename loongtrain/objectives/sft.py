"""``--objective sft`` (docs/post-training.md): conversations ``{"messages": [...]}`` of ``.jsonl`` rows or a corpus
prepared with ``loongtrain prepare --objective sft``, packed whole; the loss is the mean over the step's target
tokens (their assistant tokens, or every token with ``--loss-on all``: loongtrain/loss/sft.py). The objective does
not depend on how parameters are made trainable: it only differentiates the loss."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from loongtrain.data.chat import ChatFormat
from loongtrain.data.conversations import ConversationDataset, SFTRows, open_conversations
from loongtrain.data.post_training import PostTrainingReader
from loongtrain.data.tokenizer import Tokenizer
from loongtrain.loss.chunked import FinalNorm
from loongtrain.loss.sft import sft_loss
from loongtrain.model.memory import MemoryTerm
from loongtrain.objectives.base import TrainConfig
from loongtrain.objectives.options import CATALOGUE, SFT
from loongtrain.objectives.post_training import RowsSpec, TargetsObjective
from loongtrain.train.batch import LocalBatch
from loongtrain.train.config import Run
from loongtrain.train.step_context import StepContext

Tensor = torch.Tensor


@dataclass(frozen=True)
class ConversationReader(PostTrainingReader):
    """Conversations packed whole (:class:`~loongtrain.data.conversations.ConversationDataset`)."""

    objective = SFT

    def dataset(self, spec: str, *, val_fraction: float = 0.0, part: str = "all",
                held_out: bool = False) -> ConversationDataset:
        assert self.chat is not None
        docs = open_conversations(spec, self.tokenizer, self.chat, **self.split(val_fraction, part))
        return ConversationDataset(docs, self.seq_len, self.tokenizer.eos_id, spec, self.on_long)

    def describe(self) -> str:
        assert self.chat is not None
        return self.chat.describe()


class SFTObjective(TargetsObjective):
    """The mean over the step's target tokens (module docstring)."""

    def loss_of(self, local: LocalBatch, hidden: Tensor, head: Tensor,
                norm: FinalNorm | None) -> tuple[Tensor, Tensor]:
        return sft_loss(hidden, head, local.labels, self.ctx.mesh, self.scale, norm=norm)


@dataclass(frozen=True)
class SFTRecipe:
    """Builds :class:`SFTObjective` (picklable): the chat options."""

    chat_template: str
    loss_on: str
    on_long: str

    def build(self, ctx: StepContext, run: Run) -> SFTObjective:
        return SFTObjective(ctx, run, self.reader)

    def memory(self) -> tuple[MemoryTerm, ...]:
        return ()

    def reader(self, cfg: Any, tokenizer: Tokenizer) -> ConversationReader:
        data = cfg.data
        return ConversationReader(tokenizer, ChatFormat(tokenizer, self.chat_template, self.loss_on), data.seq_len,
                                  self.on_long, cfg.optim.seed, data.decode_errors)


class SupervisedFineTuning(RowsSpec):
    name = SFT
    options, help = CATALOGUE[SFT]
    prepares = True

    def recipe(self, cfg: TrainConfig) -> SFTRecipe:
        o = cfg.objective
        return SFTRecipe(o.chat_template, o.loss_on, o.on_long)

    def reader(self, cfg: Any, tokenizer: Tokenizer) -> ConversationReader:
        return self.recipe(cfg).reader(cfg, tokenizer)

    def chat_format(self, tokenizer: Tokenizer, options: Any) -> ChatFormat:
        """Always (without a template only text prompt-completion rows encode, unless ``loss_on == "all"``)."""
        return ChatFormat(tokenizer, options.chat_template, options.loss_on)

    def row_encoder(self, tokenizer: Tokenizer, options: Any) -> SFTRows:
        return SFTRows(self.chat_format(tokenizer, options))


SPEC = SupervisedFineTuning()
