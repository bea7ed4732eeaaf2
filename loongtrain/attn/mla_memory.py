"""MLA's memory term (docs/attention.md#mla): what latent attention (loongtrain/model/mla.py; its values' head dim
through the ring: loongtrain/attn/ring.py) keeps for its backward and holds in it, against what the planner counts
for plain attention (the protocol: loongtrain/model/memory.py).

The plain attention's kept set per token (loongtrain/plan/memory_model.py) has a ``d``-sized query and output, keys
and values of ``head_dim`` each (``2 He D``), the fp32 lse and one norm scale. Latent attention's, counted from its
ops (the norm fused into its input projections: loongtrain/parallelize/norm_linear.py):

- the query ``H D`` and the output ``H Dv`` (``Dv``: the values' head dim), keys ``He D`` and values ``He Dv``;
- the latents: the queries' (``q_lora_rank``, with its norm's output) and the keys' and values' (``kv_lora_rank +
  qk_rope_head_dim``, the norm's input a view of it, and the norm's output ``kv_lora_rank``), in the compute dtype;
- fp32 scales: one per fused projection (two) and per latent norm (one or two), where plain attention counts one.

So per token, without checkpointing, ``b [(H D - d) + (H Dv - d) + He (Dv - D) + latents] + 4 (1 + latent
norms)`` more; under selective recompute the kept ring output is ``H Dv`` (not ``d``) and with ``hp > 1`` the
all-to-alls' outputs ``H D + He (D + Dv) + H Dv`` (not ``2 d + 2 He D``); in a block's backward the output's
gradient is ``H Dv``, the op's dK/dV ``He (D + Dv)``, and its workspace that of V's own head dim
(:func:`~loongtrain.attn.ring.backward_workspace_bytes`). Each ``b`` the compute dtype's bytes; a hybrid's (Kimi-
Linear's) kept sets in its softmax layers' share only.
"""

from __future__ import annotations

from loongtrain.attn.ring import backward_workspace_bytes
from loongtrain.model.config import ModelConfig
from loongtrain.model.memory import Kept, MemoryTerm, StepShape
from loongtrain.parallel.config import effective_kv_heads


class LatentAttentionMemory(MemoryTerm):
    """The latent attention of ``model`` (module docstring)."""

    name = "mla"

    def __init__(self, model: ModelConfig) -> None:
        m = model
        self.latent = 2 * m.q_lora_rank + 2 * m.kv_lora_rank + m.qk_rope_head_dim
        self.scales = 4 * (1 + (2 if m.q_lora_rank else 1))  # the second fused projection's, the latent norms'

    @staticmethod
    def _heads(s: StepShape) -> tuple[int, int, int, int, int]:
        m = s.model
        return m.dim, m.num_heads, effective_kv_heads(m.num_heads, m.num_kv_heads, s.hp), m.head_dim, m.v_head_dim

    @staticmethod
    def _layers(s: StepShape) -> int:
        """The softmax-attention layers (a hybrid's linear-attention layers have their own term)."""
        return s.model.num_layers - len(s.model.linear_layers)

    def layer_bytes(self, s: StepShape) -> tuple[float, float]:
        d, h, he, qk, v = self._heads(s)
        per_layer = s.dtype_bytes * ((h * qk - d) + (h * v - d) + he * (v - qk) + self.latent) + self.scales
        return per_layer * self._layers(s) / s.model.num_layers, 0.0

    def kept(self, s: StepShape, kept: Kept, full_layer: float, mlp_part: float) -> Kept:
        if s.recompute != "selective":  # without checkpointing: layer_bytes; full: only the block inputs
            return kept
        d, h, he, qk, v = self._heads(s)
        per_token = (h * v - d) + ((h * qk - d) + (h * v - d) + he * (v - qk)) * (s.hp > 1)
        extra = self._layers(s) * s.tokens * s.dtype_bytes * per_token
        return Kept(kept.activations + extra, kept.layer_kept + extra, kept.host)

    def attention_backward(self, s: StepShape) -> float:
        d, h, he, qk, v = self._heads(s)
        t, b = s.tokens, s.dtype_bytes
        workspace = (backward_workspace_bytes(t, h, he, qk, b, s.cp, v_head_dim=v)
                     - backward_workspace_bytes(t, h, he, qk, b, s.cp))
        return t * b * ((h * v - d) + he * (v - qk)) + workspace


def latent_attention_memory(model: ModelConfig) -> tuple[MemoryTerm, ...]:
    """The term of a model with latent attention, else none."""
    return (LatentAttentionMemory(model),) if model.latent_attention else ()
