"""Time, MFU and memory of one training step for one configuration on ``nodes`` nodes of a cluster.

The step is the sum of four terms (docs/planner.md), each named in ``Candidate.terms``:

- **compute**: the matmuls (forward ``2 * P_l * t`` FLOPs per layer at ``matmul_tflops``, backward 2x;
  ``t = B * S / sp`` tokens) and the attention kernels
  (:func:`loongtrain.plan.attention_cost.attention_time`: each ring step at the measured rate of its call
  size); the LM head ``6 * V * d * t``; recompute by ``recompute``: ``full`` re-runs the layer forward,
  attention and its communication included, ``selective`` only the matmuls (attention output and lse were
  kept), ``none`` nothing; a tiled MLP one more MLP forward (``6 * d * f * t``).
- **memory-bound**: the bytes of every other op (norms, RoPE, SwiGLU, residual adds, casts, the ring's
  merges, the embedding and the chunked loss's soft-max: :mod:`loongtrain.plan.step_bytes`) over the
  device-memory bandwidth ``memory_bw``. They run on the compute stream, so they hide nothing and nothing
  hides them.
- **exposed communication**: the all-to-alls and the ring's unhidden transfers (``a2a``, ``ring-inner``,
  ``ring-outer``); ZeRO (``zero``, FSDP2 as the trainer applies it, :func:`zero_times`: per layer the
  forward and backward all-gathers of the compute-dtype weights and the fp32 gradient reduce-scatter,
  prefetched one block ahead and hidden behind the layer's busy time up to its length; the first forward
  gather, the first backward gather and the last reduce-scatter have nothing to hide behind, nor do the
  root's (embedding, head) gather and reduce-scatter); without ZeRO on more than one rank the bucketed
  gradient all-reduce (``grad-sync``, :func:`grad_sync_exposed`); the offload modes' host copies
  (``offload``).
- **optimizer**: the AdamW step and the gradient clipping over the rank's parameters (``OPTIMIZER_BYTES``
  per parameter over ``memory_bw``), or under ``offload_params`` the CPU AdamW step, ``P / z``
  parameters at the node's ``cpu_adam_gparams_s`` shared by its ranks.

ZeRO groups: ``full`` shards over all ``dp * sp`` ranks (``z = world``); ``hybrid`` (HSDP, ``z =
zero_shard_size``, which the planner sets to ``gpus_per_node``) shards inside the group and all-reduces the
shard across the ``N = world / z`` groups, ``2 * (N-1)/N * P_l / z * 4``. A collective spanning nodes runs at
the NIC share, else intra-node. Offload modes, over the host link ``host_bw`` per device: activation offload
copies each offloaded block's kept set ``K`` (all but the last ``offload_keep``) out in forward and back in
backward, ``2 * K / host_bw``; parameter offload moves the fp32 shards in for both gathers and the gradient
shard out, ``12 * P_l / z / host_bw`` per layer; both hidden behind the layer's busy time, the excess exposed.

With ``lora`` (adapters on a frozen base, docs/lora.md) every term changes as
:mod:`loongtrain.model.lora_terms` says: no weight gradients for the base (a layer's matmuls and the head
cost ``4`` FLOPs per weight and token instead of ``6``, plus the adapters' ``6 * A_l``), ZeRO's and the
all-reduce's gradients and the AdamW step only the adapters', and MFU counts the FLOPs that run
(:func:`loongtrain.model.lora.lora_flops_saved`).

Bottleneck: ``memory`` when it does not fit; else the largest exposed communication component (a2a,
ring-inner, ring-outer, zero, grad-sync, offload) when it costs at least ``BOTTLENECK_SHARE`` of the step;
else ``compute``. MFU uses the model's FLOPs (:func:`loongtrain.model.config.flops_per_token`, attention
backward 2x): ``dp * B * S * flops_per_token / (step * world * peak_tflops)``; with ``documents`` the
visible pairs' FLOPs instead (:func:`loongtrain.model.config.step_flops`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace

from loongtrain.model.config import (
    ModelConfig,
    attention_weights,
    flops_per_token,
    mlp_params,
    mlp_width,
    num_params,
    step_flops,
)
from loongtrain.model.lora import LoraConfig, adapter_params, adapter_shapes, lora_flops_saved
from loongtrain.model.lora_terms import layer_adapter_params, matmul_factor
from loongtrain.model.memory import MemoryTerm
from loongtrain.parallel.buckets import BUCKET_BYTES
from loongtrain.parallel.buckets import gradient_buckets as buckets_of
from loongtrain.parallel.config import ParallelConfig, effective_kv_heads
from loongtrain.parallel.documents import Documents, visible_pairs
from loongtrain.parallel.layout import Layout
from loongtrain.plan.attention_cost import AttentionTime, AttnShape, attention_time
from loongtrain.plan.cluster import Cluster
from loongtrain.plan.linear_cost import linear_time
from loongtrain.plan.memory_model import layer_params, memory_per_rank, step_shape
from loongtrain.plan.memory_terms import feature_terms, run_terms
from loongtrain.plan.step_bytes import OPTIMIZER_BYTES, head_bytes, layer_bytes

GRAD_BYTES = 4

COMMUNICATION = ("a2a", "ring-inner", "ring-outer", "zero", "grad-sync", "offload")
#: the step's four terms (``Candidate.terms``) and the breakdown components each sums
TERMS = {"compute": ("compute",), "memory_bound": ("memory-bound",), "exposed_communication": COMMUNICATION,
         "optimizer": ("optimizer",)}
BOTTLENECK_SHARE = 0.1


@dataclass(frozen=True)
class Workload:
    """What a planned run trains beyond its model and layout: ``lora`` adapters on a frozen base (docs/lora.md),
    ``documents`` (packed rows of every replica's batch and their chunk layout: attention charged by visible
    pairs), its objective's memory ``phases`` (its registry entry's terms: DPO's reference pass) and whether it runs
    ``--deterministic`` (FA2's deterministic backward keeps more dQ accumulators)."""

    lora: LoraConfig | None = None
    documents: Documents | None = None
    phases: Sequence[MemoryTerm] = ()
    deterministic: bool = False

    def memory(self, cluster: Cluster) -> tuple[MemoryTerm, ...]:
        """The run's feature terms on ``cluster`` (:func:`~loongtrain.plan.memory_terms.feature_terms`: its
        adapters, its kernels' backward scratch (``deterministic``: FA2's deterministic dQ accumulators), its
        objective's phases)."""
        return feature_terms(self.lora, cluster.attention_kernels, self.phases, self.deterministic)


#: a run of the model alone: no adapters, no packed documents, no phases outside the step
NO_WORKLOAD = Workload()


def param_bytes(dtype_bytes: int) -> int:
    """Bytes per gathered weight: FSDP2 gathers in the compute dtype when it is narrower than fp32
    (``MixedPrecisionPolicy(param_dtype=bf16)``), else the fp32 weights themselves."""
    return min(dtype_bytes, 4)


@dataclass
class Candidate:
    """A configuration (exactly what ``loongtrain train`` runs) with its predicted cost; ``breakdown``
    seconds per step by component, ``terms`` the same summed into the step's four terms (:data:`TERMS`)."""

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

    @property
    def terms(self) -> dict[str, float]:
        return {name: sum(self.breakdown.get(k, 0.0) for k in parts) for name, parts in TERMS.items()}

    def to_dict(self) -> dict:
        """The configuration's fields (``hp``, ..., ``recompute``, ``recompute_fraction``) and the prediction."""
        return {
            **asdict(self.config), "dp": self.dp, "world_size": self.world_size,
            "step_time_s": self.step_time, "mfu": self.mfu, "tokens_per_s": self.tokens_per_s,
            "memory_gib": self.memory["total"] / 2**30, "host_gib_per_rank": self.memory.get("host", 0.0) / 2**30,
            "host_gib_per_node": self.host_per_node / 2**30, "fits": self.fits, "bottleneck": self.bottleneck,
            "terms_s": self.terms, "breakdown_s": dict(self.breakdown),
            "memory_parts_gib": {k: v / 2**30 for k, v in self.memory.items()},
        }


def _group_bw(cluster: Cluster, size: int, world: int) -> float:
    """Per-device bytes/s of a collective over ``size`` ranks: intra-node, or the NIC share when it spans nodes."""
    g = cluster.gpus_per_node
    return cluster.cross_bw(min(g, world)) if size > g else cluster.intra_bw


def zero_times(config: ParallelConfig, params: float, world: int, cluster: Cluster,
               dtype_bytes: int = 2) -> tuple[float, float]:
    """``(gather, reduce)`` seconds of FSDP2's collectives for ``params`` parameters: one all-gather of the
    compute-dtype weights, ``(z-1)/z * P * u / bw(z)``, and the fp32 gradient reduce-scatter,
    ``(z-1)/z * P * 4 / bw(z)``, plus with ``hybrid`` the shard's all-reduce across the groups. ``(0, 0)``
    without ZeRO."""
    if config.zero == "none":
        return 0.0, 0.0
    g = cluster.gpus_per_node
    z = config.shard_size(world)
    groups = world // z
    share = (z - 1) / z * params / _group_bw(cluster, z, world)
    reduce = share * GRAD_BYTES
    if config.zero == "hybrid" and groups > 1:
        reduce += 2 * (groups - 1) / groups * params / z * GRAD_BYTES / cluster.cross_bw(g)
    return share * param_bytes(dtype_bytes), reduce


def gradient_buckets(model: ModelConfig, bucket_bytes: int = BUCKET_BYTES,
                     lora: LoraConfig | None = None) -> list[tuple[float, int]]:
    """The fp32 gradient buckets of the all-reduce without ZeRO, as the trainer makes them
    (:func:`loongtrain.parallel.buckets.gradient_buckets` over the parameters in reverse order, the order the
    backward produces them): ``(ready, bytes)`` with ``ready`` the layers whose backward has run when the
    bucket's last gradient exists. The LM head and the final norm come first, at 0 (the chunked loss computed
    their gradients in the forward: they are accumulated when the backward starts); a layer's parameters
    follow its backward, the MLP's first, each at the share of the layer's parameters done; the embedding
    last, at ``L`` (tied: the head's gradient is complete only then). With ``lora`` only the adapters': a
    module's in its place, nothing of the frozen rest."""
    d, f, L = model.dim, model.ffn_dim, model.num_layers
    # w3, w2, w1, ffn_norm, then the attention's projections backward (wo, wv, wk, wq; MLA's), attention_norm
    layer = (d * f, f * d, d * f, d, *reversed(attention_weights(model)), d)
    head = model.vocab_size * d
    if lora is not None:  # the adapters of the same modules, in the same order
        shapes = adapter_shapes(model, lora)
        names = ("up_proj", "down_proj", "gate_proj", "", "o_proj", "v_proj", "k_proj", "q_proj", "")
        layer = tuple(lora.r * sum(shapes[n]) if n in shapes else 0 for n in names)
        head = d = 0
    params = ([] if model.tie_embeddings else [(0.0, head)]) + [(0.0, d)]
    for done in range(L):
        total = 0
        for n in layer:
            total += n
            params.append((done + total / sum(layer), n))
    params.append((float(L), head))
    params = [(ready, n) for ready, n in params if n]
    sizes = [GRAD_BYTES * n for _, n in params]
    return [(params[bucket[-1]][0], sum(sizes[i] for i in bucket)) for bucket in buckets_of(sizes, bucket_bytes)]


def grad_sync_exposed(model: ModelConfig, *, layer_backward: float, world: int, bandwidth: float,
                      latency: float, lora: LoraConfig | None = None) -> float:
    """Exposed seconds of the gradient all-reduce without ZeRO on ``world > 1`` ranks, as the trainer runs it
    (``loongtrain.train.sync``): each bucket of :func:`gradient_buckets` is all-reduced over the world (``2 *
    (W-1)/W * bytes / bandwidth + latency``) from the moment it is full, one after another on the communication
    stream, beside the backward that is still running (``layer_backward`` seconds a layer), and all are waited
    for when the backward ends (on the last micro-batch only); what runs past that end is exposed."""
    end = model.num_layers * layer_backward
    t = 0.0
    for ready, nbytes in gradient_buckets(model, lora=lora):
        t = max(t, ready * layer_backward) + 2 * (world - 1) / world * nbytes / bandwidth + latency
    return max(0.0, t - end)


def document_flops(model: ModelConfig, shape: AttnShape, documents: Documents,
                   lora: LoraConfig | None = None) -> float:
    """Model FLOPs of one replica's step of packed ``documents``: attention counts only the visible pairs
    (:func:`loongtrain.model.config.step_flops`)."""
    tokens = shape.batch * shape.seq_len
    visible = 0.0  # per layer, averaged over the layers' windows
    for window, layers in model.layer_windows().items():
        window = window if window and window < shape.seq_len else None
        pairs = sum(visible_pairs(cu, shape.seq_len, sliding_window=window) for cu in documents.rows(shape.batch))
        visible += pairs * layers / model.num_layers
    return step_flops(model, tokens, visible) - lora_flops_saved(model, lora, tokens)


def layer_attention_time(layout: Layout, shape: AttnShape, cluster: Cluster, documents: Documents | None,
                         model: ModelConfig) -> AttentionTime:
    """:func:`attention_time` of one layer averaged over the model's layers, each with its own window
    (``layer_types``: a full layer's call and a sliding layer's differ)."""
    kinds = [(layers / model.num_layers, attention_time(layout, replace(shape, sliding_window=window),
                                                        cluster, documents))
             for window, layers in model.layer_windows().items()]
    if len(kinds) == 1:
        return kinds[0][1]
    return AttentionTime(**{f.name: sum(share * getattr(t, f.name) for share, t in kinds)
                            for f in fields(AttentionTime)})


def step_cost(
    model: ModelConfig, config: ParallelConfig, cluster: Cluster, *, nodes: int, seq_len: int, batch: int = 1,
    dtype_bytes: int = 2, world: int | None = None, workload: Workload = NO_WORKLOAD,
) -> Candidate:
    """Predicted step time (its terms), MFU, memory and bottleneck of ``config`` on ``nodes`` nodes; ``world``: the
    devices used when fewer than ``nodes`` whole nodes (one partial node); ``workload``: the run's adapters,
    packed documents and objective's memory phases (:class:`Workload`)."""
    lora, documents = workload.lora, workload.documents
    world = world or nodes * cluster.gpus_per_node
    layout = config.layout(world)
    shape = AttnShape(batch, seq_len, model.num_heads, model.num_kv_heads, model.head_dim, dtype_bytes,
                      v_head_dim=model.v_head_dim)
    attn = layer_attention_time(layout, shape, cluster, documents, model)
    t = batch * seq_len / layout.sp
    rate, bw = cluster.matmul_tflops * 1e12, cluster.memory_bw
    p_l, L = layer_params(model), model.num_layers
    z = config.shard_size(world)
    features = workload.memory(cluster)
    shape_of = step_shape(model, layout, config, tokens=t, dtype_bytes=dtype_bytes, zero_size=z,
                          terms=run_terms(model, config, features), batch=batch)
    sharded, tiles = shape_of.sharded, shape_of.tiles  # FSDP2 gathers the weights; the tiled MLP's rule
    he = effective_kv_heads(model.num_heads, model.num_kv_heads, layout.hp)
    moved, moved_fwd = layer_bytes(model, tokens=t, kv_heads=he, hp=layout.hp, dtype_bytes=dtype_bytes,
                                   sharded=sharded, checkpointed=config.recompute != "none", mlp_tiles=tiles)
    gemm_fwd = 2 * active_layer_params(model) * t / rate  # an MoE layer: its router and top_k experts
    adapters = 2 * layer_adapter_params(model, lora) * t / rate  # --lora: the adapters' forward (backward 2x)
    fwd = {"compute": gemm_fwd + adapters + attn.compute_fwd, "memory-bound": moved_fwd / bw + attn.memory_fwd,
           "a2a": attn.a2a_fwd, "ring-inner": attn.ring_inner_fwd, "ring-outer": attn.ring_outer_fwd}
    bwd = {"compute": (matmul_factor(lora) - 1) * gemm_fwd + 2 * adapters + attn.compute_bwd,
           "memory-bound": (moved - moved_fwd) / bw + attn.memory_bwd,
           "a2a": attn.a2a_bwd, "ring-inner": attn.ring_inner_bwd, "ring-outer": attn.ring_outer_bwd}
    if model.linear_layers:  # a hybrid's linear layers, in their share of the average layer (plan/linear_cost.py)
        linear = linear_time(model, layout, cluster, batch=batch, seq_len=seq_len, dtype_bytes=dtype_bytes)
        share = len(model.linear_layers) / L
        for key, (forward, backward) in {"compute": (linear.compute_fwd, linear.compute_bwd),
                                         "a2a": (linear.a2a_fwd, linear.a2a_bwd),
                                         "ring-inner": (linear.exchange_fwd, linear.exchange_bwd)}.items():
            fwd[key] += share * forward
            bwd[key] += share * backward + (share * forward if key == "compute" and config.recompute == "selective"
                                             else 0.0)  # selective recompute runs the recurrence again
    if config.recompute == "full":  # the recompute in the backward: the layer forward, attention and its traffic
        for key, value in fwd.items():
            bwd[key] += value - (moved_fwd / bw if key == "memory-bound" else 0.0)  # its bytes are in `moved`
    elif config.recompute == "selective":
        bwd["compute"] += gemm_fwd
    if tiles > 1:
        bwd["compute"] += 2 * 3 * model.dim * mlp_width(model) * t / rate  # each tile's MLP forward again
    per_layer = {k: fwd[k] + bwd[k] for k in fwd}
    layer_busy = sum(per_layer.values())
    trained = p_l if lora is None else layer_adapter_params(model, lora)  # the gradients reduced
    gather, reduce = zero_times(config, p_l, world, cluster, dtype_bytes)[0], \
        zero_times(config, trained, world, cluster, dtype_bytes)[1]
    zero_exposed = max(0.0, 2 * gather + reduce - layer_busy)
    head_params = model.vocab_size * model.dim
    head_gather, head_reduce = zero_times(config, head_params, world, cluster, dtype_bytes)
    head_reduce = head_reduce if lora is None else 0.0  # a frozen head has no gradient
    breakdown = {k: L * v for k, v in per_layer.items()}
    breakdown["compute"] += 2 * matmul_factor(lora) * head_params * t / rate
    breakdown["memory-bound"] += head_bytes(model, tokens=t, dtype_bytes=dtype_bytes, sharded=sharded) / bw
    breakdown["zero"] = L * zero_exposed + 2 * gather + reduce + head_gather + head_reduce if z > 1 else 0.0
    breakdown["grad-sync"] = 0.0
    if config.zero == "none" and world > 1:
        latency = cluster.inter_latency_us if world > cluster.gpus_per_node else cluster.intra_latency_us
        breakdown["grad-sync"] = grad_sync_exposed(model, layer_backward=sum(bwd.values()), world=world,
                                                   bandwidth=_group_bw(cluster, world, world), latency=latency * 1e-6,
                                                   lora=lora)
    memory = memory_per_rank(model, layout, config, seq_len=seq_len, batch=batch, dtype_bytes=dtype_bytes,
                             zero_size=z, features=features)
    if config.offload_activations or config.offload_params:
        breakdown["offload"] = offload_time(model, config, cluster, world, memory, layer_busy, lora)
    stepped = num_params(model) if lora is None else adapter_params(model, lora)  # what AdamW updates
    if config.offload_params:
        ranks = min(world, cluster.gpus_per_node)
        breakdown["optimizer"] = stepped / z / (cluster.cpu_adam_gparams_s * 1e9 / ranks)
    else:
        breakdown["optimizer"] = OPTIMIZER_BYTES * stepped / z / bw
    step = sum(breakdown.values())
    host_per_node = memory["host"] * min(world, cluster.gpus_per_node)
    fits = memory["total"] <= cluster.usable_memory and host_per_node <= cluster.usable_host_memory
    tokens = layout.dp * batch * seq_len
    model_flops = (tokens * flops_per_token(model, seq_len) - lora_flops_saved(model, lora, tokens)
                   if documents is None else layout.dp * document_flops(model, shape, documents, lora))
    mfu = model_flops / (step * world * cluster.peak_tflops * 1e12)
    comm = max(COMMUNICATION, key=lambda k: breakdown.get(k, 0.0))
    bottleneck = comm if breakdown.get(comm, 0.0) >= BOTTLENECK_SHARE * step else "compute"
    if not fits:
        bottleneck = "memory"
    return Candidate(config, world, layout.dp, step, mfu, tokens / step, memory, fits, bottleneck, breakdown,
                     host_per_node)


def active_layer_params(model: ModelConfig) -> float:
    """:func:`~loongtrain.plan.memory_model.layer_params` with an MoE layer's experts counted ``top_k`` times
    (the weights one token's matmuls use), averaged over the layers; a dense model's ``P_l``."""
    return layer_params(model) - (mlp_params(model) - mlp_params(model, active=True)) / model.num_layers


def offload_time(model: ModelConfig, config: ParallelConfig, cluster: Cluster, world: int,
                 memory: dict[str, float], layer_busy: float, lora: LoraConfig | None = None) -> float:
    """Exposed seconds per step of the offload modes' host copies (module docstring; ``lora``: only the
    adapters' gradient shards go out)."""
    L, z = model.num_layers, config.shard_size(world)
    offloaded = L - min(config.offload_keep, L - 1) if config.offload_activations else 0
    acts = 2 * memory["host_activations"] / offloaded / cluster.host_bw if offloaded else 0.0  # out and back
    grads = layer_params(model) if lora is None else layer_adapter_params(model, lora)
    params = (8 * layer_params(model) + 4 * grads) / z / cluster.host_bw if config.offload_params else 0.0
    return offloaded * max(0.0, acts + params - layer_busy) + (L - offloaded) * max(0.0, params - layer_busy)
