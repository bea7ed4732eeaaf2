"""Bytes the memory-bound work of one training step moves through device memory (docs/planner.md).

Everything that is not a matmul or an attention kernel (the norms, RoPE, SwiGLU's activation and product,
the residual adds, the casts autocast and FSDP2 make, gradient accumulation, the ring's log-sum-exp merges,
the chunked loss's soft-max, the AdamW step) is an eager op that reads its inputs and writes its outputs
once: its time is its bytes over the device-memory bandwidth (``Cluster.memory_bw``). The counts are the
code's own, op by op (an op's tensor inputs and outputs, views and allocations free), read off the
trainer's step under fake tensors at small shapes and fitted exactly by the widths the ops run at; the
fit is checked against the count at other shapes (tests/unit/test_step_time.py, which fails, with the new
numbers, when the code changes what it moves).

Per decoder layer and rank, ``t`` local tokens (``B * S / sp``), ``P_a = 2 d (H + Hkv) hd`` attention (MLA: its
projections' weights, :func:`~loongtrain.model.config.attention_weights`) and ``P_m = 3 d f`` MLP weights::

    layer bytes = t * (c_d d + c_f f + c_q H hd + c_kv He hd + c_hd hd + c_1) + c_a P_a + c_m P_m

with ``He`` the KV heads after the all-to-all's replication (docs/attention.md#the-gqa-rule) and the coefficients of
:data:`LAYER_BYTES` by precision (``autocast``: fp32 weights and residual stream, bf16 matmuls;
``sharded``: FSDP2's bf16 weights, bf16 everywhere; ``fp32``) and by whether the block is checkpointed
(``full`` and ``selective`` re-run the same non-attention ops; ``none`` re-runs nothing). ``forward`` is
the part the forward pass moves (the rest is the backward's, recompute included). With ``hp > 1`` the
all-to-alls' layout copies add :data:`HEAD_SPLIT_BYTES`; ``mlp_tiles`` re-runs the MLP's forward per
tile in the backward (:data:`MLP_TILE_BYTES`).

Outside the layers (:func:`head_bytes`): the embedding, the final norm and the chunked loss's soft-max
over fp32 logits, ``t * (c_V V + c_d d + c_1) + c_p V d``; the optimizer (:data:`OPTIMIZER_BYTES`):
torch's single-tensor AdamW (``foreach=False``) and the gradient clipping, per local parameter. A ring
step (``cp > 1``, :func:`ring_step_bytes`) merges its partial output into the fp32 accumulators in the
forward and adds dQ and the block's dK/dV into them in the backward; a ring of one member has none.
"""

from __future__ import annotations

from dataclasses import dataclass

from loongtrain.model.config import ModelConfig, attention_weights


@dataclass(frozen=True)
class Bytes:
    """Coefficients of one width each: bytes per token per element of ``d``, ``f``, ``H hd``, ``He hd``, ``hd``,
    per token (``one``), and per attention and MLP weight of the layer (``attn``, ``mlp``)."""

    d: float
    f: float
    q: float
    kv: float
    hd: float
    one: float
    attn: float
    mlp: float

    def total(self, model: ModelConfig, kv_heads: int, tokens: float) -> float:
        m = model
        per_token = (self.d * m.dim + self.f * m.ffn_dim + self.q * m.num_heads * m.head_dim
                     + self.kv * kv_heads * m.head_dim + self.hd * m.head_dim + self.one)
        attn = sum(attention_weights(m))  # 2 d (H + Hkv) hd, or MLA's projections
        return tokens * per_token + self.attn * attn + self.mlp * 3 * m.dim * m.ffn_dim


#: (precision, checkpointed) -> (the step's bytes, the forward's), per layer (module docstring)
LAYER_BYTES: dict[tuple[str, bool], tuple[Bytes, Bytes]] = {
    ("autocast", True): (Bytes(856.1, 39.4, 141.3, 150.3, 48.8, 854.9, 23.1, 17.6),
        Bytes(162, 10, 48, 48, 16, 108.9, 6, 6)),
    ("autocast", False): (Bytes(704.1, 29.4, 93.3, 102.3, 32.8, 746, 17.1, 11.6),
        Bytes(162, 10, 48, 48, 16, 108.9, 6, 6)),
    ("sharded", True): (Bytes(814, 38, 144.1, 148, 54.4, 611.3, 16, 16),
        Bytes(156, 10, 48, 48, 16, 112.1, 6, 6)),
    ("sharded", False): (Bytes(664, 28, 96.1, 100, 38.4, 508.9, 16, 16),
        Bytes(156, 10, 48, 48, 16, 112.1, 6, 6)),
    ("fp32", True): (Bytes(744, 76, 108.1, 116, 54.4, 616.1, 0, 0),
        Bytes(136, 20, 36, 36, 16, 108.9, 0, 0)),
    ("fp32", False): (Bytes(620, 56, 72.1, 80, 38.4, 507.2, 0, 0),
        Bytes(136, 20, 36, 36, 16, 108.9, 0, 0)),
    ("fp32-sharded", True): (Bytes(744, 76, 108.1, 116, 54.4, 661.1, 28, 28),
        Bytes(136, 20, 36, 36, 16, 128.2, 12, 12)),
    ("fp32-sharded", False): (Bytes(620, 56, 72.1, 80, 38.4, 552.3, 28, 28),
        Bytes(136, 20, 36, 36, 16, 128.2, 12, 12)),
}
#: extra bytes per token with ``hp > 1`` (the all-to-alls' contiguous copies) per element of ``H hd`` and of
#: ``He hd``, per byte of the compute dtype: the step's by checkpointing, and the forward's
HEAD_SPLIT_BYTES = {True: (4, 9), False: (3, 7)}
HEAD_SPLIT_FORWARD = (1, 2)
#: a tiled MLP (its norm and MLP re-run tile by tile in the backward), by precision: per token per element of
#: ``f`` and of ``d``, per MLP weight once and per extra tile (autocast: every tile casts the fp32 weights again)
MLP_TILE_BYTES: dict[str, tuple[float, float, float, float]] = {
    "autocast": (10, 64, 6, 18), "sharded": (10, 54, 0, 6), "fp32": (20, 64, 0, 12),
    "fp32-sharded": (20, 64, 0, 12),  # taken as fp32's (not fitted apart)
}
#: per token per vocabulary entry, per token per element of d, per token, per head parameter (module docstring)
HEAD_BYTES: dict[str, tuple[float, float, float, float]] = {
    "autocast": (68, 152, 392, 52), "sharded": (70, 148, 392, 36), "fp32": (60, 144, 392, 32),
    "fp32-sharded": (60, 144, 392, 32),
}
#: per local parameter: AdamW (``foreach=False``: 84 bytes of fp32 reads and writes) and clipping (12)
OPTIMIZER_BYTES = 96


def precision(dtype_bytes: int, sharded: bool) -> str:
    """The precision path of the trainer (docs/memory.md): FSDP2's gathered weights or autocast."""
    if dtype_bytes >= 4:
        return "fp32-sharded" if sharded else "fp32"
    return "sharded" if sharded else "autocast"


def layer_bytes(model: ModelConfig, *, tokens: float, kv_heads: int, hp: int, dtype_bytes: int, sharded: bool,
                checkpointed: bool, mlp_tiles: int = 1) -> tuple[float, float]:
    """``(step, forward)`` bytes one decoder layer's memory-bound ops move on one rank (module docstring)."""
    step, forward = LAYER_BYTES[precision(dtype_bytes, sharded), checkpointed]
    total = step.total(model, kv_heads, tokens)
    fwd = forward.total(model, kv_heads, tokens)
    if hp > 1:
        per_element = tokens * dtype_bytes * model.head_dim
        (q, kv), (q_f, kv_f) = HEAD_SPLIT_BYTES[checkpointed], HEAD_SPLIT_FORWARD
        total += per_element * (q * model.num_heads + kv * kv_heads)
        fwd += per_element * (q_f * model.num_heads + kv_f * kv_heads)
    if mlp_tiles > 1:
        per_f, per_d, once, per_tile = MLP_TILE_BYTES[precision(dtype_bytes, sharded)]
        weights = 3 * model.dim * model.ffn_dim
        total += tokens * (per_f * model.ffn_dim + per_d * model.dim) + weights * (once + per_tile * (mlp_tiles - 1))
    return total, fwd


def head_bytes(model: ModelConfig, *, tokens: float, dtype_bytes: int, sharded: bool) -> float:
    """Bytes of the embedding, the final norm and the chunked loss on one rank (module docstring)."""
    per_v, per_d, one, per_param = HEAD_BYTES[precision(dtype_bytes, sharded)]
    v, d = model.vocab_size, model.dim
    return tokens * (per_v * v + per_d * d + one) + per_param * v * d


def ring_step_bytes(q_tokens: float, heads: int, kv_heads: int, head_dim: int, dtype_bytes: int,
                    steps: int, v_head_dim: int | None = None) -> tuple[float, float]:
    """``(forward, backward)`` bytes per ring step of the memory-bound work of a pass of ``steps`` steps
    (``attn/ring_step.py``, ``attn/ring.py``), for ``q_tokens`` local queries of ``heads`` heads against blocks of as
    many tokens of ``kv_heads`` heads (``q`` and ``kv`` elements of Q and of K and V). Forward: the log-sum-exp
    merge of a piece's output into the fp32 accumulator (read and written twice, the piece cast and scaled:
    ``28 + c`` bytes per element, ``c = 4 + b`` the cast, none for fp32); once a pass, the accumulator zeroed,
    K and V stacked and the output cast back. Backward: dQ added into its fp32 accumulator (``8 + b``), the
    block's fp32 dK/dV contribution zeroed and the kernel's added (``12 + b`` per element of K and V), the
    received partial sum added on all but one step (``12``); once a pass, K and V stacked and dQ, dK/dV cast
    back. Checked against the ring's own ops (tests/unit/test_step_time.py: within 15%). ``v_head_dim`` (MLA; default
    ``head_dim``): the values', so the output and its accumulator are ``H Dv`` and a block ``He (D + Dv)``."""
    b = dtype_bytes
    cast = 4 + b if b < 4 else 0
    dv = v_head_dim or head_dim
    q = q_tokens * heads * dv  # the merged output (the forward's) and dQ (the backward's: q_tokens H D) below
    dq = q_tokens * heads * head_dim
    kv = q_tokens * kv_heads * (head_dim + dv)
    forward = (28 + cast) * q + (4 * q + 2 * kv * b + cast * q) / steps
    backward = (8 + b) * dq + (12 + b + 12 * (steps - 1) / steps) * kv + (cast * (dq + kv) + 2 * kv * b) / steps
    return forward, backward
