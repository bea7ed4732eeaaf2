"""Configuration search: enumerate valid ParallelConfigs (hp, cp, inner_ring, placement, zero, recompute), cost
each, rank them. A candidate's ``config`` is exactly what ``loongtrain train`` runs (``zero="hybrid"``
shards over ``zero_shard_size = gpus_per_node`` ranks: one node).

Ranking: configurations that fit in memory first, by MFU (throughput per device; step time alone
would favour small ``sp`` with many replicas) rounded to 0.1 point, then by memory; then the others
by memory. Equivalent points
are listed once: with ``hp == 1`` or ``cp == 1`` both placements are the same ranks; ``inner_ring == cp``
is the same ring as ``inner_ring == 1`` (listed as the latter unless asked for); ``zero="hybrid"`` on one
node is ``zero="full"`` (and needs two devices per node). The offload and tiling modes
(``offload_activations`` with ``recompute`` full or selective, ``mlp_tiles`` "1" or "auto", ``offload_params``
with ZeRO) are enumerated with ``modes="on"``, or with ``modes="auto"`` only when nothing fits without
them (docs/planner.md). ``gpus`` plans any device count: part of one node (1, 2, 4, ...) or whole
nodes (:func:`world_size`). Every candidate passes
:func:`~loongtrain.parallel.config.validate_parallel` for the world size, sequence length and heads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loongtrain.hf.convert import shape_config_from_hf
from loongtrain.hf.load import check_hf_dir
from loongtrain.model.config import PRESETS, ModelConfig
from loongtrain.parallel.config import (
    PLACEMENTS,
    RECOMPUTE_MODES,
    ZERO_MODES,
    ParallelConfig,
    effective_kv_heads,
    validate_parallel,
)
from loongtrain.parallel.zigzag import divisors, valid_sequence_length
from loongtrain.plan.cluster import Cluster, load_cluster
from loongtrain.plan.cost import NO_WORKLOAD, Candidate, Workload, step_cost


def head_ok(model: ModelConfig, hp: int) -> bool:
    """Whether ``hp`` satisfies the GQA rule for ``model``'s heads (and its linear layers' value and key heads)."""
    try:
        effective_kv_heads(model.num_heads, model.num_kv_heads, hp)
        if model.linear_layers:
            effective_kv_heads(model.linear_num_value_heads, model.linear_num_key_heads, hp)
    except ValueError:
        return False
    return True


def resolve_model(model: str | Path | ModelConfig) -> tuple[str, ModelConfig]:
    """``(name, ModelConfig)`` of a preset name, a ModelConfig, or a Hugging Face model: its local
    directory or config.json (any supported family, :func:`loongtrain.hf.shape_config_from_hf`).
    ValueError naming the presets for anything else."""
    if isinstance(model, ModelConfig):
        return "custom", model
    if str(model) in PRESETS:
        return str(model), PRESETS[str(model)]
    path = Path(model)
    if path.is_dir() or (path.is_file() and path.name.endswith(".json")):
        directory = path if path.is_dir() else path.parent
        if path.is_file() and path.name != "config.json":
            raise ValueError(f"model {str(path)!r}: a Hugging Face config file must be named config.json")
        return str(path), shape_config_from_hf(check_hf_dir(directory))  # built on meta: every config error
    raise ValueError(f"unknown model {str(model)!r}; presets: {sorted(PRESETS)}, or a local Hugging Face model "
                     f"directory (or its config.json)")


def _check_choice(name: str, value, allowed: list) -> None:
    if value is not None and value not in allowed:
        raise ValueError(f"{name}={value!r} is not valid here; valid values: {allowed}")


MODE_SEARCH = ("off", "auto", "on")


#: blocks kept on the device under activation offload that the search tries (``--offload-keep``, fewer than L)
OFFLOAD_KEEPS = (0, 2, 4, 8)


def mode_choices(recompute: str, zero: str, modes: bool, offload_activations: bool | None = None,
                 mlp_tiles: str | None = None, offload_params: bool | None = None,
                 num_layers: int = 0) -> list[dict]:
    """The offload/tiling settings to try with one (recompute, zero): the defaults only, unless ``modes``;
    a given filter fixes its mode. Activation offload needs checkpointing, parameter offload FSDP2; with
    ``modes`` it also tries keeping the last :data:`OFFLOAD_KEEPS` blocks (fewer than ``num_layers``) on
    the device, for when host memory is the limit."""
    acts = [offload_activations] if offload_activations is not None else [False, True] if modes else [False]
    tiles = [mlp_tiles] if mlp_tiles is not None else ["1", "auto"] if modes else ["1"]
    params = [offload_params] if offload_params is not None else [False, True] if modes else [False]
    keeps = [k for k in OFFLOAD_KEEPS if k < num_layers] if modes else [0]
    return [dict(offload_activations=a, mlp_tiles=m, offload_params=o, offload_keep=k) for o in params
            for a in acts for m in tiles for k in (keeps if a else [0])
            if not (a and recompute == "none") and not (o and zero == "none")]


#: the configuration filters :func:`enumerate_configs` takes (``PlanConfig.filters``): ``None`` = any
FILTERS = ("sp", "hp", "cp", "inner_ring", "placement", "zero", "recompute", "offload_activations", "mlp_tiles",
           "offload_params")


def enumerate_configs(model: ModelConfig, world: int, gpus_per_node: int, seq_len: int, *, modes: bool = False,
                      **filters: Any) -> list[ParallelConfig]:
    """All distinct valid configurations matching the given ``filters`` (:data:`FILTERS`; a filter left out or
    ``None`` = any), with the offload and tiling modes when ``modes`` (:func:`mode_choices`). Raises ValueError
    naming the offending value and the valid alternatives when a filter cannot be met."""
    unknown = sorted(set(filters) - set(FILTERS))
    if unknown:
        raise ValueError(f"unknown configuration filter(s) {unknown}; valid: {list(FILTERS)}")
    sp, hp, cp, inner_ring, placement, zero, recompute, offload_activations, mlp_tiles, offload_params = (
        filters.get(name) for name in FILTERS)
    _check_choice("placement", placement, list(PLACEMENTS))
    _check_choice("zero", zero, list(ZERO_MODES))
    _check_choice("recompute", recompute, list(RECOMPUTE_MODES))
    _check_choice("sp", sp, divisors(world))
    heads = f"{model.num_heads} heads, {model.num_kv_heads} KV heads" + (
        f", {model.linear_num_value_heads} linear value heads, {model.linear_num_key_heads} linear key heads"
        if model.linear_layers else "")
    if hp is not None and not head_ok(model, hp):
        valid = [h for h in divisors(world) if head_ok(model, h)]
        raise ValueError(
            f"hp={hp} is invalid for this model ({heads}): hp must divide num_heads, and divide "
            f"num_kv_heads or be a multiple of it; valid hp on {world} devices: {valid}"
        )
    if model.moe_layers:  # TiledMLP tiles a dense MLP; the experts' backward needs their forward's graph
        if mlp_tiles not in (None, "1"):
            raise ValueError(f"mlp_tiles={mlp_tiles!r}: a model with experts runs its MLPs untiled (mlp_tiles='1')")
        mlp_tiles = "1"
    sps = [sp] if sp is not None else [s for s in divisors(world) if s <= max_sp(seq_len)]
    if hp is not None and cp is not None:
        _check_choice("hp*cp", hp * cp, divisors(world))
        sps = [hp * cp]
    multi_node = world > gpus_per_node >= 2
    configs = []
    for s in sps:
        if not valid_sequence_length(seq_len, s, 1):
            continue
        for h in divisors(s):
            c = s // h
            if (hp is not None and h != hp) or (cp is not None and c != cp) or not head_ok(model, h):
                continue
            if cp is None and sp is None and c > MAX_OPEN_CP:  # the open search's bound (module docstring)
                continue
            inner_rings = [w for w in divisors(c) if w == inner_ring or (inner_ring is None and (w < c or c == 1))]
            places = list(PLACEMENTS) if h > 1 and c > 1 else ["head_first"]
            zeros = [z for z in ZERO_MODES if z != "hybrid" or multi_node]
            for w in inner_rings:
                for p in places if placement is None else [placement]:
                    for z in zeros if zero is None else [zero]:
                        for k in RECOMPUTE_MODES if recompute is None else [recompute]:
                            for m in mode_choices(k, z, modes, offload_activations, mlp_tiles, offload_params,
                                                   model.num_layers):
                                config = ParallelConfig(
                                    hp=h, cp=c, inner_ring=w, placement=p, zero=z, recompute=k,
                                    zero_shard_size=gpus_per_node if z == "hybrid" else 0, **m,
                                )
                                validate_parallel(config, world, seq_len=seq_len, num_heads=model.num_heads,
                                                  num_kv_heads=model.num_kv_heads)
                                configs.append(config)
    if not configs:
        _explain_empty(model, world, seq_len, sp, hp, cp, inner_ring)
    return configs


#: the fewest tokens a rank's shard of the sequence holds in the open search (a smaller shard leaves the
#: attention kernel's blocks mostly empty and its messages latency-bound: never the better layout)
MIN_SHARD_TOKENS = 64
#: the longest context ring the open search tries (an explicit --cp or --sp is tried whatever its size): the
#: ring's simulation grows with it, and past it the per-hop latency outweighs the shorter blocks
MAX_OPEN_CP = 1024
#: the largest sequence-parallel group (hp*cp) the open search tries: 512 nodes of 8 per sequence
MAX_OPEN_SP = 4096
#: the most devices the planner plans for (beyond: exit 2 naming the range; docs/planner.md)
MAX_DEVICES = 65536


def max_sp(seq_len: int) -> int:
    """The largest sequence-parallel group the open search tries: ``seq_len / MIN_SHARD_TOKENS`` (at least 1),
    at most :data:`MAX_OPEN_SP`. An explicit ``--sp`` or ``--hp`` with ``--cp`` is tried whatever its size."""
    return max(1, min(MAX_OPEN_SP, seq_len // MIN_SHARD_TOKENS))


def _explain_empty(model, world, seq_len, sp, hp, cp, inner_ring) -> None:
    if inner_ring is not None and cp is not None and cp % inner_ring:
        raise ValueError(f"inner_ring={inner_ring} must divide cp={cp}; valid sizes: {divisors(cp)}")
    valid_sp = [s for s in divisors(world) if valid_sequence_length(seq_len, s, 1)]
    if not valid_sp or (sp is not None and sp not in valid_sp):
        unit = 2 * (sp or world)
        lower, upper = seq_len // unit * unit, (seq_len // unit + 1) * unit
        raise ValueError(
            f"seq_len={seq_len} must be divisible by 2*sp (sp=hp*cp); sp values it allows on {world} "
            f"devices: {valid_sp}; nearest lengths for sp={sp or world}: {lower or unit}, {upper}"
        )
    options = sorted({(h, s // h) for s in valid_sp for h in divisors(s) if head_ok(model, h)})
    raise ValueError(
        f"no valid configuration with hp={hp}, cp={cp}, inner_ring={inner_ring}, sp={sp} for {model.num_heads} "
        f"heads / {model.num_kv_heads} KV heads on {world} devices; valid (hp, cp) pairs: {options}"
    )


def _in_range(name: str, value: int, devices: int, cluster: Cluster) -> None:
    if devices > MAX_DEVICES:
        raise ValueError(f"--{name}={value} is out of range: the planner plans for at most {MAX_DEVICES} devices "
                         f"({MAX_DEVICES // cluster.gpus_per_node} nodes of {cluster.gpus_per_node} on "
                         f"{cluster.name}); plan a slice of the cluster (data parallelism repeats it)")


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")


def world_size(cluster: Cluster, nodes: int | None = None, gpus: int | None = None) -> tuple[int, int]:
    """``(devices, nodes)`` of a request by whole ``nodes`` or by ``gpus``: part of one node (up to
    ``gpus_per_node``) or a whole number of nodes. ValueError naming the value otherwise."""
    g = cluster.gpus_per_node
    if gpus is None:
        if nodes is None:
            raise ValueError("give the devices to plan for: nodes or gpus")
        _positive("nodes", nodes)
        _in_range("nodes", nodes, nodes * g, cluster)
        return nodes * g, nodes
    _positive("gpus", gpus)
    _in_range("gpus", gpus, gpus, cluster)
    if nodes is not None and nodes * g != gpus and not (nodes == 1 and gpus <= g):
        raise ValueError(f"gpus={gpus} and nodes={nodes} disagree ({cluster.name}: {g} devices per node)")
    if gpus > g and gpus % g:
        raise ValueError(f"gpus={gpus} does not fit {cluster.name} nodes of {g} devices: use 1-{g} (part of one "
                         f"node) or a multiple of {g}, e.g. {gpus // g * g} or {(gpus // g + 1) * g}")
    return gpus, -(-gpus // g)


def plan(
    model: str | ModelConfig, cluster: str | Cluster, *, nodes: int | None = None, seq_len: int, batch: int = 1,
    dtype_bytes: int = 2, gpus: int | None = None, modes: str = "off", workload: Workload = NO_WORKLOAD, **filters,
) -> list[Candidate]:
    """Every distinct valid configuration with its predicted cost, best first (see module docstring), on
    ``nodes`` whole nodes or ``gpus`` devices. ``modes``: off | auto | on (the offload and tiling modes: never,
    only when nothing fits without them, always); ``workload``: the run's adapters, packed documents (charged by
    visible pairs, docs/planner.md) and objective's memory phases (:class:`~loongtrain.plan.cost.Workload`);
    ``filters``: :data:`FILTERS`."""
    _, cfg = resolve_model(model)
    cl = cluster if isinstance(cluster, Cluster) else load_cluster(cluster)
    _check_choice("modes", modes, list(MODE_SEARCH))
    _positive("seq_len", seq_len)
    _positive("batch", batch)
    world, nodes = world_size(cl, nodes, gpus)
    kw = dict(nodes=nodes, seq_len=seq_len, batch=batch, dtype_bytes=dtype_bytes,
              world=world if gpus is not None else None, workload=workload)
    configs = enumerate_configs(cfg, world, cl.gpus_per_node, seq_len, modes=modes == "on", **filters)
    cands = ranked(cfg, cl, configs, **kw)
    if modes == "auto" and not cands[0].fits:
        configs = enumerate_configs(cfg, world, cl.gpus_per_node, seq_len, modes=True, **filters)
        cands = ranked(cfg, cl, configs, **kw)
    return cands


def ranked(model: ModelConfig, cluster: Cluster, configs: list[ParallelConfig], **cost) -> list[Candidate]:
    """``configs`` costed (:func:`~loongtrain.plan.cost.step_cost` with ``cost``: nodes, seq_len, batch,
    dtype_bytes, world, workload) and ranked best first (:func:`_rank_key`)."""
    return sorted((step_cost(model, c, cluster, **cost) for c in configs), key=_rank_key)


def _rank_key(c: Candidate) -> tuple:
    """Fitting first; among them higher MFU (to 0.1 point: closer is a tie), then less memory; the
    rest by memory, smallest first (the closest to fitting)."""
    if c.fits:
        return (0, -round(c.mfu, 3), c.memory["total"], c.config.inner_ring)
    return (1, c.memory["total"], -c.mfu, c.config.inner_ring)


def best_fitting(
    model: str | ModelConfig, cluster: str | Cluster, *, nodes: int | None = None, seq_len: int, batch: int = 1,
    dtype_bytes: int = 2, gpus: int | None = None, modes: str = "off", workload: Workload = NO_WORKLOAD, **filters,
) -> Candidate:
    """The best configuration that fits in device and host memory (for ``loongtrain train --plan auto``,
    with ``modes="auto"``; ``workload``: as :func:`plan`'s); ValueError naming the closest feasible alternatives
    when none fits."""
    kw = dict(seq_len=seq_len, batch=batch, dtype_bytes=dtype_bytes, gpus=gpus, modes=modes, workload=workload,
              **filters)
    cands = plan(model, cluster, nodes=nodes, **kw)
    if cands[0].fits:
        return cands[0]
    raise ValueError(no_fit_message(model, cluster, cands, nodes=nodes, **kw))


def no_fit_message(model, cluster, cands: list[Candidate], *, nodes: int | None = None, seq_len: int,
                   gpus: int | None = None, **kw) -> str:
    """Why nothing fits (device or host memory), and the closest feasible requests: more devices, or a
    shorter sequence."""
    cl = cluster if isinstance(cluster, Cluster) else load_cluster(cluster)
    world, nodes = world_size(cl, nodes, gpus)
    where = f"gpus={gpus}" if gpus is not None else f"nodes={nodes}"
    least = min(cands, key=lambda c: c.memory["total"])
    lines = [
        f"nothing fits in memory: seq_len={seq_len} on {where} ({world} devices of "
        f"{cl.memory_gib:g} GiB, {cl.usable_memory / 2**30:.1f} GiB usable); the smallest configuration "
        f"({least.config.label()}) needs {least.memory['total'] / 2**30:.1f} GiB per device."
    ]
    if least.memory["total"] <= cl.usable_memory:
        lines.append(f"it fits on the device but needs {least.host_per_node / 2**30:.3g} GiB of host memory per "
                     f"node ({cl.usable_host_memory / 2**30:.3g} GiB usable of host_memory_gib="
                     f"{cl.host_memory_gib:g})")
    for more in (2, 4, 8, 16, 32, 64):
        bigger = dict(gpus=gpus * more) if gpus is not None else dict(nodes=nodes * more)
        try:
            if plan(model, cl, seq_len=seq_len, **bigger, **kw)[0].fits:
                name, value = next(iter(bigger.items()))
                lines.append(f"closest alternative: --{name} {value} fits seq_len={seq_len}")
                break
        except ValueError:
            continue
    shorter = seq_len // 2
    while shorter >= 2:
        try:
            if plan(model, cl, nodes=nodes, gpus=gpus, seq_len=shorter, **kw)[0].fits:
                lines.append(f"closest alternative: --seq-len {shorter} fits on {where}")
                break
        except ValueError:
            pass
        shorter //= 2
    return "\n".join(lines)

