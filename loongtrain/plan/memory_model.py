"""Memory per device of one training step (bytes), by part.

Notation: ``P`` parameters, ``P_l`` per layer, ``L`` layers, ``d`` model dim, ``f`` FFN dim, ``V`` vocab,
``H`` heads, ``hd`` head dim, ``He`` KV heads on the wire (``Hkv``, or ``hp`` when replicated),
``t = B * S / sp`` tokens per device, ``b`` bytes of the compute dtype, ``z`` the ZeRO shard group size.

- ``states``: fp32 master weights + fp32 gradients + Adam m, v = ``16 * P / z``.
- ``working_params`` (as the trainer runs, docs/memory.md): with ZeRO (``z > 1``), FSDP2's gathered
  weights in the gathered dtype ``w`` (``b`` when narrower than fp32: ``MixedPrecisionPolicy``, no
  autocast; else fp32): the root's ``R = V*d*(1 or 2 untied) + d`` stays gathered through the step, plus
  two blocks in flight (this one and the prefetched one) or, with ``reshard_after_forward=False``, all
  ``L``; plus one block's (or the root's) unsharded gradient in ``w`` and, when ``w < 4``, its fp32 copy
  for the reduce-scatter: ``w * (n * P_l + R) + (w + 4 [w < 4]) * max(P_l, R)``. Without ZeRO, when the
  compute dtype is narrower than fp32, the autocast copies the matmuls save for backward:
  ``b * (L * P_l + V * d)`` without checkpointing, else only the recomputed layer's ``b * (P_l + V * d)``.
- ``activations`` (kept from forward to backward) and ``recompute`` (one layer's set rebuilt during
  its backward under checkpointing), as the model code saves them (measured: tests/dist/test_memory_model.py).
  Per token per layer without checkpointing, ``a_b = (2*He*hd + 4f) * b + 4H + 8`` (k/v after the
  all-to-all, SwiGLU's w1/w3/silu/product, fp32 lse and two RMSNorm ``rsqrt``) plus the ``d``-sized
  tensors (the MLP norm's input and output, q, attention output), whose dtypes depend on how bf16 is
  applied. The norms keep only their input and a per-token fp32 scale (loongtrain/model/rms_norm.py), and
  the attention norm's output is never kept (fused into q/k/v: loongtrain/parallelize/norm_linear.py): fp32 /
  fp64 runs ``5*d*b``; FSDP2 bf16 weights (``z > 1``, no autocast) ``4*d*b``; autocast (``z = 1``)
  ``2*d*4 + 4*d*b`` (fp32 residual stream, and one bf16 cast of the MLP norm's output per projection). With
  ``mlp_tiles > 1`` the MLP's norm output exists per tile: one ``d*b`` less (autocast: its two casts,
  ``2*d*b``). The residual
  stream (a layer's input) is ``r`` = 4 bytes under autocast, else ``b``; the final norm runs inside the
  chunked loss, which keeps only the gradient of its input (``d*r``).
  By ``recompute``: ``none``: ``L * t * a_b``; ``full``: ``L * t * d * r`` plus ``recompute =
  t * a_b``; ``selective``: ``L * t * (d * r + d * b + 4H)`` (input, attention output, lse; with
  ``hp > 1`` also the all-to-alls' outputs, ``(2d + 2*He*hd) * b``: q, k, v and the attention output
  back in token layout) plus the same ``recompute``.
- ``logits``: the peak of the chunked cross-entropy (loongtrain/loss/chunked.py,
  :func:`~loongtrain.loss.chunked.chunked_loss_peak_bytes` with ``t`` tokens): the fp32 log-sum-exp
  per token plus one chunk's logits in the compute dtype and fp32; the head's compute-dtype copy is
  already in ``working_params``. No rank holds the logits of all its tokens.
- ``workspace``: what one block's backward holds beyond its recomputed set, the larger of its two
  moments (:func:`layer_moments`): inside the MLP's backward (residual gradients, SwiGLU's gradients) and
  inside the attention kernel's (the residual, output and query gradients, the ring's K/V and dK/dV blocks,
  with a ring an fp32 dQ accumulator; with ``hp > 1`` in the heads' layout), less the MLP's part of the
  set, which is gone by then; and the CUDA kernel's own backward scratch
  (the kernel-scratch term, loongtrain/attn/kernel_memory.py).

What a feature adds is its memory term, beside its code (the protocol: loongtrain/model/memory.py;
:func:`~loongtrain.plan.memory_terms.run_terms` lists a step's terms in order): mixture-of-experts
(loongtrain/model/moe_memory.py: an expert layer's intermediates instead of SwiGLU's, its combine's backward, the
largest parameter), LoRA (loongtrain/model/lora_terms.py: the frozen base's and the adapters' kept sets, states and
gradients), the CUDA kernels' backward scratch (loongtrain/attn/kernel_memory.py), the tiled MLP
(loongtrain/parallelize/mlp_tiles.py: ``mlp_tiles = n > 1`` tiles, so of SwiGLU's ``4f * b`` bytes per token only
one tile's exist, ``a_b - 4f * b * (1 - 1/n)``, and the MLP norm's output per tile too), the offload modes
(loongtrain/parallelize/offload_memory.py: the kept sets and the states on the host; ``host`` is the pinned host
memory per rank they need, 0 without them) and an objective's phases outside the step (DPO's reference pass:
loongtrain/objectives/dpo_memory.py, whose peak ``total`` includes when it is the larger).

``total`` is the step's peak, not the sum of the parts (:func:`peak_bytes`): the largest of the loss's
moment (the kept activations and the loss's peak), a block's backward (the activations still kept then,
its recomputed set and its ``workspace``), both before any fp32 gradient (``4P/z`` of ``states``) exists,
and the backward's end (the states with their gradients). With gradient accumulation the gradients live
through every micro-batch after the first: add ``4P/z`` to the first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from loongtrain.attn.ring import backward_workspace_bytes
from loongtrain.loss.chunked import chunked_loss_peak_bytes
from loongtrain.model.config import ModelConfig, mlp_width, num_params
from loongtrain.model.memory import Kept, MemoryTerm, States, StepShape
from loongtrain.parallel.config import RECOMPUTE_MODES, ParallelConfig, effective_kv_heads
from loongtrain.parallel.layout import Layout
from loongtrain.plan.memory_terms import run_terms

#: bytes per parameter of the optimizer-step state: fp32 master weight and gradient, AdamW's fp32 m and v
STATE_BYTES_PER_PARAM = 4 + 4 + 4 + 4


def layer_params(model: ModelConfig) -> int:
    """Parameters of one decoder layer (attention, SwiGLU MLP, two norms)."""
    return (num_params(model, include_embeddings=False) - model.dim) // model.num_layers


def step_shape(model: ModelConfig, layout: Layout, config: ParallelConfig, *, tokens: float, dtype_bytes: int,
               zero_size: int, terms: Sequence[MemoryTerm] = (), batch: int = 1) -> StepShape:
    """The :class:`~loongtrain.model.memory.StepShape` of ``tokens`` per rank (of ``batch`` sequences) of ``model`` on
    ``layout`` with ``config``'s modes, its MLP tiles by the terms' rule (the tiled MLP's)."""
    shape = StepShape(model, tokens, dtype_bytes, zero_size > 1 or config.offload_params,  # offload_params is
                      layout.hp, layout.cp, zero_size, 1, config.recompute,  # FSDP2's, even on one rank
                      config.reshard_after_forward, any(term.frozen_base for term in terms), config.offload_params,
                      batch)
    return dataclasses.replace(shape, tiles=max((term.tiles(shape) for term in terms), default=1))


def mlp_intermediates(s: StepShape, terms: Sequence[MemoryTerm] = ()) -> float:
    """Bytes per token per layer (averaged over the layers) of the MLP's intermediates kept for the backward, of
    one tile: a dense layer's ``4 f b`` (w1's and w3's outputs, SiLU's, the product) and what the terms keep
    instead (an expert layer's)."""
    dense = min((term.dense_layers(s) for term in terms), default=s.model.num_layers)
    total = s.dtype_bytes * (dense * 4 * s.model.ffn_dim) / s.model.num_layers / s.tiles
    for term in terms:
        total += term.mlp_intermediates(s)
    return total


def layer_activation_bytes(s: StepShape, terms: Sequence[MemoryTerm] = ()) -> float:
    """``a_b``: bytes saved per token per layer without checkpointing (module docstring), with the terms' changes
    (LoRA's frozen projections and adapters)."""
    b, d, model = s.dtype_bytes, s.model.dim, s.model
    he = effective_kv_heads(model.num_heads, model.num_kv_heads, s.hp)
    rest = 2 * he * model.head_dim * b + mlp_intermediates(s, terms) + 4 * model.num_heads + 8
    tiled = s.tiles > 1  # the MLP's norm output (autocast: its two bf16 casts) exists per tile too
    if b >= 4:  # the attention's norm output is never kept (fused into q/k/v: loongtrain/parallelize/norm_linear.py)
        base = (5 - tiled) * d * b + rest
    else:
        base = ((4 - tiled) * d * b if s.sharded else 2 * d * 4 + (4 - 2 * tiled) * d * b) + rest
    return base + sum(part for term in terms for part in term.layer_bytes(s))


def mlp_part_bytes(s: StepShape, terms: Sequence[MemoryTerm] = ()) -> float:
    """Bytes per token of a layer's kept set that belong to its MLP (its input, its intermediates, its norm output
    when untiled, the terms' MLP parts): the rest is the attention's."""
    b, d = s.dtype_bytes, s.model.dim
    return (d * s.residual_bytes + mlp_intermediates(s, terms) + (d * b if s.tiles == 1 else 0)
            + sum(term.layer_bytes(s)[1] for term in terms))


def working_param_bytes(s: StepShape, terms: Sequence[MemoryTerm] = ()) -> float:
    """Bytes of gathered weights, their unsharded gradients and autocast copies (``working_params``): with FSDP2
    (``s.sharded``) the root and the blocks in flight in the gathered dtype and one block's (or the root's)
    unsharded gradient (the terms': e.g. only the adapters'); else autocast's copies."""
    model, b = s.model, s.dtype_bytes
    p_l, d, layers = layer_params(model), model.dim, model.num_layers
    head = model.vocab_size * d
    if s.sharded:
        w = min(b, 4)
        root = head * (1 if model.tie_embeddings else 2) + d
        in_flight = 2 if s.reshard_after_forward else layers
        grad = w + 4 if w < 4 else w
        trained = max(p_l, root)
        for term in terms:
            trained = term.trained_block_params(s, trained)
        return float(w * (in_flight * p_l + root) + grad * trained)
    if b < 4:
        return float(b * ((layers if s.recompute == "none" else 1) * p_l + head))
    return 0.0


def layer_moments(s: StepShape, full_layer: float, terms: Sequence[MemoryTerm] = ()) -> dict[str, float]:
    """Bytes live in one block's backward beyond what the step keeps (the blocks' kept sets, module
    docstring), at its two peaks (measured: the simulation at the Llama-3-8B shape):

    - ``mlp``: inside the MLP's backward: the block's recomputed set (``full_layer``), two gradients of the
      residual stream (the block output's and the MLP input's), ``2 * d * r``, and SwiGLU's three
      intermediate gradients (of one tile), ``3 * f * b / n``, and the terms' (an expert layer's combine);
    - ``attention``: inside the attention op's backward: the recomputed set without the MLP's part (its
      input ``h``, ``d * r``, its intermediates, with one tile: one tile's, and its norm output when untiled),
      the residual gradient and the attention output's gradient (``d * r + d * b``), the op's results (dQ,
      packed dK/dV) and its own workspace
      (:func:`loongtrain.attn.ring.backward_workspace_bytes`: the ring's blocks and fp32 accumulators, or at
      ``cp = 1`` the kernel's dK/dV until they are stacked) and the terms' (a CUDA kernel's own scratch). With
      ``hp > 1`` the same tensors in the heads' layout (the all-to-all's output replaces its input).
    """
    model, t, b, d, f = s.model, s.tokens, s.dtype_bytes, s.model.dim, mlp_width(s.model)
    r = s.residual_bytes
    he = effective_kv_heads(model.num_heads, model.num_kv_heads, s.hp)
    q_bytes = model.num_heads * model.head_dim * b
    results = t * (q_bytes + 2 * he * model.head_dim * b)  # the op's dQ and packed dK/dV
    attention = (full_layer - t * mlp_part_bytes(s, terms) + t * (d * r + d * b) + results
                 + backward_workspace_bytes(t, model.num_heads, he, model.head_dim, b, s.cp)
                 + sum(term.attention_backward(s) for term in terms))
    swiglu_grads = 3 * f * b / s.tiles if s.tiles > 1 else 2 * f * b
    for term in terms:
        swiglu_grads += term.mlp_backward(s)
    return {"mlp": full_layer + t * (2 * d * r + swiglu_grads), "attention": attention}


def peak_bytes(parts: dict[str, float], gradient_bytes: float, layer_kept: float) -> float:
    """The step's peak, the largest of three moments: the loss (the blocks' kept sets on the device at the
    end of the forward, ``activations``, and the chunked loss's peak, ``logits``), a block's backward (the
    kept sets still live then, ``layer_kept``, with the block's recomputed set and its largest transient,
    ``recompute`` + ``workspace``: :func:`layer_moments`), neither holding a gradient yet (the trainer sets
    them to None each step), and the backward's end (every gradient, no activation). ``gradient_bytes``:
    the fp32 gradients within ``states``."""
    base = parts["states"] - gradient_bytes + parts["working_params"]
    loss = base + parts["activations"] + parts["logits"]
    layer = base + layer_kept + parts["recompute"] + parts["workspace"]
    end = parts["states"] + parts["working_params"]
    return max(loss, layer, end)


def largest_param(model: ModelConfig) -> int:
    """Elements of a dense model's largest parameter: the embedding (or head), an MLP or an attention projection
    (the terms add theirs: an expert layer's fused projection)."""
    d = model.dim
    return max(model.vocab_size * d, model.ffn_dim * d, model.num_heads * model.head_dim * d)


def memory_per_rank(model: ModelConfig, layout: Layout, config: ParallelConfig, *, seq_len: int, batch: int,
                    dtype_bytes: int = 2, zero_size: int, features: Sequence[MemoryTerm] = ()) -> dict[str, float]:
    """Bytes per device by part (``states``, ``working_params``, ``activations``, ``recompute``, ``logits``,
    ``workspace``) of ``model`` on ``layout`` with ``config`` (its ``recompute``, resharding and memory modes), the
    step's peak ``total`` (:func:`peak_bytes`), the pinned ``host`` bytes per rank of the offload modes (module
    docstring) and, of those, the offloaded activations' ``host_activations``; every phase's peak outside the step
    (DPO's ``reference``), ``total`` the largest. ``features``: the run's memory terms beyond its model's and
    ``config``'s (:func:`~loongtrain.plan.memory_terms.feature_terms`: LoRA, the kernels' scratch, the objective's
    phases). The one mapping the planner, ``--max-seq-len``, the trainer's start-up report and the simulation's
    comparison share."""
    if config.recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute={config.recompute!r} is not one of {RECOMPUTE_MODES}")
    if zero_size < 1 or layout.world_size % zero_size:
        raise ValueError(f"zero shard group size {zero_size} must divide world_size={layout.world_size}")
    terms = run_terms(model, config, features)
    s = step_shape(model, layout, config, tokens=batch * seq_len / layout.sp, dtype_bytes=dtype_bytes,
                   zero_size=zero_size, terms=terms, batch=batch)
    b, d, layers, t = dtype_bytes, model.dim, model.num_layers, s.tokens
    p = num_params(model)
    he = effective_kv_heads(model.num_heads, model.num_kv_heads, layout.hp)
    full_layer = t * layer_activation_bytes(s, terms)
    r = s.residual_bytes
    if config.recompute == "none":
        acts, rebuilt = layers * full_layer, 0.0
    elif config.recompute == "full":
        acts, rebuilt = layers * t * d * r, full_layer
    else:  # input, ring output and lse; with hp > 1 also the all-to-alls' outputs (q, k, v; attention out)
        kept_set = d * b + (2 * d + 2 * he * model.head_dim) * b * (layout.hp > 1)
        acts, rebuilt = layers * t * (d * r + kept_set + 4 * model.num_heads), full_layer
    kept = Kept(acts, acts)  # in a block's backward (the last one's: every block's kept set)
    mlp_part = mlp_part_bytes(s, terms)
    for term in terms:
        kept = term.kept(s, kept, full_layer, mlp_part)
    # with the loss: its input's gradient (the residual's in backward; the final norm runs inside the chunked loss)
    acts = kept.activations + t * (d * r)
    moments = layer_moments(s, full_layer, terms)
    # beyond the block's set (kept, with recompute none, else its recompute: full_layer either way)
    workspace = max(moments["mlp"], moments["attention"]) - full_layer
    states = States(p, STATE_BYTES_PER_PARAM * p, 4.0 * p, largest_param(model))
    for term in terms:
        states = term.states(s, states)
    parts = {
        "states": states.states / zero_size,
        "working_params": working_param_bytes(s, terms),
        "activations": float(acts),
        "recompute": float(rebuilt),
        "logits": float(chunked_loss_peak_bytes(int(t), model.vocab_size, d, compute_bytes=b, weight_bytes=b,
                                                stats_bytes=8 if b == 8 else 4)),
        "workspace": float(workspace),
        "host_activations": float(kept.host),  # the offloaded blocks' kept sets (the offload copies' bytes)
    }
    gradients, host = states.grads / zero_size, kept.host
    for term in terms:  # the offload of the states (the host's peak: the forward's end or the AdamW step)
        gradients, host = term.place_states(s, parts, gradients, states.largest_param, host)
    parts["total"] = peak_bytes(parts, gradient_bytes=gradients, layer_kept=kept.layer_kept)
    mlp = mlp_intermediates(s, terms)
    for term in terms:  # the phases outside the step (DPO's reference pass)
        for name, value in term.phases(s, parts, mlp).items():
            parts[name] = float(value)
            parts["total"] = max(parts["total"], parts[name])
    parts["host"] = float(host) + sum(term.phase_host(s) for term in terms)
    return parts


#: the fields of a ParallelConfig :func:`memory_per_rank` does not read: the ranks' order and the ring's schedule
#: decide the time, not what a rank holds
MEMORY_FREE_FIELDS = ("placement", "inner_ring")
_MEMORY_FIELDS = tuple(f.name for f in dataclasses.fields(ParallelConfig) if f.name not in MEMORY_FREE_FIELDS)


def memory_key(config: ParallelConfig) -> tuple:
    """What of ``config`` :func:`memory_per_rank` reads (every field but :data:`MEMORY_FREE_FIELDS`): configurations
    with one key hold the same bytes, so they are checked once (``plan --max-seq-len``;
    tests/unit/test_plan_max_seq.py)."""
    return tuple(getattr(config, name) for name in _MEMORY_FIELDS)
