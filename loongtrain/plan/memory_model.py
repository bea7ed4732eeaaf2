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
  (:func:`loongtrain.attn.cuda_kernels.backward_scratch_bytes` of the rank's largest call, ``t * hp`` tokens
  of ``H / hp`` heads against as many keys: the fp32 dQ accumulator and row sums, GQA's expanded dK/dV, or
  one head's past ``SPLIT_BACKWARD_BYTES``), the largest among the ``kernels`` the device's choice may pick
  (``Cluster.attention_kernels``; none on CPU; docs/planner.md#memory-per-device).

Offload and tiling modes (docs/planner.md; :class:`~loongtrain.parallel.config.ParallelConfig`'s
``offload_activations``, ``mlp_tiles``, ``offload_params``), each changing only its own terms; ``host``
is the pinned host memory per rank they need (0 without them):

- ``mlp_tiles = n > 1``: the feed-forward runs over ``n`` tiles of the local sequence and the backward
  recomputes one tile at a time, so of SwiGLU's ``4f * b`` bytes per token only one tile's exist:
  ``a_b - 4f * b * (1 - 1/n)`` in the full layer's set (``recompute``, and ``activations`` without
  checkpointing). ``auto`` is the trainer's own rule (:func:`loongtrain.parallel.config.mlp_tile_count`):
  the fewest tiles ``n >= ceil(f / d)`` that divide ``t``, so that one tile's ``[t/n, f]`` intermediate is at
  most the block's hidden input ``[t, d]`` in elements.
- ``offload_activations``: each block's kept set ``K`` (the per-block part of ``activations``) is copied to
  the host when its forward ends and brought back one block ahead of its backward, except the last
  ``k = offload_keep`` blocks': at the loss the device holds ``min(L, k + 2) * K`` (the kept blocks and two
  copies in flight), in a block's backward ``max(1, k) * K`` (the previous block comes back after its
  peaks), the host ``(L - k) * K``.
- ``offload_params`` (FSDP2 ``CPUOffloadPolicy``, so FSDP2's bf16 gathering even when ``z = 1``): the fp32
  shards, their gradients and AdamW's m, v (``states``, ``16 * P / z``) live on the host, the AdamW step
  runs there (torch's single-tensor step holds :data:`ADAMW_STEP_TEMPORARIES` fp32 temporaries of one
  parameter shard at a time: ``+ 3 * 4 * P_max / z`` on the host, ``P_max`` the largest parameter); the
  device keeps ``working_params`` (the gathered blocks and their unsharded gradients). The host's peak is
  the larger of the forward's end (the states without gradients, ``12 * P / z``, and the offloaded
  activations) and the AdamW step (the states and its temporaries; the activations are gone).

With ``lora`` (a :class:`~loongtrain.model.lora.LoraConfig`) the base is frozen and only the adapters train:
the states, the gathered gradients, the activations each changes as :mod:`loongtrain.plan.lora_terms` says.
``reference`` (``--objective dpo``, :func:`reference_phase_bytes`): the reference pass before the first step
(loongtrain/train/reference.py), whose peak ``total`` includes when it is the larger.

``total`` is the step's peak, not the sum of the parts (:func:`peak_bytes`): the largest of the loss's
moment (the kept activations and the loss's peak), a block's backward (the activations still kept then,
its recomputed set and its ``workspace``), both before any fp32 gradient (``4P/z`` of ``states``) exists,
and the backward's end (the states with their gradients). With gradient accumulation the gradients live
through every micro-batch after the first: add ``4P/z`` to the first.
"""

from __future__ import annotations

import dataclasses

from loongtrain.attn.cuda_kernels import largest_backward_scratch
from loongtrain.attn.ring import backward_workspace_bytes
from loongtrain.loss.chunked import chunked_loss_peak_bytes
from loongtrain.model.config import ModelConfig, mlp_width, num_params
from loongtrain.model.lora import LoraConfig, adapter_shapes
from loongtrain.parallel.config import RECOMPUTE_MODES, ParallelConfig, effective_kv_heads, mlp_tile_count
from loongtrain.parallel.layout import Layout
from loongtrain.plan.lora_terms import (
    adapts_attention,
    layer_adapter_params,
    lora_layer_bytes,
    product_bytes,
    state_bytes,
)

STATE_BYTES_PER_PARAM = 16
#: fp32 temporaries of one parameter that torch's single-tensor AdamW step (``foreach=False``) holds at once
#: (measured: the host's peak of the AdamW step under ``--offload-params`` in train/simulate/)
ADAMW_STEP_TEMPORARIES = 3


def largest_param(model: ModelConfig) -> int:
    """Elements of the largest parameter: the embedding (or head), an MLP, an attention projection or the
    experts' fused gate/up projection (``E * 2 f_e * d``)."""
    d = model.dim
    experts = 2 * model.num_experts * model.moe_ffn_dim * d if model.moe_layers else 0
    return max(model.vocab_size * d, model.ffn_dim * d, model.num_heads * model.head_dim * d, experts)


def ffn_width(model: ModelConfig) -> float:
    """``f`` of the activation terms: the MLP width a token computes (an MoE layer: ``top_k * moe_ffn_dim``),
    averaged over the layers (:func:`loongtrain.model.config.mlp_width`)."""
    return mlp_width(model)


def swiglu_bytes(model: ModelConfig, dtype_bytes: int) -> float:
    """Bytes per token (averaged over the layers) of the SwiGLU intermediates kept for the backward: a dense
    layer's ``4 f b`` (w1's and w3's outputs, SiLU's, the product), an MoE layer's ``3 k f_e b`` (its experts keep
    the packed gate/up output and the product, SiLU recomputed: loongtrain/model/moe.py)."""
    moe = len(model.moe_layers)
    dense = (model.num_layers - moe) * 4 * model.ffn_dim
    return dtype_bytes * (dense + moe * 3 * model.top_k * model.moe_ffn_dim) / model.num_layers


def dispatch_bytes(model: ModelConfig, dtype_bytes: int) -> float:
    """Bytes per token per layer (averaged over the layers) an MoE layer keeps beyond its experts' SwiGLU
    intermediates (loongtrain/model/moe.py): the token's ``k`` copies gathered in expert order and the experts'
    ``k`` outputs (``2 k d b``), the router's fp32 probabilities twice (routing, and the load-balancing
    statistics: ``8 E``), the ``k`` routing weights (``b`` each, and fp32 ``4``) and the int64 sort order and
    token indices (``24`` each) and the renormalization's sum (``4``). 0 for a dense model."""
    if not model.moe_layers:
        return 0.0
    k, b = model.top_k, dtype_bytes
    per_layer = 2 * k * model.dim * b + 8 * model.num_experts + k * (b + 4 + 24) + 4
    return per_layer * len(model.moe_layers) / model.num_layers


def layer_params(model: ModelConfig) -> int:
    """Parameters of one decoder layer (attention, SwiGLU MLP, two norms)."""
    return (num_params(model, include_embeddings=False) - model.dim) // model.num_layers


def layer_activation_bytes(model: ModelConfig, hp: int, dtype_bytes: int, sharded: bool,
                           mlp_tiles: int = 1, lora: LoraConfig | None = None) -> float:
    """``a_b``: bytes saved per token per layer without checkpointing (module docstring); ``sharded``:
    bf16 through FSDP2's gathered weights rather than autocast; ``mlp_tiles``: SwiGLU's intermediates
    exist for one tile of the sequence at a time; ``lora``: the frozen base's and the adapters' change
    (:func:`loongtrain.plan.lora_terms.lora_layer_bytes`)."""
    return _base_layer_bytes(model, hp, dtype_bytes, sharded, mlp_tiles) + sum(
        lora_layer_bytes(model, lora, dtype_bytes, sharded, mlp_tiles))


def _base_layer_bytes(model: ModelConfig, hp: int, dtype_bytes: int, sharded: bool, mlp_tiles: int) -> float:
    b, d = dtype_bytes, model.dim
    he = effective_kv_heads(model.num_heads, model.num_kv_heads, hp)
    mlp = swiglu_bytes(model, b) / mlp_tiles + dispatch_bytes(model, b)
    rest = 2 * he * model.head_dim * b + mlp + 4 * model.num_heads + 8
    tiled = mlp_tiles > 1  # the MLP's norm output (autocast: its two bf16 casts) exists per tile too
    if b >= 4:  # the attention's norm output is never kept (fused into q/k/v: loongtrain/parallelize/norm_linear.py)
        return (5 - tiled) * d * b + rest
    return ((4 - tiled) * d * b if sharded else 2 * d * 4 + (4 - 2 * tiled) * d * b) + rest


def residual_bytes(dtype_bytes: int, sharded: bool) -> int:
    """Bytes per element of the residual stream: fp32 under autocast (``z = 1``, ``b < 4``), else ``b``."""
    return 4 if dtype_bytes < 4 and not sharded else dtype_bytes


def final_norm_bytes(dim: int, dtype_bytes: int, sharded: bool) -> float:
    """Bytes per token the final RMSNorm leaves for the backward: the chunked loss applies it a chunk at a
    time (loongtrain/loss/chunked.py), so only the gradient of its input, the residual stream (``r``)."""
    return dim * residual_bytes(dtype_bytes, sharded)


def working_param_bytes(model: ModelConfig, zero_size: int, recompute: str, dtype_bytes: int,
                        reshard_after_forward: bool = True, gathered: bool | None = None,
                        lora: LoraConfig | None = None) -> float:
    """Bytes of gathered weights, their unsharded gradients and autocast copies (``working_params``);
    ``gathered``: whether ZeRO (FSDP2) gathers the weights (default ``zero_size > 1``); ``lora``: only the
    adapters have gradients (a block's, ``A_l``)."""
    p_l, d, L = layer_params(model), model.dim, model.num_layers
    head = model.vocab_size * d
    if zero_size > 1 if gathered is None else gathered:
        w = min(dtype_bytes, 4)
        root = head * (1 if model.tie_embeddings else 2) + d
        in_flight = 2 if reshard_after_forward else L
        grad = w + 4 if w < 4 else w
        trained = max(p_l, root) if lora is None else layer_adapter_params(model, lora)
        return float(w * (in_flight * p_l + root) + grad * trained)
    if dtype_bytes < 4:
        return float(dtype_bytes * ((L if recompute == "none" else 1) * p_l + head))
    return 0.0


def mlp_part_bytes(model: ModelConfig, dtype_bytes: int, sharded: bool, tiles: int,
                   lora: LoraConfig | None = None) -> float:
    """Bytes per token of a layer's kept set that belong to its MLP (its input, SwiGLU's intermediates, its norm
    output when untiled; ``lora``: what its frozen MLP and adapters keep): the rest is the attention's."""
    b, d = dtype_bytes, model.dim
    return (d * residual_bytes(b, sharded) + swiglu_bytes(model, b) / tiles + dispatch_bytes(model, b)
            + (d * b if tiles == 1 else 0)
            + lora_layer_bytes(model, lora, b, sharded, tiles)[1])


def dispatch_backward_bytes(model: ModelConfig, dtype_bytes: int) -> float:
    """Bytes per token (averaged over the layers) an MoE layer's backward holds beyond a dense MLP's: the tokens'
    gradients gathered in expert order (the experts' outputs' gradient) and the product that gives the routing
    weights' gradient (``2 k d b``; loongtrain/model/moe.py's ``_Combine``). 0 for a dense model."""
    if not model.moe_layers:
        return 0.0
    return 2 * model.top_k * model.dim * dtype_bytes * len(model.moe_layers) / model.num_layers


def kernel_scratch_bytes(model: ModelConfig, layout: Layout, t: float, dtype_bytes: int,
                         kernels: tuple[str, ...]) -> float:
    """The largest backward scratch of ``kernels`` (:func:`~loongtrain.attn.cuda_kernels.backward_scratch_bytes`)
    for a rank's largest attention call: its ``t`` tokens in the heads' layout (``t * hp`` tokens of
    ``H / hp`` heads, against as many keys); 0 without kernels (CPU)."""
    he = effective_kv_heads(model.num_heads, model.num_kv_heads, layout.hp)
    tokens = round(t * layout.hp)
    return float(largest_backward_scratch(kernels, 1, model.num_heads // layout.hp, he // layout.hp, tokens, tokens,
                                          model.head_dim, dtype_bytes))


def layer_moments(model: ModelConfig, layout: Layout, t: float, dtype_bytes: int, sharded: bool,
                  full_layer: float, tiles: int, lora: LoraConfig | None = None,
                  kernels: tuple[str, ...] = ()) -> dict[str, float]:
    """Bytes live in one block's backward beyond what the step keeps (the blocks' kept sets, module
    docstring), at its two peaks (measured: train/simulate/ at the Llama-3-8B shape):

    - ``mlp``: inside the MLP's backward: the block's recomputed set (``full_layer``), two gradients of the
      residual stream (the block output's and the MLP input's), ``2 * d * r``, and SwiGLU's three
      intermediate gradients (of one tile), ``3 * f * b / n``;
    - ``attention``: inside the attention op's backward: the recomputed set without the MLP's part (its
      input ``h``, ``d * r``, its intermediates, with one tile: one tile's, and its norm output when untiled),
      the residual gradient and the attention output's gradient (``d * r + d * b``), the op's results (dQ,
      packed dK/dV) and its own workspace
      (:func:`loongtrain.attn.ring.backward_workspace_bytes`: the ring's blocks and fp32 accumulators, or at
      ``cp = 1`` the kernel's dK/dV until they are stacked) and the CUDA kernel's own scratch
      (:func:`kernel_scratch_bytes` of ``kernels``). With ``hp > 1`` the same tensors in the heads' layout (the
      all-to-all's output replaces its input).
    """
    b, d, f = dtype_bytes, model.dim, ffn_width(model)
    r = residual_bytes(b, sharded)
    he = effective_kv_heads(model.num_heads, model.num_kv_heads, layout.hp)
    q_bytes = model.num_heads * model.head_dim * b
    mlp_part = mlp_part_bytes(model, b, sharded, tiles, lora)
    results = t * (q_bytes + 2 * he * model.head_dim * b)  # the op's dQ and packed dK/dV
    attention = (full_layer - t * mlp_part + t * (d * r + d * b) + results
                 + backward_workspace_bytes(t, model.num_heads, he, model.head_dim, b, layout.cp)
                 + kernel_scratch_bytes(model, layout, t, b, kernels))
    swiglu_grads = 3 * f * b / tiles if tiles > 1 else 2 * f * b
    swiglu_grads += product_bytes(model, lora, b, tiles)  # --lora: as high without the product kept
    swiglu_grads += dispatch_backward_bytes(model, b)
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


def reference_phase_bytes(model: ModelConfig, parts: dict[str, float], t: float, dtype_bytes: int, zero_size: int,
                          sharded: bool, tiles: int, reshard_after_forward: bool, offload_params: bool) -> float:
    """Device bytes of DPO's reference pass (loongtrain/train/reference.py), forward only under ``no_grad``,
    before the first step (measured: train/simulate/, phase ``reference``): the policy's weights and, on a
    resume, its AdamW moments (``states`` less the gradients' ``4 * P / z``), the reference's own fp32
    weights sharded as the policy's (``4 * P / z``; on the host with ``offload_params``), its gathered weights
    without gradients (ZeRO: ``w * (n * P_l + R)``, ``n`` = 2 blocks, or all ``L`` without resharding;
    autocast: one block's and the head's copies, ``b * (P_l + V * d)``), and the larger of a block's MLP
    moment (the residual stream in and out, the norm's output and SwiGLU's four intermediates of a tile:
    ``t * (2 * d * r + d * b + 4 * f * b / n)``) and the loss's (the final hidden states and ``logits``)."""
    p, p_l, d, b = num_params(model), layer_params(model), model.dim, dtype_bytes
    weights = 0.0 if offload_params else 12 * p / zero_size + 4 * p / zero_size
    if sharded:
        w = min(b, 4)
        root = model.vocab_size * d * (1 if model.tie_embeddings else 2) + d
        gathered = w * ((2 if reshard_after_forward else model.num_layers) * p_l + root)
    else:
        gathered = b * (p_l + model.vocab_size * d) if b < 4 else 0.0
    r = residual_bytes(b, sharded)
    block = t * (2 * d * r + d * b + swiglu_bytes(model, b) / tiles + dispatch_bytes(model, b))
    return weights + gathered + max(block, t * d * r + parts["logits"])


def memory_per_rank(
    model: ModelConfig, layout: Layout, *, seq_len: int, batch: int, zero_size: int, recompute: str,
    dtype_bytes: int = 2, reshard_after_forward: bool = True, offload_activations: bool = False,
    mlp_tiles: str = "1", offload_params: bool = False, offload_keep: int = 0, lora: LoraConfig | None = None,
    reference: bool = False, kernels: tuple[str, ...] = (),
) -> dict[str, float]:
    """Bytes per device by part (``states``, ``working_params``, ``activations``, ``recompute``, ``logits``,
    ``workspace``), the step's peak ``total`` (:func:`peak_bytes`), the pinned ``host`` bytes per rank of the
    offload modes (module docstring) and, of those, the offloaded activations' ``host_activations``;
    ``lora``: the adapters train on a frozen base (:mod:`loongtrain.plan.lora_terms`). ``reference``: a DPO
    run's (``--objective dpo``): ``reference``, the reference pass's bytes (:func:`reference_phase_bytes`), and
    ``total`` the larger of it and the step's peak. ``kernels``: the CUDA attention kernels the device's choice
    may pick, whose backward scratch ``workspace`` counts (:func:`kernel_scratch_bytes`; none on CPU)."""
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute={recompute!r} is not one of {RECOMPUTE_MODES}")
    if zero_size < 1 or layout.world_size % zero_size:
        raise ValueError(f"zero shard group size {zero_size} must divide world_size={layout.world_size}")
    b, d, L = dtype_bytes, model.dim, model.num_layers
    p = num_params(model)
    t = batch * seq_len / layout.sp
    he = effective_kv_heads(model.num_heads, model.num_kv_heads, layout.hp)
    sharded = zero_size > 1 or offload_params  # offload_params is FSDP2's, even on one rank
    tiles = mlp_tile_count(mlp_tiles, int(t), d, round(ffn_width(model)), strict=False)  # the trainer's own rule
    full_layer = t * layer_activation_bytes(model, layout.hp, b, sharded, tiles, lora)
    r = residual_bytes(b, sharded)
    if recompute == "none":
        acts, rebuilt = L * full_layer, 0.0
        if lora is not None and not adapts_attention(model, lora):  # no gradient reaches the first
            acts -= full_layer - t * mlp_part_bytes(model, b, sharded, tiles, lora)  # block's attention: it keeps none
    elif recompute == "full":
        acts, rebuilt = L * t * d * r, full_layer
    else:  # input, ring output and lse; with hp > 1 also the all-to-alls' outputs (q, k, v; attention out)
        kept = d * b + (2 * d + 2 * he * model.head_dim) * b * (layout.hp > 1)
        acts, rebuilt = L * t * (d * r + kept + 4 * model.num_heads), full_layer
    host = 0.0
    layer_kept = acts  # in a block's backward (the last one's: every block's kept set)
    if offload_activations:  # on the host: every offloaded block's kept set; on the device: the blocks in flight
        keep = min(offload_keep, L - 1)  # the last blocks, not offloaded
        host = acts / L * (L - keep)
        layer_kept = acts / L * max(1, keep)  # the last block's backward: the kept blocks (the previous
        # offloaded block is fetched after the peaks: parallelize/offload.py)
        acts = acts / L * min(L, keep + 2)  # at the loss: the kept blocks and two offloaded ones' copies in flight
        if lora is not None:  # the first block's input needs no gradient (a frozen embedding): it stays on the device
            host, acts, layer_kept = host - t * d * r, acts + t * d * r, layer_kept + t * d * r
    acts += t * final_norm_bytes(d, b, sharded)  # with the loss: its input's gradient (the residual's in backward)
    moments = layer_moments(model, layout, t, b, sharded, full_layer, tiles, lora, kernels)
    # beyond the block's set (kept, with recompute none, else its recompute: full_layer either way)
    workspace = max(moments["mlp"], moments["attention"]) - full_layer
    working = working_param_bytes(model, zero_size, recompute, b, reshard_after_forward, gathered=sharded, lora=lora)
    states, grads = ((STATE_BYTES_PER_PARAM * p, 4.0 * p) if lora is None
                     else state_bytes(model, lora, p))
    parts = {
        "states": states / zero_size,
        "working_params": float(working),
        "activations": float(acts),
        "recompute": float(rebuilt),
        "logits": float(chunked_loss_peak_bytes(int(t), model.vocab_size, d, compute_bytes=b, weight_bytes=b,
                                                stats_bytes=8 if b == 8 else 4)),
        "workspace": float(workspace),
        "host_activations": float(host),  # the offloaded blocks' kept sets (the offload copies' bytes)
    }
    if offload_params:  # the states and the AdamW step's temporaries on the host, the larger of two moments:
        # the forward's end (no gradient yet, every offloaded activation) and the AdamW step (no activation)
        largest = largest_param(model) if lora is None else lora.r * max(max(s) for s in
                                                                          adapter_shapes(model, lora).values())
        host = max(host + parts["states"] - grads / zero_size,
                   parts["states"] + ADAMW_STEP_TEMPORARIES * 4 * largest / zero_size)
        parts["states"] = 0.0
    parts["total"] = peak_bytes(parts, gradient_bytes=0.0 if offload_params else grads / zero_size,
                                layer_kept=layer_kept)
    if reference:
        parts["reference"] = float(reference_phase_bytes(model, parts, t, b, zero_size, sharded, tiles,
                                                         reshard_after_forward, offload_params))
        parts["total"] = max(parts["total"], parts["reference"])
    parts["host"] = float(host) + (4 * p / zero_size if reference and offload_params else 0.0)
    return parts


#: the fields of a ParallelConfig :func:`config_memory` does not read: the ranks' order and the ring's schedule
#: decide the time, not what a rank holds
MEMORY_FREE_FIELDS = ("placement", "inner_ring")
_MEMORY_FIELDS = tuple(f.name for f in dataclasses.fields(ParallelConfig) if f.name not in MEMORY_FREE_FIELDS)


def memory_key(config: ParallelConfig) -> tuple:
    """What of ``config`` :func:`config_memory` reads (every field but :data:`MEMORY_FREE_FIELDS`): configurations
    with one key hold the same bytes, so they are checked once (``plan --max-seq-len``;
    tests/unit/test_plan_max_seq.py)."""
    return tuple(getattr(config, name) for name in _MEMORY_FIELDS)


def config_memory(model: ModelConfig, config: ParallelConfig, layout: Layout, *, seq_len: int, batch: int,
                  dtype_bytes: int, zero_size: int, lora: LoraConfig | None = None,
                  reference: bool = False, kernels: tuple[str, ...] = ()) -> dict[str, float]:
    """:func:`memory_per_rank` for ``config`` (its ``recompute``, resharding and memory modes) on ``layout``
    (``lora``: adapters on a frozen base; ``reference``: a DPO run's reference pass): the one mapping the
    planner, ``--max-seq-len`` and the trainer's start-up report share; ``kernels``: the CUDA attention kernels
    the choice may pick (:func:`memory_per_rank`)."""
    return memory_per_rank(
        model, layout, seq_len=seq_len, batch=batch, zero_size=zero_size, recompute=config.recompute,
        dtype_bytes=dtype_bytes, reshard_after_forward=config.reshard_after_forward,
        offload_activations=config.offload_activations, mlp_tiles=config.mlp_tiles,
        offload_params=config.offload_params, offload_keep=config.offload_keep, lora=lora, reference=reference,
        kernels=kernels,
    )
