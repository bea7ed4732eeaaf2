"""The online GRPO loop as the objective's batch source (``--objective grpo --prompts``; docs/rl.md#the-online-loop).

Each optimizer step ``k`` (:meth:`OnlineRollouts.step_batches`):

1. **prompts**: the step's ``generation_batch_size / num_generations`` prompts, from a permutation of the
   prompt rows per epoch by ``--seed`` (pretraining's sampler, :class:`~loongtrain.data.sampler.ReplicaSampler`);
2. **weights**: the policy's current weights gathered from their shards (collective) and handed to the engine
   on rank 0 (:func:`~loongtrain.objectives.grpo_engine.policy_weights`);
3. **generate**: ``num_generations`` completions of each prompt on rank 0, sampled with a generator seeded by
   ``(--seed, k)``, so a resumed loop draws what the uninterrupted one drew;
4. **score**: the reward functions on rank 0 (:mod:`~loongtrain.objectives.grpo_rewards`); then one broadcast of the
   step's completions and rewards (or of the error that stopped them) to every rank;
5. **advantages** over each prompt's group (:func:`~loongtrain.data.rollouts.with_advantages`) and the
   rollouts packed whole into the step's ``dp x batch_size x grad_accum`` rows; row ``r`` is micro-batch
   ``r // (dp * batch_size)`` of replica ``(r // batch_size) % dp``; rows past the packing hold no completion.

The trainer then updates the actor on these micro-batches like on a rollout file's. A checkpoint records
the loop's position (:meth:`state_dict`): the next step's number, the seed and the step's sizes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from loongtrain.data.chat import ChatFormat, read_template
from loongtrain.data.pipeline import _collate
from loongtrain.data.rollouts import PromptRow, Rollout, RolloutDataset, read_prompts, rows_fit, with_advantages
from loongtrain.data.sampler import ReplicaSampler
from loongtrain.data.tokenizer import Tokenizer
from loongtrain.data.whole_packing import pack_whole
from loongtrain.objectives.grpo_engine import TransformersEngine, policy_weights
from loongtrain.objectives.grpo_rewards import RewardFunction, load_rewards, score
from loongtrain.parallel.mesh import Mesh
from loongtrain.parallel.runtime import is_distributed
from loongtrain.sections.model import param_dtype
from loongtrain.train.model_setup import hf_model_dir

Batch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class LoopOptions:
    """The loop's sizes and sampling (TRL's names)."""

    num_generations: int
    generation_batch_size: int
    max_completion_length: int
    temperature: float
    scale_rewards: str
    seed: int
    seq_len: int
    batch_size: int
    grad_accum: int

    @property
    def prompts_per_step(self) -> int:
        return self.generation_batch_size // self.num_generations


def step_seed(seed: int, step: int) -> int:
    """The sampling generator's seed of step ``step`` (0-based)."""
    return (seed * 1_000_003 + step * 7_919 + 17) % (2**63)


class OnlineRollouts:
    """This replica's micro-batches of the online loop (module docstring). ``engine``: rank 0's (None on the
    others); ``weights``: a callable that returns the policy's weights (collective; rank 0's dict)."""

    def __init__(self, options: LoopOptions, prompts: Sequence[PromptRow], tokenizer: Tokenizer, mesh: Mesh,
                 rewards: Sequence[RewardFunction], engine: Any, weights: Any, start_micro_step: int,
                 metrics: dict[str, float] | None = None) -> None:
        self.options, self.prompts, self.tokenizer, self.mesh = options, list(prompts), tokenizer, mesh
        self.rewards, self.engine, self.weights = rewards, engine, weights
        assert start_micro_step % options.grad_accum == 0, "the loop starts at an optimizer step"
        self.next_step = start_micro_step // options.grad_accum
        self.sampler = ReplicaSampler(len(self.prompts), 0, 1, options.prompts_per_step, options.seed)
        self.pending: list[Batch] = []
        self.metrics = metrics if metrics is not None else {}  # the last step's timings and reward means

    def __iter__(self) -> OnlineRollouts:
        return self

    def __next__(self) -> Batch:
        if not self.pending:
            self.pending = self.step_batches(self.next_step)
            self.next_step += 1
        return self.pending.pop(0)

    def state_dict(self) -> dict[str, int]:
        o = self.options
        return {"rollout_step": self.next_step, "seed": o.seed, "generation_batch_size": o.generation_batch_size,
                "num_generations": o.num_generations, "prompts": len(self.prompts)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        mine = self.state_dict()
        for key in ("seed", "generation_batch_size", "num_generations", "prompts"):
            if state.get(key) != mine[key]:
                raise ValueError(f"cannot resume the online loop: the checkpoint has {key}={state.get(key)}, this "
                                 f"run {mine[key]}")
        self.next_step = int(state["rollout_step"])

    # -- one step ----------------------------------------------------------------------------------------

    def step_batches(self, step: int) -> list[Batch]:
        """Step ``step``'s micro-batches of this replica (collective over every rank)."""
        rows = self.sampler.indices(step)
        weights = self.weights()  # every rank: the gather is collective under FSDP2
        payload: dict[str, Any] = {}
        if self.mesh.rank == 0:
            payload = self._rank0_rollouts(step, rows, weights)
        del weights
        payload = _broadcast(payload)
        if payload.get("error"):
            raise ValueError(payload["error"])
        self.metrics.clear()
        self.metrics.update(payload["metrics"])
        rollouts = self._rollouts(rows, payload["completions"], payload["rewards"])
        return self._micro_batches(rollouts)

    def _rank0_rollouts(self, step: int, rows: list[int], weights: dict[str, torch.Tensor]) -> dict[str, Any]:
        o = self.options
        try:
            t0 = time.perf_counter()
            self.engine.load_weights(weights.items())
            completions = self.engine.generate([self.prompts[r].ids.tolist() for r in rows], o.num_generations,
                                               o.max_completion_length, o.temperature, step_seed(o.seed, step))
            t1 = time.perf_counter()
            rewards, means = self._score(rows, completions)
            t2 = time.perf_counter()
        except ValueError as exc:
            return {"error": f"step {step + 1}: {exc}"}
        return {"completions": completions, "rewards": rewards.tolist(),
                "metrics": {"time/generate_s": t1 - t0, "time/score_s": t2 - t1, **means}}

    def _score(self, rows: list[int], completions: list[list[int]]) -> tuple[np.ndarray, dict[str, float]]:
        g, eos = self.options.num_generations, self.tokenizer.eos_id
        prompts = [self.prompts[r] for r in rows for _ in range(g)]
        texts = [self.tokenizer.decode([t for t in c if t != eos]) for c in completions]
        shown = [[{"role": "assistant", "content": t}] if p.conversational else t for p, t in zip(prompts, texts)]
        names = sorted({k for p in prompts for k in p.columns})
        columns = {k: [p.columns.get(k) for p in prompts] for k in names}
        return score(self.rewards, [p.prompt for p in prompts], shown, completions, columns)

    def _rollouts(self, rows: list[int], completions: list[list[int]], rewards: list[float]) -> list[Rollout]:
        g = self.options.num_generations
        out = []
        for j, (ids, reward) in enumerate(zip(completions, rewards)):
            prompt = self.prompts[rows[j // g]]
            out.append(Rollout(prompt.ids, np.asarray(ids, dtype=np.int64), float(reward), f"prompt {j // g}",
                               f"{prompt.where} (completion {j % g})"))
        return with_advantages(out, self.options.scale_rewards)

    def _micro_batches(self, rollouts: list[Rollout]) -> list[Batch]:
        o, mesh = self.options, self.mesh
        return step_micro_batches(rollouts, o.seq_len, self.tokenizer.eos_id, mesh.dp, mesh.dp_rank, o.batch_size,
                                  o.grad_accum)


def step_micro_batches(rollouts: Sequence[Rollout], seq_len: int, pad_id: int, dp: int, dp_rank: int,
                       batch_size: int, grad_accum: int) -> list[Batch]:
    """Replica ``dp_rank``'s micro-batches of one optimizer step of ``rollouts`` (advantages given): packed whole in
    order into the step's ``dp * batch_size * grad_accum`` rows (module docstring: which row goes where; rows past
    the packing hold no completion); ValueError when they need more rows."""
    total = dp * batch_size * grad_accum
    packed = pack_whole(np.array([r.length for r in rollouts], dtype=np.int64), seq_len, "error", "completions")[0]
    if len(packed) > total:  # rows_fit, checked before any worker, rules it out for the online loop
        raise ValueError(f"the step's {len(rollouts)} completions pack into {len(packed)} rows of --seq-len {seq_len}, "
                         f"more than its {total} (dp x --batch-size x --grad-accum)")
    packed += [np.zeros(0, dtype=np.int64)] * (total - len(packed))
    dataset = RolloutDataset(rollouts, seq_len, pad_id, "rollouts", rows=packed,
                             max_sequences=max(1, max(len(r) for r in packed)))
    return [_collate([dataset[(m * dp + dp_rank) * batch_size + b] for b in range(batch_size)])
            for m in range(grad_accum)]


def _broadcast(payload: dict[str, Any]) -> dict[str, Any]:
    """Rank 0's ``payload`` on every rank. Communication: one ``broadcast_object_list`` over the world."""
    if not (is_distributed() and dist.get_world_size() > 1):
        return payload
    box = [payload]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def rollout_chat(tokenizer: Tokenizer, chat_template: str) -> ChatFormat | None:
    """GRPO's chat format: when there is a template (conversational rows need it), every token a target."""
    return ChatFormat(tokenizer, chat_template, "all") if read_template(tokenizer, chat_template) is not None else None


def online_rollouts(objective: Any, cfg: Any, start_micro_step: int) -> OnlineRollouts:
    """The online loop's batch source of ``objective`` (a :class:`~loongtrain.objectives.grpo.GRPOObjective`) for
    this rank at ``cfg``'s options; the engine is built once, on rank 0."""
    ctx, recipe, tokenizer = objective.ctx, objective.recipe, objective.run.tokenizer
    options = recipe.options
    prompts = read_prompts(options.prompts, tokenizer, rollout_chat(tokenizer, options.chat_template),
                           cfg.data.decode_errors)
    directory = hf_model_dir(cfg.model.model)
    ensure_engine(objective, cfg, tokenizer.eos_id)
    rewards = load_rewards(options.reward, options.reward_weights) if ctx.mesh.rank == 0 else []
    weights = lambda: policy_weights(ctx.model, ctx.model_config, directory is not None)  # noqa: E731
    return OnlineRollouts(recipe.loop_options(cfg), prompts, tokenizer, ctx.mesh, rewards, objective.engine, weights,
                          start_micro_step, objective.loop_metrics)


def ensure_engine(objective: Any, cfg: Any, eos_id: int) -> None:
    """``objective.engine``: the embedded engine of the policy's architecture on rank 0's device, built once (the
    other ranks hold none)."""
    ctx = objective.ctx
    if ctx.mesh.rank == 0 and objective.engine is None:
        directory = hf_model_dir(cfg.model.model)
        objective.engine = TransformersEngine.for_model(None if directory is None else str(directory),
                                                        ctx.model_config, param_dtype(cfg.model.dtype),
                                                        eos_id, ctx.device)


def check_online(recipe: Any, cfg: Any, tokenizer: Tokenizer, world: int) -> list[str]:
    """The launcher's check of the online loop's inputs, before any worker: the prompt rows parse and encode,
    every reward function loads, and a step's completions always pack into its rows
    (:func:`~loongtrain.data.rollouts.rows_fit`); returns the lines to log."""
    o = recipe.options
    prompts = read_prompts(o.prompts, tokenizer, rollout_chat(tokenizer, o.chat_template), cfg.data.decode_errors)
    rewards = load_rewards(o.reward, o.reward_weights)
    rows = max(1, world // cfg.parallel.sp) * cfg.data.batch_size * cfg.data.grad_accum
    longest = max(len(p.ids) for p in prompts)
    why = rows_fit(longest, o.max_completion_length, o.generation_batch_size, rows, cfg.data.seq_len)
    if why is not None:
        raise ValueError(f"--prompts {o.prompts!r}: {why}")
    return [f"--objective grpo online: {len(prompts)} prompts (at most {longest} tokens), "
            f"{o.generation_batch_size // o.num_generations} a step x {o.num_generations} completions of at most "
            f"{o.max_completion_length} tokens; rewards {', '.join(f'{r.spec} x {r.weight:g}' for r in rewards)}; "
            f"the embedded transformers engine"]
