"""Unsharded references for the GRPO tests, independent of loongtrain's loss code:

- :func:`completion_logps`: a model's per-token log-probabilities of one completion after its prompt, one
  sequence alone (its own positions, no packing), at a temperature;
- :func:`formula_loss`: TRL's GRPO loss written from its definitions on padded ``[N, L]`` tensors with a
  completion mask (ratio, two-sided clip, k3 KL, dapo/grpo/dr_grpo, token or sequence ratios) and TRL's
  metrics over the batch;
- :func:`trl_advantages`: TRL's advantage formula on rewards laid out ``[groups, G]`` (``view(-1, G)``);
- :func:`trl_loss`: TRL's own ``GRPOTrainer._compute_loss`` on a Hugging Face model (the bar-AB check)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def completion_logps(model: Any, prompt: Sequence[int], completion: Sequence[int], temperature: float = 1.0,
                     hf: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp [len(completion)], entropy [len(completion)])`` of ``completion`` after ``prompt``, one forward
    of ``model`` on the sequence alone (differentiable ``logp``; float64 when the model is)."""
    ids = torch.tensor(list(prompt) + list(completion))[None]
    logits = model(input_ids=ids).logits if hf else model(ids)
    z = logits[0, len(prompt) - 1:-1] / temperature
    logp_all = torch.log_softmax(z, dim=-1)
    picked = logp_all.gather(1, torch.tensor(list(completion))[:, None]).squeeze(1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return picked, entropy.detach()


def _pad(rows: Sequence[torch.Tensor], width: int) -> torch.Tensor:
    out = torch.zeros(len(rows), width, dtype=rows[0].dtype)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


def formula_loss(logps: Sequence[torch.Tensor], advantages: Sequence[float], *, loss_type: str, epsilon: float = 0.2,
                 epsilon_high: float | None = None, beta: float = 0.0, importance_sampling: str = "token",
                 max_completion_length: int = 0, old: Sequence[torch.Tensor] | None = None,
                 ref: Sequence[torch.Tensor] | None = None,
                 entropies: Sequence[torch.Tensor] | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """TRL's GRPO loss of one batch holding every completion (its definitions, module docstring)."""
    high = epsilon if epsilon_high is None else epsilon_high
    width = max(len(x) for x in logps)
    lp = _pad(list(logps), width)
    mask = _pad([torch.ones(len(x), dtype=lp.dtype) for x in logps], width)
    old_lp = lp.detach() if old is None else _pad([torch.as_tensor(o, dtype=lp.dtype) for o in old], width)
    adv = torch.tensor(list(advantages), dtype=lp.dtype)[:, None]
    log_ratio = lp - old_lp
    if importance_sampling == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1))[:, None]
    ratio = torch.exp(log_ratio)
    surrogate = -torch.min(ratio * adv, torch.clamp(ratio, 1 - epsilon, 1 + high) * adv)
    per_token = surrogate.expand_as(lp)
    metrics: dict[str, float] = {}
    if beta:
        r = _pad([torch.as_tensor(x, dtype=lp.dtype) for x in ref], width)
        kl = torch.exp(r - lp) - (r - lp) - 1
        per_token = per_token + beta * kl
        metrics["kl"] = float(((kl * mask).sum() / mask.sum()).detach())
    if loss_type == "grpo":
        loss = ((per_token * mask).sum(-1) / mask.sum(-1)).mean()
    elif loss_type == "dapo":
        loss = (per_token * mask).sum() / mask.sum()
    else:
        loss = (per_token * mask).sum() / (len(logps) * max_completion_length)
    low = ((ratio < 1 - epsilon) & (adv < 0)).to(lp.dtype)
    up = ((ratio > 1 + high) & (adv > 0)).to(lp.dtype)
    region = torch.maximum(low, up)
    for name, flag in (("clip_ratio/low_mean", low), ("clip_ratio/high_mean", up), ("clip_ratio/region_mean", region)):
        metrics[name] = float(flag.mean()) if importance_sampling == "sequence" else \
            float((flag.expand_as(lp) * mask).sum() / mask.sum())
    if entropies is not None:
        metrics["entropy"] = float((_pad(list(entropies), width) * mask).sum() / mask.sum())
    return loss, metrics


def trl_advantages(rewards: Sequence[float], num_generations: int, scale: str = "group") -> torch.Tensor:
    """TRL's advantages of ``rewards`` in consecutive groups of ``num_generations``: the group's mean
    subtracted, divided by the unbiased std (+1e-4) of the group (``group``) or of all (``batch``)."""
    r = torch.tensor(list(rewards), dtype=torch.float64)
    grouped = r.view(-1, num_generations)
    mean = grouped.mean(1).repeat_interleave(num_generations)
    std = (grouped.std(1, unbiased=True).repeat_interleave(num_generations) if scale == "group" else
           r.std(unbiased=True).expand_as(r))
    return (r - mean) / (std + 1e-4) if scale != "none" else r - mean


# ---- TRL's own loss ------------------------------------------------------------------------------------

def trl_trainer(model: Any, tokenizer: Any, out_dir: str, **config: Any) -> Any:
    """A ``GRPOTrainer`` around ``model`` (never trained: its ``_compute_loss`` is the reference)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    args = GRPOConfig(output_dir=out_dir, report_to=[], use_cpu=True, bf16=False, fp16=False,
                      per_device_train_batch_size=config["num_generations"], **config)
    trainer = GRPOTrainer(model=model, reward_funcs=[lambda prompts, completions, **_: [0.0] * len(prompts)],
                          args=args, train_dataset=Dataset.from_list([{"prompt": "x"}]),
                          processing_class=tokenizer)
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def trl_loss(trainer: Any, rollouts: Sequence[tuple[list[int], list[int]]], advantages: Sequence[float], *,
             pad_id: int, old: Sequence[Sequence[float]] | None = None,
             ref: Sequence[torch.Tensor] | None = None) -> tuple[float, dict[str, float]]:
    """``GRPOTrainer._compute_loss`` of one batch of ``(prompt_ids, completion_ids)`` (prompts padded on the
    left, completions on the right, as TRL lays them out) and its logged metrics."""
    prompt_width = max(len(p) for p, _ in rollouts)
    width = max(len(c) for _, c in rollouts)
    n = len(rollouts)
    prompt_ids = torch.full((n, prompt_width), pad_id)
    prompt_mask = torch.zeros(n, prompt_width, dtype=torch.int64)
    completion_ids = torch.full((n, width), pad_id)
    completion_mask = torch.zeros(n, width, dtype=torch.int64)
    for i, (p, c) in enumerate(rollouts):
        prompt_ids[i, prompt_width - len(p):] = torch.tensor(p)
        prompt_mask[i, prompt_width - len(p):] = 1
        completion_ids[i, :len(c)] = torch.tensor(c)
        completion_mask[i, :len(c)] = 1
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
              "completion_mask": completion_mask, "advantages": torch.tensor(list(advantages), dtype=torch.float32),
              "num_items_in_batch": completion_mask.sum()}
    if old is not None:
        inputs["old_per_token_logps"] = _pad([torch.tensor(list(o), dtype=torch.float32) for o in old], width)
    if ref is not None:
        inputs["ref_per_token_logps"] = _pad([r.detach().to(torch.float32) for r in ref], width)
    trainer._metrics["train"].clear()
    trainer.model.train()
    with torch.no_grad():
        loss = trainer._compute_loss(trainer.model, inputs)
    return float(loss), {k: v[-1] for k, v in trainer._metrics["train"].items()}
