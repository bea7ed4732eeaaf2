"""Generation engines for the online GRPO loop (docs/rl.md#engines).

An engine samples completions from the policy's current weights; the loop hands it new weights after every
update (:meth:`GenerationEngine.load_weights`). :class:`TransformersEngine`, the embedded default, is
transformers' own ``generate`` on a plain Hugging Face causal LM (the policy's architecture, without
2D-Attention) on one device, filled with the policy's weights gathered from their shards
(:func:`policy_weights`). Another engine (vLLM, SGLang) implements the same two methods.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from loongtrain.hf.convert import hf_config_from_model_config, native_to_hf_state_dict
from loongtrain.model.config import ModelConfig

Tensor = torch.Tensor


class GenerationEngine(Protocol):
    """What the online loop asks of an engine."""

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Take the policy's weights (Hugging Face names, full tensors)."""

    def generate(self, prompts: Sequence[Sequence[int]], num_generations: int, max_new_tokens: int,
                 temperature: float, seed: int) -> list[list[int]]:
        """``num_generations`` sampled completions of each prompt (token ids), prompt-major: each one's ids up
        to and including the first EOS, or ``max_new_tokens`` ids without one. The same ``seed`` and weights
        give the same completions."""


def policy_weights(model: nn.Module, model_config: ModelConfig, hf: bool) -> dict[str, Tensor]:
    """The policy's full weights in Hugging Face names, on rank 0's CPU (empty on the other ranks). Collective
    over every rank when the model is sharded (FSDP2: each parameter gathered)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    if not state or hf:
        return state
    return native_to_hf_state_dict(state, model_config)


class TransformersEngine:
    """The embedded engine (module docstring): ``model`` a Hugging Face causal LM on ``device``."""

    def __init__(self, model: nn.Module, eos_id: int, device: torch.device) -> None:
        self.model, self.eos_id, self.device = model.to(device).eval().requires_grad_(False), eos_id, device

    @classmethod
    def for_model(cls, model_dir: str | None, model_config: ModelConfig, dtype: torch.dtype, eos_id: int,
                  device: torch.device) -> TransformersEngine:
        """An engine of the policy's architecture: ``model_dir``'s config (a Hugging Face model), else the
        Llama config of a loongtrain preset (loongtrain/hf/convert.py); weights come with
        :meth:`load_weights`."""
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.initialization import no_init_weights

        config = (AutoConfig.from_pretrained(str(Path(model_dir)), local_files_only=True) if model_dir else
                  hf_config_from_model_config(model_config))
        config.use_cache = True
        # allocated on the device without an initialisation (also under the simulation's fake tensors, which cannot
        # be moved off the meta device)
        with torch.device(device), no_init_weights():
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
        return cls(model, eos_id, device)

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        state = dict(weights)
        missing, unexpected = self.model.load_state_dict(state, strict=False, assign=False)
        missing = [m for m in missing if not (m == "lm_head.weight" and self.model.config.tie_word_embeddings)]
        assert not missing and not unexpected, f"engine weights: missing {missing[:4]}, unexpected {unexpected[:4]}"
        if getattr(self.model.config, "tie_word_embeddings", False):
            self.model.tie_weights()
        _restore_buffers(self.model)

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], num_generations: int, max_new_tokens: int,
                 temperature: float, seed: int) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.eos_id, dtype=torch.int64)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding: every prompt ends where generation starts
            ids[i, width - len(p):] = torch.tensor(list(p), dtype=torch.int64)
            mask[i, width - len(p):] = 1
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(seed)
            out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                      do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                                      max_new_tokens=max_new_tokens, num_return_sequences=num_generations,
                                      pad_token_id=self.eos_id, eos_token_id=self.eos_id)
        completions = []
        for row in out[:, width:].tolist():
            end = row.index(self.eos_id) + 1 if self.eos_id in row else len(row)
            completions.append(row[:end])
        return completions


def _restore_buffers(model: nn.Module) -> None:
    """Non-persistent buffers (RoPE's inverse frequencies) of a model built on the meta device."""
    from loongtrain.hf.build import restore_hf_buffers

    restore_hf_buffers(model)


def describe(engine: Any) -> str:
    return f"{type(engine).__name__} on {getattr(engine, 'device', '?')}"
