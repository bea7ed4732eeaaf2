"""GRPO's memory terms (docs/rl.md#memory-and-speed; the protocol: loongtrain/model/memory.py) and the rollout rows
the simulation measures its step on.

- :class:`ResidentReference` (``--grpo-beta > 0``): the reference model lives beside the policy all run, its fp32
  weights sharded like the policy's (``4 * P / z`` more state), and at the start of each micro-batch, before the
  policy's forward keeps anything, it runs a forward without a graph on the same shard: the phase ``reference`` is
  DPO's reference pass (loongtrain/objectives/dpo_memory.py: gathered weights and the larger of a block's MLP
  moment and the loss's) on top of the step's whole state (the policy's weights, gradients and moments and the
  reference's weights, ``parts["states"]``; not the policy's gathered weights: its forward comes after) instead of
  the pass's own weights.
- :class:`RolloutEngine` (online, ``--prompts``; rank 0, the rank the planner reports): the embedded engine's
  model, whole (``P`` weights in fp32), all run, and while it generates, the phase ``rollout``: the step's state,
  the engine, its KV cache (``2 * L * Hkv * D * 4`` bytes a token for every token of the generation batch:
  ``generation_batch_size x (prompt + max_completion_length)``, prompts taken as long as the completions where the
  planner does not know them), one layer's keys again (transformers' cache concatenates: a decoding step holds
  the old keys and the new at once) and one decoding step's fp32 logits (``generation_batch_size x V x 4``). The
  simulation's phase ``rollout`` runs that step (:func:`last_decoding_step`), not the prompts' prefill.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from loongtrain.data.pipeline import _collate
from loongtrain.data.whole_packing import build_row
from loongtrain.model.config import ModelConfig, num_params
from loongtrain.model.memory import MemoryTerm, States, StepShape
from loongtrain.objectives.dpo_memory import REFERENCE_WEIGHT_BYTES, ReferencePass

#: bytes per parameter of the engine's weights (fp32) and of its KV cache's elements
ENGINE_BYTES = 4


class ResidentReference(ReferencePass):
    """The reference model of ``--grpo-beta > 0`` (module docstring)."""

    name = "grpo reference"

    def states(self, s: StepShape, states: States) -> States:
        p = num_params(s.model)
        return States(states.params, states.states + REFERENCE_WEIGHT_BYTES * p, states.grads, states.largest_param)

    def phases(self, s: StepShape, parts: dict[str, float], mlp_intermediates: float) -> dict[str, float]:
        # DPO's pass holds the policy's weights and moments and its own weights; here the whole step state is live
        # (a later micro-step's gradients too), not the policy's gathered weights or autocast copies (its forward
        # comes after)
        own = 0.0 if s.offload_params else (12 + REFERENCE_WEIGHT_BYTES) * num_params(s.model) / s.zero_size
        dpo = super().phases(s, parts, mlp_intermediates)["reference"]
        return {"reference": dpo - own + parts["states"]}

    def phase_host(self, s: StepShape) -> float:
        return 0.0  # counted in the states (offloaded with them under offload_params)


class RolloutEngine(MemoryTerm):
    """The online loop's engine on rank 0 (module docstring)."""

    name = "grpo rollout"

    def __init__(self, generation_batch_size: int, max_completion_length: int, prompt_tokens: int | None = None):
        self.batch, self.completion = generation_batch_size, max_completion_length
        self.prompt = max_completion_length if prompt_tokens is None else prompt_tokens

    def states(self, s: StepShape, states: States) -> States:
        # the engine's whole weights on rank 0: ``z`` times them before the ZeRO group divides the states
        engine = ENGINE_BYTES * num_params(s.model) * s.zero_size
        return States(states.params, states.states + engine, states.grads, states.largest_param)

    def phases(self, s: StepShape, parts: dict[str, float], mlp_intermediates: float) -> dict[str, float]:
        m = s.model
        per_token = 2 * m.num_layers * m.num_kv_heads * m.head_dim * ENGINE_BYTES
        kv = per_token * self.batch * (self.prompt + self.completion)
        copy = kv / (2 * m.num_layers)  # a decoding step's concatenation: one layer's keys twice
        logits = self.batch * m.vocab_size * 4
        return {"rollout": parts["states"] + kv + copy + logits}


#: the options ``loongtrain plan --objective grpo`` assumes (it takes none of GRPO's): the KL penalty's reference
#: resident and the online loop at TRL's generation sizes (64 completions of 256 tokens); its prompts and reward
#: are never read (``plan --simulate`` builds the objective, not its loop)
PLANNED = dict(grpo_beta=0.04, prompts="(planned)", reward=("(planned)",), generation_batch_size=64,
               max_completion_length=256)


def grpo_phases(options: Any) -> tuple[MemoryTerm, ...]:
    """GRPO's terms for ``options`` (:class:`~loongtrain.objectives.options.GRPOOptions`): the resident reference
    with ``--grpo-beta > 0``, the engine online (``--prompts``)."""
    terms: list[MemoryTerm] = [ResidentReference()] if options.grpo_beta else []
    if options.prompts:
        terms.append(RolloutEngine(options.generation_batch_size, options.max_completion_length))
    return tuple(terms)


@torch.no_grad()
def last_decoding_step(model: torch.nn.Module, term: RolloutEngine, temperature: float) -> None:
    """What the engine holds at its peak (the simulation's phase ``rollout``, on ``model``: the engine's Hugging Face
    model): its KV cache (transformers' ``DynamicCache``) filled to the last decoding step's length for the term's
    ``generation_batch_size`` sequences of ``prompt + completion`` tokens, that step's forward (its cache growing by
    one token) and the sampling of its logits at ``temperature``, as ``generate`` runs them. Not the prompts'
    prefill (the term counts no activation of it)."""
    from transformers import DynamicCache

    config = model.config
    length = term.prompt + term.completion - 1
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dtype = next(model.parameters()).dtype
    cache = DynamicCache(config=config)
    shape, none = (term.batch, config.num_key_value_heads, length, head_dim), (term.batch, config.num_key_value_heads,
                                                                                0, head_dim)
    for layer in range(config.num_hidden_layers):  # the cache concatenates (a copy): keys and values one at a time,
        # so that at most one layer's keys are held twice, as in a decoding step
        cache.update(torch.empty(shape, dtype=dtype), torch.empty(none, dtype=dtype), layer)
        cache.update(torch.empty(none, dtype=dtype), torch.empty(shape, dtype=dtype), layer)
    ids = torch.zeros(term.batch, 1, dtype=torch.int64)
    with warnings.catch_warnings():  # transformers >= 5.25 names it `cache` (`past_key_values` until 5.40)
        warnings.filterwarnings("ignore", message=".past_key_values. is deprecated", category=FutureWarning)
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
    # the sampling's probabilities; the draw by argmax (no weights were loaded: they may be anything, even NaN)
    torch.softmax(logits.float() / temperature, dim=-1).argmax(dim=-1)


def rollout_batch(model: ModelConfig, seq_len: int, batch: int) -> dict[str, torch.Tensor]:
    """A GRPO batch of one completion a row (prompt and completion ``seq_len // 2`` tokens each: the row is full).
    Real tensors: made before the fake mode."""
    half = seq_len // 2
    rows = []
    for _ in range(batch):
        ids = torch.randint(0, model.vocab_size, (seq_len,)).numpy()
        row = build_row([(ids, (torch.arange(seq_len) >= half).numpy())], seq_len, 0, segments=[0])
        row.update(advantages=torch.ones(1, dtype=torch.float64), rewards=torch.ones(1, dtype=torch.float64),
                   lengths=torch.tensor([seq_len - half]), std_zero=torch.zeros(1, dtype=torch.bool),
                   num_sequences=torch.tensor(1))
        rows.append(row)
    return _collate(rows)
