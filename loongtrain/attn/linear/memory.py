"""Linear attention's memory term (docs/linear-attention.md#planning; the protocol: loongtrain/model/memory.py): what a
linear-attention layer holds, counted from the ops of its bound forward
(loongtrain/hf/linear.py, loongtrain/attn/linear/api.py) and of ``fla``'s kernel, per token of the rank (``t = B *
S / sp``; a tensor in the heads' layout has the same elements per token as one over every head) and per layer.

Notation: ``d`` model dim, ``Hk`` key heads (``He`` as they enter the all-to-all: :func:`~loongtrain.parallel.
config.effective_kv_heads`), ``Hv`` value heads, ``Dk``, ``Dv`` their widths, ``C = 2 He Dk + Hv Dv`` the
convolution's channels, ``K`` its kernel, ``b`` the activations' bytes, ``a`` the compute dtype's (4; 8 for fp64).

- ``wrapper_bytes``: the projections' input ``d b``; the convolution's input with its halo and its pre-activation
  (``2 C b``) and its visibility mask (``K``); the q/k normalisation's inputs (the convolution's whole output
  ``C b`` when ``b = a``, else their ``a`` copies ``2 He Dk a``) and scales (``2 He a``); the decay's softplus input
  and output (``2 Hv a``) and beta (``Hv b``); the gated norm's tensors (``b = a``: ``5 Hv Dv a``, else ``3 Hv Dv a
  + 2 Hv Dv b``) and scale (``Hv a``); the output projection's input (``Hv Dv b``). Tested against the tensors
  autograd keeps (tests/unit/test_linear_attention.py).
- ``kernel_bytes``: ``fla``'s saved set: q, k (repeated to the value heads), v (widened by ``Dk`` columns when
  the state is composed), ``g`` (``a``), beta, and its ``64 x 64`` chunk inverse (``64 b`` per head); with the
  widening, the output in the compute dtype (``Hv (Dv + Dk) a``) that the composition reads.
- ``state_bytes`` (per layer, independent of ``S``): the gathered state pairs ``B cp R Hv' Dk (Dv + Dk) a`` and the
  composed states ``(cp R + R) B Hv' Dk Dv a`` the backward needs (``R`` run slots, ``Hv' = Hv / hp``).
- ``backward_bytes``: ``fla``'s backward recomputes each 64-token chunk's state and its gradient,
  ``2 Hv Dk (Dv + Dk) a / 64`` per token (with the widening).

The planner's block is a Llama block: the term replaces, in the linear layers' share of it, the softmax attention's
kept set by the linear layer's (and under selective recompute the ops' outputs each keeps), and adds the chunk
states to a block's backward. Measured at small sizes: the wrapper's part against what autograd keeps; ``fla``'s
part is read from its code (no GPU here); the state pairs are an upper bound (every rank counted as composing every
run).
"""

from __future__ import annotations

from loongtrain.attn.linear.layout import RunLayout
from loongtrain.model.config import DELTA_RULE_CHUNK, ModelConfig, linear_channels
from loongtrain.model.memory import Kept, MemoryTerm, StepShape
from loongtrain.parallel.config import effective_kv_heads


def _shape(model: ModelConfig, hp: int) -> tuple[int, int, int, int, int]:
    """``(He, Hv, Dk, Dv, C)`` of the model's linear layers at ``hp`` (``C`` with the replicated key heads)."""
    keys = effective_kv_heads(model.linear_num_value_heads, model.linear_num_key_heads, hp)
    dk, dv, values = model.linear_key_head_dim, model.linear_value_head_dim, model.linear_num_value_heads
    return keys, values, dk, dv, linear_channels(model) + 2 * (keys - model.linear_num_key_heads) * dk


def wrapper_bytes(model: ModelConfig, hp: int, b: int) -> float:
    """Bytes per token a linear layer's bound forward keeps outside its kernel (module docstring)."""
    a = 8 if b == 8 else 4
    keys, values, dk, dv, channels = _shape(model, hp)
    conv = 2 * channels * b + model.linear_conv_kernel_dim
    norm_qk = (channels * b if b == a else 2 * keys * dk * a) + 2 * keys * a
    gates = 2 * values * a + values * b
    gated_norm = (5 * values * dv * a if b == a else 3 * values * dv * a + 2 * values * dv * b) + values * a
    return float(model.dim * b + conv + norm_qk + gates + gated_norm + values * dv * b)


def kernel_bytes(model: ModelConfig, b: int, widened: bool) -> float:
    """Bytes per token ``fla``'s kernel keeps (and, ``widened``, the composition's read of its output)."""
    a = 8 if b == 8 else 4
    values, dk, dv = model.linear_num_value_heads, model.linear_key_head_dim, model.linear_value_head_dim
    width = dv + dk if widened else dv
    kept = values * (2 * dk * b + width * b + a + b + DELTA_RULE_CHUNK * b)
    return float(kept + (values * width * a if widened else 0))


def run_slots(cp: int) -> int:
    """Run slots per context rank under zigzag (:class:`~loongtrain.attn.linear.layout.RunLayout`): 1 on one rank."""
    return RunLayout(2 * cp, cp).slots


def state_bytes(model: ModelConfig, *, cp: int, batch: int, hp: int, b: int) -> float:
    """Bytes per layer of the state pairs and composed states kept for the backward (0 with one context rank)."""
    if cp == 1:
        return 0.0
    a = 8 if b == 8 else 4
    values, dk, dv = model.linear_num_value_heads // hp, model.linear_key_head_dim, model.linear_value_head_dim
    slots = run_slots(cp)
    runs = cp * slots
    return float(batch * values * dk * a * (runs * (dv + dk) + (runs + slots) * dv))


def backward_bytes(model: ModelConfig, b: int, widened: bool) -> float:
    """Bytes per token ``fla``'s backward holds while it runs: each chunk's recomputed state and its gradient."""
    a = 8 if b == 8 else 4
    dk, dv = model.linear_key_head_dim, model.linear_value_head_dim
    width = dv + dk if widened else dv
    return 2.0 * model.linear_num_value_heads * dk * width * a / DELTA_RULE_CHUNK


def layer_bytes(model: ModelConfig, *, tokens: float, batch: int, hp: int, cp: int, b: int) -> float:
    """Bytes per token of one linear layer's kept set without checkpointing: :func:`wrapper_bytes`,
    :func:`kernel_bytes` and :func:`state_bytes` spread over the rank's ``tokens``."""
    return (wrapper_bytes(model, hp, b) + kernel_bytes(model, b, cp > 1)
            + state_bytes(model, cp=cp, batch=batch, hp=hp, b=b) / tokens)


def selective_bytes(model: ModelConfig, *, tokens: float, batch: int, hp: int, cp: int, b: int) -> float:
    """Bytes per token selective recompute keeps of a linear layer beyond its input: the outputs of its custom ops
    (loongtrain/parallelize/recompute.py): with ``hp > 1`` the all-to-alls' (the convolution's input, the gates
    in the compute dtype, beta, the output back), and the gathered halos and state pairs (per layer)."""
    a = 8 if b == 8 else 4
    keys, values, dk, dv, channels = _shape(model, hp)
    heads = (channels * b + values * a + values * b + values * dv * b) if hp > 1 else 0.0
    slots = run_slots(cp)
    gathered = batch * cp * slots * ((model.linear_conv_kernel_dim - 1) * channels // hp * b
                                     + values // hp * dk * (dv + dk) * a) if cp > 1 else 0.0
    return heads + gathered / tokens


def softmax_bytes(model: ModelConfig, hp: int, b: int, selective: bool) -> float:
    """What the planner's Llama block counts per token for its softmax attention (plan/memory_model.py): without
    checkpointing q, k, v after the all-to-all, the attention output and the fp32 log-sum-exp; under selective
    recompute the ring's output, its log-sum-exp and, with ``hp > 1``, the all-to-alls' outputs."""
    he = effective_kv_heads(model.num_heads, model.num_kv_heads, hp)
    if selective:
        return model.dim * b + (2 * model.dim + 2 * he * model.head_dim) * b * (hp > 1) + 4 * model.num_heads
    return (2 * model.dim + 2 * he * model.head_dim) * b + 4 * model.num_heads


class LinearAttentionMemory(MemoryTerm):
    """The linear-attention layers of a hybrid (module docstring): each keeps its own set instead of a softmax
    attention's, and its backward holds ``fla``'s recomputed chunk states."""

    name = "linear attention"

    def __init__(self, model: ModelConfig) -> None:
        self.layers = len(model.linear_layers)

    def _share(self, s: StepShape) -> float:
        return self.layers / s.model.num_layers

    def layer_bytes(self, s: StepShape) -> tuple[float, float]:
        linear = layer_bytes(s.model, tokens=s.tokens, batch=s.batch, hp=s.hp, cp=s.cp, b=s.dtype_bytes)
        return self._share(s) * (linear - softmax_bytes(s.model, s.hp, s.dtype_bytes, False)), 0.0

    def kept(self, s: StepShape, kept: Kept, full_layer: float, mlp_part: float) -> Kept:
        if s.recompute != "selective":
            return kept
        linear = selective_bytes(s.model, tokens=s.tokens, batch=s.batch, hp=s.hp, cp=s.cp, b=s.dtype_bytes)
        change = self.layers * s.tokens * (linear - softmax_bytes(s.model, s.hp, s.dtype_bytes, True))
        return Kept(kept.activations + change, kept.layer_kept + change, kept.host)

    def attention_backward(self, s: StepShape) -> float:
        return s.tokens * backward_bytes(s.model, s.dtype_bytes, s.cp > 1)


def linear_memory(model: ModelConfig) -> tuple[MemoryTerm, ...]:
    """The term of a model with linear-attention layers, else none."""
    return (LinearAttentionMemory(model),) if model.linear_layers else ()
