"""Configuration search: enumerate valid ParallelConfigs (hp, cp, window, placement, zero, ac_mode), cost
each, rank them. A candidate's ``config`` is exactly what ``loongtrain train`` runs (``zero="hybrid"``
shards over ``zero_shard_size = gpus_per_node`` ranks: one node).

Ranking: configurations that fit in memory first, by MFU (throughput per device; step time alone
would favour small ``sp`` with many replicas) rounded to 0.1 point, then by memory; then the others
by memory. Equivalent points
are listed once: with ``hp == 1`` or ``cp == 1`` both placements are the same ranks; ``window == cp``
is the same ring as ``window == 1`` (listed as the latter unless asked for); ``zero="hybrid"`` on one
node is ``zero="full"`` (and needs two devices per node). Every candidate passes
:func:`~loongtrain.parallel.config.validate_parallel` for the world size, sequence length and heads.
"""

from __future__ import annotations

from pathlib import Path

from loongtrain.hf.convert import shape_config_from_hf
from loongtrain.hf.load import read_hf_config
from loongtrain.model.config import PRESETS, ModelConfig
from loongtrain.parallel.config import (
    AC_ALIASES,
    AC_MODES,
    PLACEMENTS,
    ZERO_MODES,
    ParallelConfig,
    effective_kv_heads,
    validate_parallel,
)
from loongtrain.parallel.documents import Documents
from loongtrain.parallel.zigzag import divisors, valid_sequence_length
from loongtrain.plan.cluster import Cluster, load_cluster
from loongtrain.plan.cost import Candidate, step_cost


def head_ok(model: ModelConfig, hp: int) -> bool:
    """Whether ``hp`` satisfies the GQA rule for ``model``'s heads."""
    try:
        effective_kv_heads(model.num_heads, model.num_kv_heads, hp)
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
        return str(path), shape_config_from_hf(read_hf_config(directory))
    raise ValueError(f"unknown model {str(model)!r}; presets: {sorted(PRESETS)}, or a local Hugging Face model "
                     f"directory (or its config.json)")


def _check_choice(name: str, value, allowed: list) -> None:
    if value is not None and value not in allowed:
        raise ValueError(f"{name}={value!r} is not valid here; valid values: {allowed}")


def enumerate_configs(
    model: ModelConfig, world: int, gpus_per_node: int, seq_len: int, *, sp: int | None = None,
    hp: int | None = None, cp: int | None = None, window: int | None = None, placement: str | None = None,
    zero: str | None = None, ac_mode: str | None = None,
) -> list[ParallelConfig]:
    """All distinct valid configurations matching the given filters (``None`` = any). Raises ValueError
    naming the offending value and the valid alternatives when a filter cannot be met."""
    ac_mode = AC_ALIASES.get(ac_mode, ac_mode) if ac_mode else ac_mode
    _check_choice("placement", placement, list(PLACEMENTS))
    _check_choice("zero", zero, list(ZERO_MODES))
    _check_choice("ac_mode", ac_mode, list(AC_MODES))
    _check_choice("sp", sp, divisors(world))
    heads = f"{model.num_heads} heads, {model.num_kv_heads} KV heads"
    if hp is not None and not head_ok(model, hp):
        valid = [h for h in divisors(world) if head_ok(model, h)]
        raise ValueError(
            f"hp={hp} is invalid for this model ({heads}): hp must divide num_heads, and divide "
            f"num_kv_heads or be a multiple of it; valid hp on {world} devices: {valid}"
        )
    sps = [sp] if sp is not None else divisors(world)
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
            windows = [w for w in divisors(c) if w == window or (window is None and (w < c or c == 1))]
            places = list(PLACEMENTS) if h > 1 and c > 1 else ["head_first"]
            zeros = [z for z in ZERO_MODES if z != "hybrid" or multi_node]
            for w in windows:
                for p in places if placement is None else [placement]:
                    for z in zeros if zero is None else [zero]:
                        for k in AC_MODES if ac_mode is None else [ac_mode]:
                            config = ParallelConfig(
                                hp=h, cp=c, window=w, placement=p, zero=z, ac_mode=k,
                                zero_shard_size=gpus_per_node if z == "hybrid" else 0,
                            )
                            validate_parallel(config, world, seq_len=seq_len, num_heads=model.num_heads,
                                              num_kv_heads=model.num_kv_heads)
                            configs.append(config)
    if not configs:
        _explain_empty(model, world, seq_len, sp, hp, cp, window)
    return configs


def _explain_empty(model, world, seq_len, sp, hp, cp, window) -> None:
    if window is not None and cp is not None and cp % window:
        raise ValueError(f"window={window} must divide cp={cp}; valid windows: {divisors(cp)}")
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
        f"no valid configuration with hp={hp}, cp={cp}, window={window}, sp={sp} for {model.num_heads} "
        f"heads / {model.num_kv_heads} KV heads on {world} devices; valid (hp, cp) pairs: {options}"
    )


def plan(
    model: str | ModelConfig, cluster: str | Cluster, *, nodes: int, seq_len: int, batch: int = 1,
    dtype_bytes: int = 2, documents: Documents | None = None, **filters,
) -> list[Candidate]:
    """Every distinct valid configuration with its predicted cost, best first (see module docstring).
    ``documents``: packed rows of the batch, charged by visible pairs (docs/design.md §9); ``filters``:
    sp, hp, cp, window, placement, zero, ac_mode."""
    _, cfg = resolve_model(model)
    cl = cluster if isinstance(cluster, Cluster) else load_cluster(cluster)
    for name, value in (("nodes", nodes), ("seq_len", seq_len), ("batch", batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    world = nodes * cl.gpus_per_node
    configs = enumerate_configs(cfg, world, cl.gpus_per_node, seq_len, **filters)
    cands = [step_cost(cfg, c, cl, nodes=nodes, seq_len=seq_len, batch=batch, dtype_bytes=dtype_bytes,
                       documents=documents) for c in configs]
    cands.sort(key=_rank_key)
    return cands


def _rank_key(c: Candidate) -> tuple:
    """Fitting first; among them higher MFU (to 0.1 point: closer is a tie), then less memory; the
    rest by memory, smallest first (the closest to fitting)."""
    if c.fits:
        return (0, -round(c.mfu, 3), c.memory["total"], c.config.window)
    return (1, c.memory["total"], -c.mfu, c.config.window)


def best_fitting(
    model: str | ModelConfig, cluster: str | Cluster, *, nodes: int, seq_len: int, batch: int = 1,
    dtype_bytes: int = 2, **filters,
) -> Candidate:
    """The best configuration that fits in memory (for ``loongtrain train --plan auto``); ValueError
    naming the closest feasible alternatives when none fits."""
    cands = plan(model, cluster, nodes=nodes, seq_len=seq_len, batch=batch, dtype_bytes=dtype_bytes,
                 **filters)
    if cands[0].fits:
        return cands[0]
    raise ValueError(no_fit_message(model, cluster, cands, nodes=nodes, seq_len=seq_len, batch=batch,
                                    dtype_bytes=dtype_bytes, **filters))


def no_fit_message(model, cluster, cands: list[Candidate], *, nodes: int, seq_len: int, **kw) -> str:
    """Why nothing fits, and the closest feasible requests: more nodes, or a shorter sequence."""
    cl = cluster if isinstance(cluster, Cluster) else load_cluster(cluster)
    least = min(cands, key=lambda c: c.memory["total"])
    lines = [
        f"nothing fits in memory: seq_len={seq_len} on nodes={nodes} ({nodes * cl.gpus_per_node} devices of "
        f"{cl.memory_gib:g} GiB, {cl.usable_memory / 2**30:.1f} GiB usable); the smallest configuration "
        f"({least.config.label()}) needs {least.memory['total'] / 2**30:.1f} GiB per device."
    ]
    for more in (2, 4, 8, 16, 32, 64):
        try:
            if plan(model, cl, nodes=nodes * more, seq_len=seq_len, **kw)[0].fits:
                lines.append(f"closest alternative: --nodes {nodes * more} fits seq_len={seq_len}")
                break
        except ValueError:
            continue
    shorter = seq_len // 2
    while shorter >= 2:
        try:
            if plan(model, cl, nodes=nodes, seq_len=shorter, **kw)[0].fits:
                lines.append(f"closest alternative: --seq-len {shorter} fits on nodes={nodes}")
                break
        except ValueError:
            pass
        shorter //= 2
    return "\n".join(lines)
