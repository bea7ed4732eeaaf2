"""The longest sequence that fits: :func:`max_seq_len` bisects it for a model, device count and cluster,
and names its best configuration (``loongtrain plan --max-seq-len``, docs/planner.md)."""

from __future__ import annotations

from loongtrain.model.config import ModelConfig
from loongtrain.model.lora import LoraConfig
from loongtrain.parallel.config import ParallelConfig
from loongtrain.plan.cluster import Cluster, load_cluster
from loongtrain.plan.cost import Candidate
from loongtrain.plan.memory_model import config_memory
from loongtrain.plan.search import enumerate_configs, plan, resolve_model, world_size

MAX_SEQ_LEN = 1 << 36  # the bisection's ceiling (tokens)


def fits_memory(model: ModelConfig, config: ParallelConfig, cluster: Cluster, world: int, seq_len: int,
                batch: int, dtype_bytes: int, lora: LoraConfig | None = None, reference: bool = False) -> bool:
    """Whether ``config`` fits in device and host memory (what :func:`step_cost` decides, without the time)."""
    memory = config_memory(model, config, config.layout(world), seq_len=seq_len, batch=batch,
                           dtype_bytes=dtype_bytes, zero_size=config.shard_size(world), lora=lora,
                           reference=reference)
    host = memory["host"] * min(world, cluster.gpus_per_node)
    return memory["total"] <= cluster.usable_memory and host <= cluster.usable_host_memory


def max_seq_len(
    model: str | ModelConfig, cluster: str | Cluster, *, nodes: int | None = None, gpus: int | None = None,
    batch: int = 1, dtype_bytes: int = 2, modes: str = "auto", lora: LoraConfig | None = None,
    reference: bool = False, **filters,
) -> tuple[int, Candidate]:
    """The longest sequence that fits (device and host memory) and its best configuration: bisected on
    the lengths every configuration on these devices accepts (multiples of ``2 * sp``, ``sp`` the largest
    sequence-parallel degree allowed: the world, or the ``sp`` / ``hp * cp`` filters). Memory grows with
    the length for every configuration, so "some configuration fits" holds below the answer and fails
    above it. ValueError naming the shortest length when even that does not fit. ``lora``: adapters on a
    frozen base (smaller states and gradients: a longer sequence fits; docs/lora.md)."""
    cl = cluster if isinstance(cluster, Cluster) else load_cluster(cluster)
    world, nodes = world_size(cl, nodes, gpus)
    sp = filters.get("sp") or (filters["hp"] * filters["cp"] if filters.get("hp") and filters.get("cp") else world)
    unit = 2 * sp
    kw = dict(nodes=nodes if gpus is None else None, gpus=gpus, batch=batch, dtype_bytes=dtype_bytes,
              modes=modes, lora=lora, reference=reference, **filters)

    _, cfg = resolve_model(model)
    search = dict(filters, modes=modes != "off")

    def fits(k: int) -> bool:  # memory only (the ranking, by step time, is computed once at the end)
        return any(fits_memory(cfg, c, cl, world, k * unit, batch, dtype_bytes, lora, reference)
                   for c in enumerate_configs(cfg, world, cl.gpus_per_node, k * unit, **search))

    if not fits(1):
        least = min(plan(model, cl, seq_len=unit, **kw), key=lambda c: c.memory["total"])
        raise ValueError(f"max_seq_len: no sequence length fits on {world} devices of {cl.name}: even "
                         f"seq_len={unit} (the shortest valid) needs {least.memory['total'] / 2**30:.1f} GiB per "
                         f"device ({cl.usable_memory / 2**30:.1f} usable) and "
                         f"{least.host_per_node / 2**30:.1f} GiB of host memory per node")
    lo, hi = 1, 2  # fits(lo); find hi that does not
    while hi * unit <= MAX_SEQ_LEN and fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    found = plan(model, cl, seq_len=lo * unit, **kw)[0]
    assert found.fits, found
    return lo * unit, found
