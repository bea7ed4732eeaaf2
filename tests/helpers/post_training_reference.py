"""Unsharded references for the post-training tests, computed with Hugging Face's own pieces only: the
tokenizer's ``apply_chat_template(..., return_assistant_tokens_mask=True)`` and ``__call__``, and the model's
forward on one conversation or one sequence at a time (its own positions, no packing)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from tests.helpers.hf_models import fp64_rmsnorm, fp64_rope


def hf_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def hf_model(path, dtype: torch.dtype = torch.float64):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="sdpa")
    model.config.use_cache = False
    return model


def assistant_tokens(tokenizer, messages) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [n], mask [n])`` by HF's ``apply_chat_template`` with its assistant mask."""
    out = tokenizer.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    return torch.tensor(out["input_ids"]), torch.tensor(out["assistant_masks"], dtype=torch.bool)


def sft_sums(model, tokenizer, conversations: Sequence) -> tuple[torch.Tensor, int]:
    """``(sum of the cross-entropy of every assistant-masked token, their count)`` over ``conversations``,
    each one forward of the HF model on its own."""
    total, count = 0.0, 0
    for messages in conversations:
        ids, mask = assistant_tokens(tokenizer, messages)
        logits = model(input_ids=ids[None]).logits[0, :-1]
        targets = mask[1:]
        total = total + F.cross_entropy(logits[targets], ids[1:][targets], reduction="sum")
        count += int(targets.sum())
    return total, count


def trl_pair_ids(tokenizer, prompt: str, chosen: str, rejected: str) -> tuple[list[int], list[int], list[int]]:
    """TRL's tokenization of a text pair, with the HF tokenizer: each piece alone, no special tokens, EOS
    after each completion."""
    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    eos = [tokenizer.eos_token_id]
    return ids(prompt), ids(chosen) + eos, ids(rejected) + eos


def completion_logp(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """The HF model's summed log-probability of ``completion`` after ``prompt`` (one forward)."""
    ids = torch.tensor(prompt + completion)[None]
    logps = torch.log_softmax(model(input_ids=ids).logits[0, :-1].to(torch.float64), dim=-1)
    positions = torch.arange(len(prompt) - 1, ids.shape[1] - 1)
    return logps[positions, ids[0, positions + 1]].sum()


def dpo_reference(policy, reference, tokenizer, pairs: Sequence[dict], beta: float) -> tuple[torch.Tensor, dict]:
    """The DPO loss, mean over ``pairs`` of ``-logsigmoid(beta * ((pc - rc) - (pr - rr)))``, differentiable in
    ``policy``; and TRL's reward metrics."""
    losses, chosen_rewards, rejected_rewards = [], [], []
    for pair in pairs:
        p, c, r = trl_pair_ids(tokenizer, pair["prompt"], pair["chosen"], pair["rejected"])
        pc, pr = completion_logp(policy, p, c), completion_logp(policy, p, r)
        with torch.no_grad():
            rc, rr = completion_logp(reference, p, c), completion_logp(reference, p, r)
        chosen, rejected = beta * (pc - rc), beta * (pr - rr)
        losses.append(-F.logsigmoid(chosen - rejected))
        chosen_rewards.append(chosen.detach())
        rejected_rewards.append(rejected.detach())
    c, r = torch.stack(chosen_rewards), torch.stack(rejected_rewards)
    metrics = {"rewards/chosen": float(c.mean()), "rewards/rejected": float(r.mean()),
               "rewards/margins": float((c - r).mean()), "rewards/accuracies": float((c > r).double().mean())}
    return torch.stack(losses).mean(), metrics


def _fp64_rmsnorm(self, x):
    return fp64_rmsnorm(self, x) if x.dtype == torch.float64 else _STOCK[type(self)](self, x)


def _fp64_rope(self, x, position_ids):
    return fp64_rope(self, x, position_ids) if x.dtype == torch.float64 else _STOCK[type(self)](self, x, position_ids)


_STOCK: dict = {}


def fp64_hf_numerics() -> None:
    """For float64 inputs, Llama's and Qwen2's RMSNorm and RoPE angles computed in float64 (HF rounds them to
    float32 by design, which would hide the sharded path's agreement below 1e-7): patched on the classes, so
    the trainer's HF model and the reference both use them. For a test process of its own (a spawned worker)
    or a test that restores them (:func:`restore_hf_numerics`)."""
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen2 import modeling_qwen2

    for cls, fn in ((modeling_llama.LlamaRMSNorm, _fp64_rmsnorm), (modeling_qwen2.Qwen2RMSNorm, _fp64_rmsnorm),
                    (modeling_llama.LlamaRotaryEmbedding, _fp64_rope),
                    (modeling_qwen2.Qwen2RotaryEmbedding, _fp64_rope)):
        _STOCK.setdefault(cls, cls.forward)
        cls.forward = fn


def restore_hf_numerics() -> None:
    for cls, forward in _STOCK.items():
        cls.forward = forward
