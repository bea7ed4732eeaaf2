"""The actor side of RL as a library (docs/rl.md#the-actor-as-a-library): what an RL framework that owns its
rollouts (verl, OpenRLHF) calls on every rank of a loongtrain run, instead of ``loongtrain train``.

``Actor(trainer.ctx, trainer.run, trainer.step)`` acts through a :class:`~loongtrain.train.trainer.Trainer` of
``--objective grpo`` (its run's recipe from the registry: :func:`loongtrain.launch.config.run_of`):

- :meth:`Actor.logps`: each completion's per-token log-probabilities (at ``--temperature``) after its prompt,
  forward only under the run's layout: the completions packed whole into rows of ``--seq-len``, each row
  sharded over the replica's ranks, the values gathered back (collective over every rank; every rank gets all);
- :meth:`Actor.update`: one optimizer step from token ids, advantages and, optionally, the behaviour policy's
  log-probabilities (the ratio's denominator; else the policy's own, detached), exactly as a rollout file's
  step (loongtrain/loss/grpo.py); returns the step's record (loss, gradient norm, TRL's metrics).

Every rank passes the same completions; replica ``d`` trains on its share of the step's rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from loongtrain.data.pipeline import _collate
from loongtrain.data.rollouts import Rollout, RolloutDataset
from loongtrain.data.whole_packing import pack_whole
from loongtrain.loss.token_logprobs import chunked_token_logprobs
from loongtrain.objectives.grpo_loop import step_micro_batches
from loongtrain.parallel.sharding import gather_sequence
from loongtrain.train.batch import Batch
from loongtrain.train.config import Run
from loongtrain.train.step_context import StepContext
from loongtrain.train.validation import forward_only

Tensor = torch.Tensor


def as_rollouts(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
                advantages: Sequence[float] | None = None, old_logps: Sequence[Sequence[float]] | None = None,
                rewards: Sequence[float] | None = None) -> list[Rollout]:
    """Rollouts of token ids (each completion its own group: advantages are the caller's)."""
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts for {len(completions)} completions: give one prompt per completion")
    out = []
    for i, (p, c) in enumerate(zip(prompts, completions)):
        old = None if old_logps is None else np.asarray(old_logps[i], dtype=np.float64)
        if old is not None and len(old) != len(c):
            raise ValueError(f"completion {i}: {len(old)} old log-probabilities for {len(c)} tokens")
        if not len(p) or not len(c):
            raise ValueError(f"completion {i}: the prompt and the completion need at least one token each")
        out.append(Rollout(np.asarray(p, dtype=np.int64), np.asarray(c, dtype=np.int64),
                           0.0 if rewards is None else float(rewards[i]), f"completion {i}", f"completion {i}",
                           0.0 if advantages is None else float(advantages[i]), old))
    return out


class Actor:
    """The actor of an RL loop (module docstring): a trainer's step context, run and step
    (``Actor(trainer.ctx, trainer.run, trainer.step)``)."""

    def __init__(self, ctx: StepContext, run: Run, step: Callable[[list[Batch]], dict[str, Any]]) -> None:
        options = getattr(run.objective, "options", None)
        if options is None or not hasattr(options, "grpo_loss"):
            raise ValueError(f"Actor needs a run of --objective grpo, not {type(run.objective).__name__}")
        self.ctx, self.run, self.step, self.temperature = ctx, run, step, options.temperature
        self.data, self.mesh = run.cfg.data, ctx.mesh

    def logps(self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]) -> list[Tensor]:
        """Each completion's per-token log-probabilities (module docstring), float64 on the host."""
        rollouts = as_rollouts(prompts, completions)
        rows = pack_whole(np.array([r.length for r in rollouts], dtype=np.int64), self.data.seq_len, "error",
                          "completions")[0]
        dataset = RolloutDataset(rollouts, self.data.seq_len, self._pad(), "actor", rows=rows)
        out: list[Tensor | None] = [None] * len(rollouts)
        ctx = self.ctx
        for index, members in enumerate(rows):
            batch = _collate([dataset[index]])
            local = ctx.local(batch)
            with forward_only(ctx.model), ctx.autocast():
                hidden, head, norm = ctx.forward(local)
                values = chunked_token_logprobs(hidden, head, local.labels, norm=norm, temperature=self.temperature)
            full = gather_sequence(values, self.mesh, 1, local.chunk_order)[0] if self.mesh.sp > 1 else values[0]
            full = full.detach().to(torch.float64).cpu()
            for k, unit in enumerate(members.tolist()):
                out[unit] = full[batch["segment"][0] == k]
        return [x for x in out if x is not None]

    def update(self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
               advantages: Sequence[float], old_logps: Sequence[Sequence[float]] | None = None,
               rewards: Sequence[float] | None = None) -> dict[str, Any]:
        """One optimizer step (module docstring); the step's record."""
        rollouts = as_rollouts(prompts, completions, advantages, old_logps, rewards)
        data, mesh = self.data, self.mesh
        micro = step_micro_batches(rollouts, data.seq_len, self._pad(), mesh.dp, mesh.dp_rank, data.batch_size,
                                   data.grad_accum)
        return self.step(micro)

    def _pad(self) -> int:
        tokenizer = self.run.tokenizer
        return tokenizer.eos_id if tokenizer is not None else 0
