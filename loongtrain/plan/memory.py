"""Memory per device of one training step (bytes), by part.

Notation: ``P`` parameters, ``P_l`` per layer, ``L`` layers, ``d`` model dim, ``f`` FFN dim, ``V`` vocab,
``H`` heads, ``hd`` head dim, ``He`` KV heads on the wire (``Hkv``, or ``hp`` when replicated),
``t = B * S / sp`` tokens per device, ``b`` bytes of the compute dtype, ``z`` the ZeRO shard group size.

- ``states``: fp32 master weights + fp32 gradients + Adam m, v = ``16 * P / z``.
- ``working_params``: with sharding, the gathered fp32 weights in flight (two layers and the
  embedding/head), ``4 * (2 * P_l + V * d)``; plus, when the compute dtype is narrower than fp32, the
  autocast copies the matmuls save for backward: ``b * (L * P_l + V * d)`` without checkpointing, else
  only the recomputed layer's ``b * (P_l + V * d)``.
- ``activations``: saved per layer per token, elements ``a = 7d + 2*He*hd + 4f`` (norm inputs and
  outputs, q/k/v after the all-to-all, attention output before and after the all-to-all, residual
  input, SwiGLU's w1/w3/silu/product) plus the fp32 lse (``4H`` bytes), by ``ac_mode``:
  ``none``: ``L * t * (a*b + 4H)``; ``full``: ``L * t * d * b`` (layer inputs) plus one layer's full set
  during its recompute; ``selective``: ``L * t * (2*d*b + 4H)`` (input, attention output, lse) plus
  one layer's full set.
- ``logits``: ``t * V * (b + 4)`` (compute-dtype logits and their fp32 copy for the loss).
- ``workspace``: peak of the ring backward and the all-to-all: 3 K/V blocks and 4 dK/dV blocks
  (in flight, received, accumulated) of ``2 * t * He * hd`` elements, an fp32 dQ accumulator
  ``4 * t * d``, and the packed all-to-all send and receive buffers ``2 * b * t * (d + 2*He*hd)``.
"""

from __future__ import annotations

from loongtrain.model.config import ModelConfig, num_params
from loongtrain.parallel.config import AC_MODES, effective_kv_heads
from loongtrain.parallel.layout import Layout
from loongtrain.parallel.traffic import acc_bytes

STATE_BYTES_PER_PARAM = 16


def layer_params(model: ModelConfig) -> int:
    """Parameters of one decoder layer (attention, SwiGLU MLP, two norms)."""
    return (num_params(model, include_embeddings=False) - model.dim) // model.num_layers


def activation_elements_per_token(model: ModelConfig, hp: int) -> int:
    """``a = 7d + 2*He*hd + 4f``: compute-dtype elements saved per token per layer without checkpointing."""
    he = effective_kv_heads(model.num_heads, model.num_kv_heads, hp)
    return 7 * model.dim + 2 * he * model.head_dim + 4 * model.ffn_dim


def memory_per_rank(
    model: ModelConfig, layout: Layout, *, seq_len: int, batch: int, zero_size: int, ac_mode: str,
    dtype_bytes: int = 2,
) -> dict[str, float]:
    """Bytes per device by part (``states``, ``working_params``, ``activations``, ``logits``, ``workspace``)
    and their ``total``."""
    if ac_mode not in AC_MODES:
        raise ValueError(f"ac_mode={ac_mode!r} is not one of {AC_MODES}")
    if zero_size < 1 or layout.world_size % zero_size:
        raise ValueError(f"zero shard group size {zero_size} must divide world_size={layout.world_size}")
    b, d, L = dtype_bytes, model.dim, model.num_layers
    p = num_params(model)
    t = batch * seq_len / layout.sp
    he = effective_kv_heads(model.num_heads, model.num_kv_heads, layout.hp)
    lse = 4 * model.num_heads
    full_layer = t * (activation_elements_per_token(model, layout.hp) * b + lse)
    if ac_mode == "none":
        acts = L * full_layer
    elif ac_mode == "full":
        acts = L * t * d * b + full_layer
    else:
        acts = L * t * (2 * d * b + lse) + full_layer
    p_l, head = layer_params(model), model.vocab_size * d
    working = 0 if zero_size == 1 else 4 * (2 * p_l + head)
    if b < 4:
        working += b * ((L if ac_mode == "none" else 1) * p_l + head)
    kv_elems = 2 * t * he * model.head_dim
    parts = {
        "states": STATE_BYTES_PER_PARAM * p / zero_size,
        "working_params": float(working),
        "activations": float(acts),
        "logits": t * model.vocab_size * (b + 4),
        "workspace": 3 * kv_elems * b + 4 * kv_elems * acc_bytes(b) + 4 * t * d
        + 2 * b * t * (d + 2 * he * model.head_dim),
    }
    parts["total"] = sum(parts.values())
    return parts
