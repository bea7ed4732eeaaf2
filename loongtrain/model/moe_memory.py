"""Mixture-of-experts' memory term (docs/moe-and-gpt-oss.md#planning): what an expert layer (loongtrain/model/moe.py)
keeps for its backward and holds in it, in place of a dense SwiGLU MLP's (the protocol: loongtrain/model/memory.py).

Per token of an expert layer, counted from the ops of :func:`~loongtrain.model.moe.moe_forward`:

- kept: the experts' packed gate/up output and SwiGLU's product, SiLU recomputed (``3 k f_e b``); the shared
  experts' (``shared_ffn_dim``, a dense SwiGLU MLP every token runs through: ``4 f_s b``); the token's ``k``
  copies gathered in expert order and the experts' ``k`` outputs (``2 k d b``); the router's fp32 probabilities
  twice (routing, and the load-balancing statistics: ``8 E``); the ``k`` routing weights (``b`` each, and fp32
  ``4``), the int64 sort order and token indices (``24`` each) and the renormalization's fp32 sum (``4``);
- in the backward beyond a dense MLP's: the tokens' gradients gathered in expert order and the product that gives
  the routing weights' gradient (``2 k d b``; ``_Combine``);
- the largest parameter: the experts' fused gate/up projection (``E * 2 f_e * d``).

Each averaged over the layers (a dense model has no expert layer: no term).
"""

from __future__ import annotations

from loongtrain.model.config import ModelConfig
from loongtrain.model.memory import MemoryTerm, States, StepShape

#: bytes of the int64 expert sort order and token indices, per routed copy (8 bytes each, three index tensors)
INDEX_BYTES = 3 * 8


class MoEMemory(MemoryTerm):
    """The expert layers of ``model`` (module docstring)."""

    name = "moe"

    def __init__(self, model: ModelConfig) -> None:
        self.layers = len(model.moe_layers)

    def dense_layers(self, s: StepShape) -> int:
        return s.model.num_layers - self.layers

    def mlp_intermediates(self, s: StepShape) -> float:
        m, b = s.model, s.dtype_bytes
        k = m.top_k
        # the routed experts' (SiLU recomputed), and the shared experts' as a dense SwiGLU's
        swiglu = b * (self.layers * (3 * k * m.moe_ffn_dim + 4 * m.shared_ffn_dim)) / m.num_layers / s.tiles
        per_layer = 2 * k * m.dim * b + 8 * m.num_experts + k * (b + 4 + INDEX_BYTES) + 4
        return swiglu + per_layer * self.layers / m.num_layers

    def mlp_backward(self, s: StepShape) -> float:
        m = s.model
        return 2 * m.top_k * m.dim * s.dtype_bytes * self.layers / m.num_layers

    def states(self, s: StepShape, states: States) -> States:
        m = s.model
        states.largest_param = max(states.largest_param, 2 * m.num_experts * m.moe_ffn_dim * m.dim)
        return states


def moe_memory(model: ModelConfig) -> tuple[MemoryTerm, ...]:
    """The term of a model with expert layers, else none."""
    return (MoEMemory(model),) if model.moe_layers else ()
