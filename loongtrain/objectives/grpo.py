"""``--objective grpo`` (docs/rl.md): the GRPO family's actor update on rollouts, from a rollout file (``--corpus``,
rows ``{"prompt", "completion", "reward"}``: loongtrain/data/rollouts.py) or generated online (``--prompts`` with
``--reward``: loongtrain/objectives/grpo_loop.py).

The trainer's step is unchanged; :class:`GRPOObjective` gives one micro-batch's loss (loongtrain/loss/grpo.py):

- :meth:`GRPOObjective.count_targets` counts, on the host before any forward, the step's completion tokens and
  sequences and the sums its reward metrics need, from its full-sequence micro-batches, and all-reduces them over
  the data-parallel replicas once (one all-reduce of six values);
- :meth:`GRPOObjective.loss`: with ``--grpo-beta > 0`` the reference's per-token log-probabilities of the shard
  first (:class:`TokenReference`, forward only, before the policy's forward keeps its activations), then the
  policy's at ``--temperature`` with their entropies (a chunk of logits at a time) and the clipped surrogate;
- :meth:`GRPOObjective.metrics`: TRL's keys (:data:`METRICS`), one all-reduce over every rank.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from loongtrain.data.chat import ChatFormat
from loongtrain.data.post_training import PostTrainingReader
from loongtrain.data.rollouts import SCALE_REWARDS, RolloutDataset, read_rollouts, with_advantages
from loongtrain.data.tokenizer import Tokenizer
from loongtrain.loss.chunked import FinalNorm
from loongtrain.loss.grpo import (
    LOSS_METRICS,
    Completions,
    StepCounts,
    grpo_loss,
)
from loongtrain.loss.token_logprobs import chunked_logprobs_and_entropy, chunked_token_logprobs
from loongtrain.model.config import ModelConfig
from loongtrain.model.memory import MemoryTerm
from loongtrain.objectives.base import TrainConfig
from loongtrain.objectives.grpo_loop import LoopOptions, check_online, ensure_engine, online_rollouts, rollout_chat
from loongtrain.objectives.grpo_memory import PLANNED, RolloutEngine, grpo_phases, last_decoding_step, rollout_batch
from loongtrain.objectives.options import CATALOGUE, GRPO, GRPOOptions
from loongtrain.objectives.post_training import RowsSpec, TargetsObjective, dp_sum
from loongtrain.objectives.reference import build_reference_model, check_reference
from loongtrain.parallel.runtime import is_distributed, to_device
from loongtrain.train.batch import Batch, LocalBatch
from loongtrain.train.config import Run, TrainSections
from loongtrain.train.step_context import StepContext
from loongtrain.train.validation import forward_only

Tensor = torch.Tensor
#: the metrics of a GRPO step (TRL's keys), besides ``targets`` (completion tokens) and ``completions``
METRICS = ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", *LOSS_METRICS)


@dataclass(frozen=True)
class RolloutReader(PostTrainingReader):
    """Rollout rows packed whole, their advantages TRL's (:class:`~loongtrain.data.rollouts.RolloutDataset`)."""

    scale_rewards: str = "group"
    objective = GRPO

    def dataset(self, spec: str, *, val_fraction: float = 0.0, part: str = "all",
                held_out: bool = False) -> RolloutDataset:
        assert not val_fraction, "--objective grpo has no held-out part (the options' check refuses it)"
        rollouts = read_rollouts(spec, self.tokenizer, self.chat, self.decode_errors)
        return RolloutDataset(with_advantages(rollouts, self.scale_rewards), self.seq_len, self.tokenizer.eos_id, spec)

    def describe(self) -> str:
        return (f"targets: each completion's tokens and its EOS; advantages by --grpo-scale-rewards "
                f"{self.scale_rewards}" + ("; conversational rows rendered with the chat template"
                                           if self.chat is not None else ""))


def host_sums(batches: Sequence[Batch]) -> list[float]:
    """``[tokens, sequences, sum r, sum r^2, zero-std sequences]`` of full-sequence batches (host values)."""
    tokens = sequences = r1 = r2 = zero = 0.0
    for b in batches:
        valid = torch.arange(b["lengths"].shape[1])[None, :] < b["num_sequences"][:, None]
        rewards = b["rewards"][valid]
        tokens += float(b["lengths"][valid].sum())
        sequences += float(valid.sum())
        r1, r2 = r1 + float(rewards.sum()), r2 + float((rewards * rewards).sum())
        zero += float(b["std_zero"][valid].sum())
    return [tokens, sequences, r1, r2, zero]


class TokenReference:
    """The reference's per-token log-probabilities of a shard (``--grpo-beta > 0``): a frozen model built and
    sharded like the policy, resident during training, forward only on each micro-batch's own shard."""

    def __init__(self, model: nn.Module, ctx: StepContext, temperature: float) -> None:
        self.model, self.ctx, self.temperature = model, ctx, temperature
        for p in model.parameters():
            p.requires_grad_(False)

    def token_logps(self, local: LocalBatch) -> Tensor:
        """``[B, s]`` log-probabilities of the shard's labels (collective over the replica, like a forward)."""
        with forward_only(self.model), self.ctx.autocast():
            hidden, head, norm = self.ctx.forward(local, self.model)
            return chunked_token_logprobs(hidden, head, local.labels, norm=norm, temperature=self.temperature)


class GRPOObjective(TargetsObjective):
    """``--objective grpo`` (module docstring)."""

    unit = "completion tokens"
    phases_with_gradients = True  # the engine generates before a step's zero_grad; the reference runs every micro-step

    def __init__(self, ctx: StepContext, run: Run, recipe: GRPORecipe) -> None:
        super().__init__(ctx, run, recipe.reader)
        self.recipe, self.settings, self.temperature = recipe, recipe.options.settings(), recipe.options.temperature
        self.reference = (TokenReference(build_reference_model(ctx, run, recipe.options.ref_model), ctx,
                                         self.temperature) if self.settings.beta else None)
        self.sums: list[float] = [0.0] * 5
        self.counts = StepCounts(0.0, 0.0)
        self._stats: Tensor | None = None
        self._ref: Tensor | None = None
        self.loop_metrics: dict[str, float] = {}  # the online loop's last step: timings, reward means
        self.engine: Any = None  # the online loop's engine (rank 0), built once

    def batches(self, cfg: TrainSections, start_micro_step: int) -> Iterator[Batch]:
        if self.recipe.options.prompts:
            return online_rollouts(self, cfg, start_micro_step)
        return super().batches(cfg, start_micro_step)

    def targets(self, batches: Sequence[Batch]) -> int:
        return int(host_sums(batches)[0])

    def count_targets(self, micro_batches: Sequence[Batch], *, dp_reduce: bool) -> bool:
        local = host_sums(micro_batches)
        mesh = self.ctx.mesh
        self.sums = dp_sum(local, mesh, self.ctx.device) if dp_reduce else local
        self.count = self.sums[0]
        self.counts = StepCounts(self.sums[0], self.sums[1])
        self.scale = float((mesh.dp if dp_reduce else 1) * len(micro_batches)) if self.count else 0.0
        self._stats = None
        return self.count > 0

    def loss(self, local: LocalBatch) -> tuple[Tensor, Tensor]:
        # the reference's forward first, while no activation of the policy's is kept
        self._ref = self.reference.token_logps(local) if self.reference is not None else None
        return super().loss(local)

    def loss_of(self, local: LocalBatch, hidden: Tensor, head: Tensor,
                norm: FinalNorm | None) -> tuple[Tensor, Tensor]:
        extras = local.extras
        n = max(1, *extras["num_sequences"].tolist())  # host values (tolist: also under fake tensors)
        logps, entropy = chunked_logprobs_and_entropy(hidden, head, local.labels, norm=norm,
                                                      temperature=self.temperature)
        completions = Completions(logps, extras["segment"], extras["advantages"][:, :n].to(logps.device),
                                  extras["lengths"][:, :n].to(logps.device), extras.get("old_logps"), self._ref,
                                  entropy)
        loss, value, stats = grpo_loss(self.settings, completions, self.counts, self.scale, self.ctx.mesh)
        self._ref = None
        self._stats = stats if self._stats is None else self._stats + stats
        return loss, value

    def metrics(self) -> dict[str, float]:
        tokens, sequences, r1, r2, zero = self.sums
        out: dict[str, float] = {"targets": int(tokens), "completions": int(sequences), **self.loop_metrics}
        if not sequences:
            return out
        mean = r1 / sequences
        var = (r2 - sequences * mean * mean) / (sequences - 1) if sequences > 1 else float("nan")
        out.update({"reward": mean, "reward_std": math.sqrt(max(var, 0.0)) if sequences > 1 else float("nan"),
                    "frac_reward_zero_std": zero / sequences, "completions/mean_length": tokens / sequences})
        stats = self._stats if self._stats is not None else torch.zeros(len(LOSS_METRICS), dtype=torch.float64)
        stats = to_device(stats.detach().to(torch.float64), self.ctx.device)
        if is_distributed() and dist.get_world_size() > 1:  # every rank's tokens: sp shards and dp replicas
            dist.all_reduce(stats)
        clip_unit = sequences if self.settings.importance_sampling == "sequence" else tokens
        for name, value in zip(LOSS_METRICS, stats.tolist()):
            if name != "kl" or self.settings.beta:
                out[name] = value / (clip_unit if name.startswith("clip_ratio") else tokens)
        return out

    def validation_loss(self, batches: Sequence[Batch]) -> float:
        raise AssertionError("--objective grpo has no validation loss (the options' check refuses it)")

    def resident(self) -> tuple[nn.Module, ...]:
        """The reference model (``--grpo-beta > 0``) and rank 0's engine once built, beside the policy all run."""
        return tuple(m for m in (self.reference and self.reference.model, self.engine and self.engine.model) if m)

    def phases(self, row: LocalBatch) -> dict[str, Any]:
        """What its memory terms model outside the step (loongtrain/objectives/grpo_memory.py), as the simulation
        measures it: online, on rank 0, the engine built here (as the loop builds it before the first step) and
        its last decoding step (phase ``rollout``); with a reference, its forward on ``row`` (phase ``reference``)."""
        out: dict[str, Any] = {}
        engines = [t for t in self.recipe.memory() if isinstance(t, RolloutEngine)]
        if engines and self.ctx.mesh.rank == 0:
            ensure_engine(self, self.run.cfg, 0)  # the simulation samples no EOS
            engine = self.engine
            out["rollout"] = lambda: last_decoding_step(engine.model, engines[0], self.temperature)
        if self.reference is not None:
            reference = self.reference
            out["reference"] = lambda: reference.token_logps(row)
        return out


@dataclass(frozen=True)
class GRPORecipe:
    """Builds :class:`GRPOObjective` (picklable): the objective's options."""

    options: GRPOOptions

    def build(self, ctx: StepContext, run: Run) -> GRPOObjective:
        return GRPOObjective(ctx, run, self)

    def memory(self) -> tuple[MemoryTerm, ...]:
        return grpo_phases(self.options)

    def reader(self, cfg: Any, tokenizer: Tokenizer) -> RolloutReader:
        data = cfg.data
        return RolloutReader(tokenizer, rollout_chat(tokenizer, self.options.chat_template), data.seq_len, "error",
                             cfg.optim.seed, data.decode_errors, self.options.grpo_scale_rewards)

    def loop_options(self, cfg: TrainSections) -> LoopOptions:
        o, data = self.options, cfg.data
        return LoopOptions(o.num_generations, o.generation_batch_size, o.max_completion_length, o.temperature,
                           o.grpo_scale_rewards, cfg.optim.seed, data.seq_len, data.batch_size, data.grad_accum)


class GroupRelative(RowsSpec):
    name = GRPO
    options, help = CATALOGUE[GRPO]

    def validate(self, cfg: TrainConfig) -> None:
        super().validate(cfg)
        validate_grpo(cfg)

    def recipe(self, cfg: TrainConfig) -> GRPORecipe:
        return GRPORecipe(grpo_options(cfg.objective))

    def reader(self, cfg: Any, tokenizer: Tokenizer) -> RolloutReader:
        return self.recipe(cfg).reader(cfg, tokenizer)

    def check_model(self, cfg: TrainConfig, model_config: ModelConfig, tokenizer: Tokenizer) -> None:
        check_reference(cfg, cfg.objective.ref_model, model_config, tokenizer)  # the policy's architecture

    def check_data(self, cfg: TrainConfig, tokenizer: Tokenizer, world: int) -> tuple[list[str], list[str]]:
        o = cfg.objective
        if o.prompts:  # the online loop: prompts, reward functions, packing
            return check_online(self.recipe(cfg), cfg, tokenizer, world), []
        return super().check_data(cfg, tokenizer, world)

    def identity(self, cfg: TrainConfig, tokenizer: Tokenizer) -> dict[str, Any]:
        """The chat format's, and online the prompts file's (the corpus a resume must keep)."""
        from loongtrain.data.sources import corpus_identity

        out = super().identity(cfg, tokenizer)
        if cfg.objective.prompts:
            out["prompts"] = corpus_identity(cfg.objective.prompts)
        return out

    def chat_format(self, tokenizer: Tokenizer, options: Any) -> ChatFormat | None:
        return rollout_chat(tokenizer, options.chat_template)

    def memory(self, lora: str = "") -> tuple[MemoryTerm, ...]:
        return grpo_phases(GRPOOptions(**self.planned_options(lora)))

    def planned_options(self, lora: str = "") -> dict[str, Any]:
        """:data:`~loongtrain.objectives.grpo_memory.PLANNED`; with ``--lora`` offline (the loop's engine takes
        whole weights)."""
        return dict(PLANNED) if not lora else {"grpo_beta": PLANNED["grpo_beta"]}

    def sample_batch(self, model: ModelConfig, seq_len: int, batch: int) -> Batch:
        return rollout_batch(model, seq_len, batch)


def grpo_options(section: Any) -> GRPOOptions:
    """:class:`GRPOOptions` of the objective section."""
    from dataclasses import fields

    return GRPOOptions(**{f.name: getattr(section, f.name) for f in fields(GRPOOptions)})


def validate_grpo(cfg: TrainConfig) -> None:
    """--objective grpo's own rules (docs/rl.md#bad-input): the loss's, and offline (--corpus rollouts) or online
    (--prompts with --reward)."""
    o = cfg.objective
    grpo_options(o).settings()  # its own checks: the loss and the ratio
    if o.grpo_scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"--grpo-scale-rewards={o.grpo_scale_rewards!r} is not one of {SCALE_REWARDS}")
    if not (math.isfinite(o.temperature) and o.temperature > 0):
        raise ValueError(f"--temperature={o.temperature} must be finite and > 0")
    if o.ref_model and not o.grpo_beta:
        raise ValueError(f"--ref-model {o.ref_model!r} with --grpo-beta 0: the reference is used only by the KL "
                         f"penalty; give --grpo-beta > 0 (e.g. 0.04) or leave --ref-model out")
    if cfg.evaluation.val_interval or cfg.data.val_fraction or cfg.data.val_corpus:
        raise ValueError("--objective grpo has no validation loss: leave out --val-interval, --val-fraction and "
                         "--val-corpus (the metrics' reward is the run's measure)")
    online = {"reward": bool(o.reward), "reward_weights": bool(o.reward_weights),
              "num_generations": o.num_generations != 8, "generation_batch_size": o.generation_batch_size != 64}
    if not o.prompts:
        extra = [f"--{name.replace('_', '-')}" for name, used in online.items() if used]
        if extra:
            raise ValueError(f"{', '.join(extra)} belong to the online loop: give --prompts FILE (or train on a "
                             f"rollout file with --corpus alone)")
        return
    if cfg.data.corpus != "stdlib":
        raise ValueError(f"--prompts {o.prompts!r} and --corpus {cfg.data.corpus!r}: --objective grpo trains online "
                         f"on prompts or offline on a rollout file, not both")
    if not o.reward:
        raise ValueError("--prompts needs at least one --reward FILE.py:FUNC or --reward module:func")
    if cfg.model.lora:
        raise ValueError(f"--lora {cfg.model.lora!r} with --prompts: the online loop's engine takes whole weights, "
                         f"not adapters; train LoRA on a rollout file (--corpus) or the whole model online")
    if o.reward_weights and len(o.reward_weights) != len(o.reward):
        raise ValueError(f"--reward-weights {','.join(f'{w:g}' for w in o.reward_weights)}: {len(o.reward_weights)} "
                         f"weights for {len(o.reward)} reward functions")
    if any(not math.isfinite(w) for w in o.reward_weights):
        raise ValueError(f"--reward-weights {o.reward_weights}: every weight must be finite")
    if o.num_generations < 2:
        raise ValueError(f"--num-generations={o.num_generations}: a group needs at least 2 completions (GRPO's "
                         f"advantage compares them)")
    if o.generation_batch_size < 1 or o.generation_batch_size % o.num_generations:
        raise ValueError(f"--generation-batch-size={o.generation_batch_size} must be a positive multiple of "
                         f"--num-generations={o.num_generations}")


SPEC = GroupRelative()
