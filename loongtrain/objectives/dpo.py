"""``--objective dpo`` (docs/post-training.md): preference pairs ``{"prompt", "chosen", "rejected"}`` packed whole;
the loss is DPO's (loongtrain/loss/dpo.py) averaged over the step's pairs, against the reference's
log-probabilities (:class:`~loongtrain.objectives.reference.Reference`, computed before training and cached, or a
batch's own ``ref_logps [B, 2 * max_pairs]``). Its memory phase (the reference pass): loongtrain/objectives/
dpo_memory.py."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from loongtrain.data.chat import ChatFormat
from loongtrain.data.post_training import PostTrainingReader
from loongtrain.data.preference import PairRows, PreferenceDataset, open_pairs, pair_chat
from loongtrain.data.tokenizer import Tokenizer
from loongtrain.loss.chunked import FinalNorm
from loongtrain.loss.dpo import REWARD_METRICS, dpo_loss, sequence_logps
from loongtrain.loss.token_logprobs import chunked_token_logprobs
from loongtrain.model.config import ModelConfig
from loongtrain.model.memory import MemoryTerm
from loongtrain.objectives.base import TrainConfig
from loongtrain.objectives.dpo_memory import dpo_phases, preference_batch
from loongtrain.objectives.options import CATALOGUE, DPO
from loongtrain.objectives.post_training import RowsSpec, TargetsObjective, dp_sum
from loongtrain.objectives.reference import Reference, check_reference
from loongtrain.train.batch import Batch, LocalBatch
from loongtrain.train.config import Run
from loongtrain.train.step_context import StepContext

Tensor = torch.Tensor


@dataclass(frozen=True)
class PairReader(PostTrainingReader):
    """Preference pairs packed whole (:class:`~loongtrain.data.preference.PreferenceDataset`)."""

    objective = DPO

    def dataset(self, spec: str, *, val_fraction: float = 0.0, part: str = "all",
                held_out: bool = False) -> PreferenceDataset:
        docs = open_pairs(spec, self.tokenizer, self.chat, **self.split(val_fraction, part))
        return PreferenceDataset(docs, self.seq_len, self.tokenizer.eos_id, spec, self.on_long, held_out=held_out)

    def describe(self) -> str:
        return ("targets: each completion's tokens and its EOS (TRL's tokenization)"
                + ("; conversational rows rendered with the chat template" if self.chat is not None else ""))


class DPOObjective(TargetsObjective):
    """DPO averaged over the step's pairs (module docstring)."""

    unit = "preference pairs"

    def __init__(self, ctx: StepContext, run: Run, reader: Any, beta: float, ref_model: str) -> None:
        super().__init__(ctx, run, reader)
        self.beta = beta
        self.reference = Reference(ctx, run, ref_model, lambda count: self.validation_batches(run.cfg, count))
        self._stats: Tensor | None = None

    def targets(self, batches: Sequence[Batch]) -> int:
        return sum(sum(b["num_pairs"].tolist()) for b in batches)

    def count_targets(self, micro_batches: Sequence[Batch], *, dp_reduce: bool) -> bool:
        self.reference.ensure(list(micro_batches))
        return super().count_targets(micro_batches, dp_reduce=dp_reduce)

    def begin_counted(self) -> None:
        self._stats = None

    def prepare(self, stream: Any, start: int, end: int) -> None:
        self.reference.prepare(stream, start, end)

    def loss_of(self, local: LocalBatch, hidden: Tensor, head: Tensor,
                norm: FinalNorm | None) -> tuple[Tensor, Tensor]:
        num_pairs = local.extras["num_pairs"]
        sequences = 2 * max(num_pairs.tolist())  # host values (tolist: also under fake tensors)
        token_logps = chunked_token_logprobs(hidden, head, local.labels, norm=norm)
        policy = sequence_logps(token_logps, local.extras["segment"], sequences, self.ctx.mesh)
        reference = self.reference_logps(local.extras, sequences).to(policy.device)
        loss, value, stats = dpo_loss(policy, reference, num_pairs, self.beta, self.scale)
        self._stats = stats if self._stats is None else self._stats + stats
        return loss, value

    def reference_logps(self, extras: dict[str, Tensor], sequences: int) -> Tensor:
        """``[B, sequences]``: the batch's own ``ref_logps``, else the reference's cached values by ``ref_key``."""
        if "ref_logps" in extras:
            return extras["ref_logps"][:, :sequences]
        return self.reference.lookup(extras["ref_key"], extras["num_pairs"], sequences)

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {"pairs": int(self.count)}
        if self._stats is None or not self.count:
            return out
        sums = dp_sum(self._stats.tolist(), self.ctx.mesh, self.ctx.device)
        out.update({name: value / self.count for name, value in zip(REWARD_METRICS, sums)})
        return out

    def phases(self, row: LocalBatch) -> dict[str, Any]:
        """The reference pass as the run makes it before its first step: the reference built and sharded like the
        policy, one row forward only, released (the simulation's phase ``reference``)."""

        def reference_pass() -> None:
            model = self.reference.build()
            self.reference.local_logps(model, row)
            del model

        return {"reference": reference_pass}


@dataclass(frozen=True)
class DPORecipe:
    """Builds :class:`DPOObjective` (picklable): the chat options, beta and the reference."""

    chat_template: str
    on_long: str
    beta: float
    ref_model: str

    def build(self, ctx: StepContext, run: Run) -> DPOObjective:
        return DPOObjective(ctx, run, self.reader, self.beta, self.ref_model)

    def memory(self) -> tuple[MemoryTerm, ...]:
        return dpo_phases()

    def reader(self, cfg: Any, tokenizer: Tokenizer) -> PairReader:
        data = cfg.data
        return PairReader(tokenizer, pair_chat(tokenizer, self.chat_template), data.seq_len, self.on_long,
                          cfg.optim.seed, data.decode_errors)


class DirectPreference(RowsSpec):
    name = DPO
    options, help = CATALOGUE[DPO]
    prepares = True

    def validate(self, cfg: TrainConfig) -> None:
        beta = cfg.objective.dpo_beta
        if not (math.isfinite(beta) and beta > 0):
            raise ValueError(f"--dpo-beta={beta} must be finite and > 0")
        super().validate(cfg)

    def recipe(self, cfg: TrainConfig) -> DPORecipe:
        o = cfg.objective
        return DPORecipe(o.chat_template, o.on_long, o.dpo_beta, o.ref_model)

    def reader(self, cfg: Any, tokenizer: Tokenizer) -> PairReader:
        return self.recipe(cfg).reader(cfg, tokenizer)

    def check_model(self, cfg: TrainConfig, model_config: ModelConfig, tokenizer: Tokenizer) -> None:
        check_reference(cfg, cfg.objective.ref_model, model_config, tokenizer)  # the policy's architecture

    def chat_format(self, tokenizer: Tokenizer, options: Any) -> ChatFormat | None:
        return pair_chat(tokenizer, options.chat_template)

    def row_encoder(self, tokenizer: Tokenizer, options: Any) -> PairRows:
        return PairRows(tokenizer, self.chat_format(tokenizer, options))

    def memory(self, lora: str = "") -> tuple[MemoryTerm, ...]:
        return dpo_phases()

    def sample_batch(self, model: ModelConfig, seq_len: int, batch: int) -> Batch:
        return preference_batch(model, seq_len, batch)


SPEC = DirectPreference()
