"""Time, MFU and memory of one training step for one configuration on ``nodes`` nodes of a cluster.

Per layer, per device (``t = B * S / sp`` tokens, ``P_l`` layer parameters):

- GEMMs: forward ``2 * P_l * t`` FLOPs at ``matmul_tflops``, backward 2x.
- Attention: :func:`loongtrain.plan.attention_cost.attention_time` (compute, all-to-all, exposed ring); with
  packed ``documents`` each ring step costs its busiest member's visible pairs (docs/design.md §9).
- Recompute (``ac_mode``): ``full`` re-runs the layer forward, attention and its communication
  included; ``selective`` re-runs only the GEMMs (attention output and lse were kept); ``none`` nothing.
- ZeRO (FSDP2 as the trainer applies it: weights gathered in the compute dtype, ``w`` =
  :func:`param_bytes` bytes (bf16 under its ``MixedPrecisionPolicy``), gradients reduced in fp32;
  prefetched, so hidden behind the layer's compute up to its length, the excess exposed):
  ``full`` (shard over all ``dp * sp`` ranks, ``z = world``): parameter all-gather in forward and again
  in backward, ``2 * (z-1)/z * P_l * w``, and gradient reduce-scatter ``(z-1)/z * P_l * 4``;
  ``hybrid`` (HSDP, ``z = zero_shard_size``, which the planner sets to ``gpus_per_node``): the same
  inside the shard group plus an all-reduce of the shard across the ``N = world / z`` groups,
  ``2 * (N-1)/N * P_l / z * 4``; ``none``: gradient all-reduce over the world,
  ``2 * (W-1)/W * P_l * 4``. A collective spanning nodes runs at the NIC share, else intra-node.
- LM head: ``2 * V * d * t`` forward, 2x backward; its ZeRO traffic is counted as exposed.

- Offload and tiling modes (docs/design.md §9), over the host link ``host_bw`` per device: activation
  offload copies each offloaded block's kept set ``K`` (all but the last ``offload_keep``) out in forward
  and back in backward, ``2 * K / host_bw`` hidden behind the layer's busy time, the excess exposed
  (``offload``); parameter offload moves the
  fp32 shards in for both gathers and the gradient shard out, ``12 * P_l / z / host_bw`` per layer, hidden
  the same way, plus the CPU AdamW step, ``P / z`` parameters at the node's ``cpu_adam_gparams_s`` shared
  by its ranks; a tiled MLP recomputes its tiles in backward, one more MLP forward (``6 * d * f * t``).

Step = ``L * max(layer compute + exposed attention comm, layer ZeRO) + head``. Bottleneck: ``memory``
when it does not fit; else the largest exposed communication component (a2a, ring-inner, ring-outer,
zero) when it costs at least ``BOTTLENECK_SHARE`` of the step; else ``compute``. MFU uses the model's
FLOPs (:func:`loongtrain.model.config.flops_per_token`, attention backward 2x): ``dp * B * S *
flops_per_token / (step * world * peak_tflops)``; with ``documents`` the visible pairs' FLOPs instead
(:func:`loongtrain.model.config.step_flops`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from loongtrain.model.config import ModelConfig, flops_per_token, num_params, step_flops
from loongtrain.parallel.config import ParallelConfig
from loongtrain.parallel.documents import Documents, visible_pairs
from loongtrain.plan.attention_cost import AttnShape, attention_time
from loongtrain.plan.cluster import Cluster
from loongtrain.plan.memory_model import config_memory, layer_params

GRAD_BYTES = 4


def param_bytes(dtype_bytes: int) -> int:
    """Bytes per gathered weight: FSDP2 gathers in the compute dtype when it is narrower than fp32
    (``MixedPrecisionPolicy(param_dtype=bf16)``), else the fp32 weights themselves."""
    return min(dtype_bytes, 4)


COMPONENTS = ("compute", "a2a", "ring-inner", "ring-outer", "zero", "offload")
BOTTLENECK_SHARE = 0.1


@dataclass
class Candidate:
    """A configuration (exactly what ``loongtrain train`` runs) with its predicted cost; ``breakdown``
    seconds per step by component."""

    config: ParallelConfig
    world_size: int
    dp: int
    step_time: float
    mfu: float
    tokens_per_s: float
    memory: dict[str, float]
    fits: bool
    bottleneck: str
    breakdown: dict[str, float] = field(default_factory=dict)
    host_per_node: float = 0.0  # bytes of pinned host memory per node (the offload modes)

    def to_dict(self) -> dict:
        """The configuration's fields (``hp``, ..., ``ac_mode``, ``ac_fraction``) and the prediction."""
        return {
            **asdict(self.config), "dp": self.dp, "world_size": self.world_size,
            "step_time_s": self.step_time, "mfu": self.mfu, "tokens_per_s": self.tokens_per_s,
            "memory_gib": self.memory["total"] / 2**30, "host_gib_per_rank": self.memory.get("host", 0.0) / 2**30,
            "host_gib_per_node": self.host_per_node / 2**30, "fits": self.fits, "bottleneck": self.bottleneck,
            "breakdown_s": dict(self.breakdown),
            "memory_parts_gib": {k: v / 2**30 for k, v in self.memory.items()},
        }


def zero_layer_time(config: ParallelConfig, params: float, world: int, cluster: Cluster,
                    dtype_bytes: int = 2) -> float:
    """Seconds of ZeRO/gradient communication for ``params`` parameters (see module docstring)."""
    g = cluster.gpus_per_node
    z = config.shard_size(world)
    groups = world // z

    def bw(size: int) -> float:
        return cluster.cross_bw(min(g, world)) if size > g else cluster.intra_bw

    if config.zero == "none":
        return 2 * (world - 1) / world * params * GRAD_BYTES / bw(world)
    shard = (z - 1) / z * params * (2 * param_bytes(dtype_bytes) + GRAD_BYTES) / bw(z)
    if config.zero == "hybrid" and groups > 1:
        shard += 2 * (groups - 1) / groups * params / z * GRAD_BYTES / cluster.cross_bw(g)
    return shard


def document_flops(model: ModelConfig, shape: AttnShape, documents: Documents) -> float:
    """Model FLOPs of one replica's step of packed ``documents``: attention counts only the visible pairs
    (:func:`loongtrain.model.config.step_flops`)."""
    tokens = shape.batch * shape.seq_len
    window = model.sliding_window if model.sliding_window and model.sliding_window < shape.seq_len else None
    visible = sum(visible_pairs(cu, shape.seq_len, sliding_window=window) for cu in documents.rows(shape.batch))
    return step_flops(model, tokens, visible)


def step_cost(
    model: ModelConfig, config: ParallelConfig, cluster: Cluster, *, nodes: int, seq_len: int, batch: int = 1,
    dtype_bytes: int = 2, documents: Documents | None = None, world: int | None = None,
) -> Candidate:
    """Predicted step time, MFU, memory and bottleneck of ``config`` on ``nodes`` nodes (``documents``: packed
    rows of every replica's batch and their chunk layout); ``world``: the devices used when fewer than
    ``nodes`` whole nodes (one partial node)."""
    world = world or nodes * cluster.gpus_per_node
    layout = config.layout(world)
    shape = AttnShape(batch, seq_len, model.num_heads, model.num_kv_heads, model.head_dim, dtype_bytes,
                      model.sliding_window)
    attn = attention_time(layout, shape, cluster, documents)
    t = batch * seq_len / layout.sp
    rate = cluster.matmul_tflops * 1e12
    p_l = layer_params(model)
    gemm_fwd = 2 * p_l * t / rate
    per_layer = {
        "compute": 3 * gemm_fwd + attn.compute_fwd + attn.compute_bwd,
        "a2a": attn.a2a_fwd + attn.a2a_bwd,
        "ring-inner": attn.ring_inner_fwd + attn.ring_inner_bwd,
        "ring-outer": attn.ring_outer_fwd + attn.ring_outer_bwd,
    }
    if config.ac_mode == "full":
        per_layer["compute"] += gemm_fwd + attn.compute_fwd
        per_layer["a2a"] += attn.a2a_fwd
        per_layer["ring-inner"] += attn.ring_inner_fwd
        per_layer["ring-outer"] += attn.ring_outer_fwd
    elif config.ac_mode == "selective":
        per_layer["compute"] += gemm_fwd
    layer_busy = sum(per_layer.values())
    zero_exposed = max(0.0, zero_layer_time(config, p_l, world, cluster, dtype_bytes) - layer_busy)
    head_params = model.vocab_size * model.dim
    head_compute = 6 * head_params * t / rate
    head_zero = zero_layer_time(config, head_params, world, cluster, dtype_bytes)
    breakdown = {k: model.num_layers * v for k, v in per_layer.items()}
    breakdown["compute"] += head_compute
    breakdown["zero"] = model.num_layers * zero_exposed + head_zero
    memory = config_memory(model, config, layout, seq_len=seq_len, batch=batch, dtype_bytes=dtype_bytes,
                           zero_size=config.shard_size(world))
    if config.offload_activations or config.offload_params or config.mlp_tiles != "1":
        breakdown["offload"] = offload_time(model, config, cluster, world, t, memory, layer_busy)
        breakdown["compute"] += mlp_recompute_time(model, config, t, rate)
    step = sum(breakdown.values())
    host_per_node = memory["host"] * min(world, cluster.gpus_per_node)
    fits = memory["total"] <= cluster.usable_memory and host_per_node <= cluster.usable_host_memory
    tokens = layout.dp * batch * seq_len
    model_flops = (tokens * flops_per_token(model, seq_len) if documents is None
                   else layout.dp * document_flops(model, shape, documents))
    mfu = model_flops / (step * world * cluster.peak_tflops * 1e12)
    comm = max(COMPONENTS[1:], key=lambda k: breakdown.get(k, 0.0))
    bottleneck = comm if breakdown.get(comm, 0.0) >= BOTTLENECK_SHARE * step else "compute"
    if not fits:
        bottleneck = "memory"
    return Candidate(config, world, layout.dp, step, mfu, tokens / step, memory, fits, bottleneck, breakdown,
                     host_per_node)


def offload_time(model: ModelConfig, config: ParallelConfig, cluster: Cluster, world: int, tokens: float,
                 memory: dict[str, float], layer_busy: float) -> float:
    """Exposed seconds per step of the host copies and the CPU AdamW step (module docstring)."""
    L, z = model.num_layers, config.shard_size(world)
    offloaded = L - min(config.offload_keep, L - 1) if config.offload_activations else 0
    acts = 2 * memory["host_activations"] / offloaded / cluster.host_bw if offloaded else 0.0  # out and back
    params = 12 * layer_params(model) / z / cluster.host_bw if config.offload_params else 0.0
    exposed = offloaded * max(0.0, acts + params - layer_busy) + (L - offloaded) * max(0.0, params - layer_busy)
    if config.offload_params:
        ranks = min(world, cluster.gpus_per_node)
        exposed += num_params(model) / z / (cluster.cpu_adam_gparams_s * 1e9 / ranks)
    return exposed


def mlp_recompute_time(model: ModelConfig, config: ParallelConfig, tokens: float, rate: float) -> float:
    """Seconds of the tiled MLP's recompute in backward: one more MLP forward per layer (``mlp_tiles > 1``)."""
    tiled = config.mlp_tiles == "auto" or int(config.mlp_tiles) > 1
    return model.num_layers * 2 * 3 * model.dim * model.ffn_dim * tokens / rate if tiled else 0.0
