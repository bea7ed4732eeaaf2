"""DPO's memory phase (docs/post-training.md#memory; the protocol: loongtrain/model/memory.py): the reference pass
(loongtrain/objectives/reference.py), forward only under ``no_grad``, before the first step, and the preference
rows the simulation measures it and the DPO step on.

The pass's device bytes (measured: the simulation's phase ``reference``): the policy's weights and, on a resume,
its AdamW moments (``states`` less the gradients' ``4 * P / z``), the reference's own fp32 weights sharded as the
policy's (``4 * P / z``; on the host with ``offload_params``), its gathered weights without gradients (ZeRO:
``w * (n * P_l + R)``, ``n`` = 2 blocks, or all ``L`` without resharding; autocast: one block's and the head's
copies, ``b * (P_l + V * d)``), and the larger of a block's MLP moment (the residual stream in and out, the norm's
output and the MLP's intermediates of a tile: ``t * (2 * d * r + d * b + m)``) and the loss's (the final hidden
states and ``logits``).
"""

from __future__ import annotations

import torch

from loongtrain.data.pipeline import _collate
from loongtrain.data.whole_packing import build_row
from loongtrain.model.config import ModelConfig, num_params
from loongtrain.model.memory import MemoryTerm, StepShape
from loongtrain.plan.memory_model import layer_params

#: bytes per parameter of the reference's own weights: fp32
REFERENCE_WEIGHT_BYTES = 4


class ReferencePass(MemoryTerm):
    """The reference pass before the first step (module docstring)."""

    name = "dpo reference"

    def phases(self, s: StepShape, parts: dict[str, float], mlp_intermediates: float) -> dict[str, float]:
        model, t, b, z = s.model, s.tokens, s.dtype_bytes, s.zero_size
        p, p_l, d = num_params(model), layer_params(model), model.dim
        weights = 0.0 if s.offload_params else 12 * p / z + REFERENCE_WEIGHT_BYTES * p / z
        if s.sharded:
            w = min(b, 4)
            root = model.vocab_size * d * (1 if model.tie_embeddings else 2) + d
            gathered = w * ((2 if s.reshard_after_forward else model.num_layers) * p_l + root)
        else:
            gathered = b * (p_l + model.vocab_size * d) if b < 4 else 0.0
        r = s.residual_bytes
        block = t * (2 * d * r + d * b + mlp_intermediates)
        return {"reference": weights + gathered + max(block, t * d * r + parts["logits"])}

    def phase_host(self, s: StepShape) -> float:
        return REFERENCE_WEIGHT_BYTES * num_params(s.model) / s.zero_size if s.offload_params else 0.0


def dpo_phases() -> tuple[MemoryTerm, ...]:
    """DPO's memory phases: the reference pass."""
    return (ReferencePass(),)


def preference_batch(model: ModelConfig, seq_len: int, batch: int) -> dict[str, torch.Tensor]:
    """A DPO batch of one pair a row (prompt and completions ``seq_len // 4`` tokens each: the row is full), its
    reference log-probabilities given (what the reference pass caches). Real tensors: made before the fake mode."""
    quarter = seq_len // 4
    completion = torch.arange(2 * quarter) >= quarter
    rows = []
    for b in range(batch):
        prompt, chosen, rejected = torch.randint(0, model.vocab_size, (3, quarter))
        docs = [(torch.cat([prompt, c]).numpy(), completion.numpy()) for c in (chosen, rejected)]
        row = build_row(docs, seq_len, 0, segments=[0, 1])
        row.update(num_pairs=torch.tensor(1), ref_key=torch.tensor(b), ref_logps=torch.zeros(2, dtype=torch.float64))
        rows.append(row)
    return _collate(rows)
