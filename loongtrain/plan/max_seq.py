"""The longest sequence that fits: :func:`max_seq_len` bisects it for a model, device count and cluster,
and names its best configuration (``loongtrain plan --max-seq-len``, docs/planner.md#search).

Bounded at any device count: the configurations are enumerated once per set of sequence-parallel sizes the
length allows (:func:`~loongtrain.plan.search.max_sp`), each distinct in memory
(:func:`~loongtrain.plan.memory_model.memory_key`) is checked once per length with the last one that fitted
first, and only the configurations that fit at the answer are costed for the ranking."""

from __future__ import annotations

from loongtrain.model.config import ModelConfig
from loongtrain.parallel.config import ParallelConfig
from loongtrain.plan.cluster import Cluster, load_cluster
from loongtrain.plan.cost import NO_WORKLOAD, Candidate, Workload
from loongtrain.plan.memory_model import memory_key, memory_per_rank
from loongtrain.plan.search import MIN_SHARD_TOKENS, enumerate_configs, max_sp, plan, ranked, resolve_model, world_size

MAX_SEQ_LEN = 1 << 36  # the bisection's ceiling (tokens)


def fits_memory(model: ModelConfig, config: ParallelConfig, cluster: Cluster, world: int, seq_len: int, *,
                batch: int, dtype_bytes: int, workload: Workload = NO_WORKLOAD) -> bool:
    """Whether ``config`` fits in device and host memory (what :func:`step_cost` decides, without the time)."""
    memory = memory_per_rank(model, config.layout(world), config, seq_len=seq_len, batch=batch,
                             dtype_bytes=dtype_bytes, zero_size=config.shard_size(world),
                             features=workload.memory(cluster))
    host = memory["host"] * min(world, cluster.gpus_per_node)
    return memory["total"] <= cluster.usable_memory and host <= cluster.usable_host_memory


class _Grid:
    """The configurations valid at a length of the bisection's grid, enumerated once per largest
    sequence-parallel size the length allows (an explicit ``mlp_tiles`` count also depends on the length),
    and one of each memory-distinct kind (:func:`~loongtrain.plan.memory_model.memory_key`)."""

    def __init__(self, model: ModelConfig, world: int, gpus_per_node: int, search: dict) -> None:
        self.model, self.world, self.gpus_per_node, self.search = model, world, gpus_per_node, search
        self.tiles_fixed = search.get("mlp_tiles") not in (None, "1", "auto")
        self.memo: dict[tuple, tuple[list[ParallelConfig], dict[tuple, ParallelConfig]]] = {}

    def at(self, seq_len: int) -> tuple[list[ParallelConfig], dict[tuple, ParallelConfig]]:
        """``(every configuration, {memory key: one of them})`` at ``seq_len``."""
        key = (min(max_sp(seq_len), self.world), seq_len if self.tiles_fixed else None)
        if key not in self.memo:
            configs = enumerate_configs(self.model, self.world, self.gpus_per_node, seq_len, **self.search)
            kinds: dict[tuple, ParallelConfig] = {}
            for c in configs:
                kinds.setdefault(memory_key(c), c)
            self.memo[key] = configs, kinds
        return self.memo[key]


def max_seq_len(
    model: str | ModelConfig, cluster: str | Cluster, *, nodes: int | None = None, gpus: int | None = None,
    batch: int = 1, dtype_bytes: int = 2, modes: str = "auto", workload: Workload = NO_WORKLOAD, **filters,
) -> tuple[int, Candidate]:
    """The longest sequence that fits (device and host memory) and its best configuration: bisected on
    the lengths every configuration on these devices accepts (multiples of ``2 * sp``, ``sp`` the largest
    sequence-parallel degree allowed: the world, or the ``sp`` / ``hp * cp`` filters). Memory grows with
    the length for every configuration, so "some configuration fits" holds below the answer and fails
    above it. The configuration is :func:`~loongtrain.plan.search.plan`'s first at the answer. ValueError
    naming the shortest length when even that does not fit. ``workload``: the run's adapters (smaller states and
    gradients: a longer sequence fits; docs/lora.md) and objective's memory phases
    (:class:`~loongtrain.plan.cost.Workload`)."""
    cl = cluster if isinstance(cluster, Cluster) else load_cluster(cluster)
    world, nodes = world_size(cl, nodes, gpus)
    sp = filters.get("sp") or (filters["hp"] * filters["cp"] if filters.get("hp") and filters.get("cp") else world)
    unit = 2 * sp
    # with one of hp / cp alone the open search needs a sequence-parallel group of at least that size: start
    # where max_sp allows it
    explicit = filters.get("sp") or (filters.get("hp") and filters.get("cp"))
    alone = 1 if explicit else filters.get("hp") or filters.get("cp") or 1
    first = max(1, -(-MIN_SHARD_TOKENS * alone // unit)) if alone > 1 else 1
    _, cfg = resolve_model(model)
    memory = dict(batch=batch, dtype_bytes=dtype_bytes, workload=workload)
    grid = _Grid(cfg, world, cl.gpus_per_node, dict(filters, modes=modes != "off"))
    last: list[tuple] = []  # the memory key that fitted last: the likeliest to fit next

    def fits(k: int) -> bool:  # memory only (the ranking, by step time, is computed once at the end)
        kinds = grid.at(k * unit)[1]
        for key in [key for key in last if key in kinds] + list(kinds):
            if fits_memory(cfg, kinds[key], cl, world, k * unit, **memory):
                last[:] = [key]
                return True
        return False

    if not fits(first):
        least = min(plan(model, cl, seq_len=first * unit, nodes=nodes if gpus is None else None, gpus=gpus, modes=modes,
                         **memory, **filters), key=lambda c: c.memory["total"])
        raise ValueError(f"max_seq_len: no sequence length fits on {world} devices of {cl.name}: even "
                         f"seq_len={first * unit} (the shortest valid) needs "
                         f"{least.memory['total'] / 2**30:.1f} GiB per device "
                         f"({cl.usable_memory / 2**30:.1f} usable) and "
                         f"{least.host_per_node / 2**30:.1f} GiB of host memory per node")
    lo, hi = first, 2 * first  # fits(lo); find hi that does not
    while hi * unit <= MAX_SEQ_LEN and fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    found = _best(cfg, cl, grid, nodes, gpus is not None, lo * unit, modes, memory, filters)
    assert found.fits, found
    return lo * unit, found


def _best(model: ModelConfig, cl: Cluster, grid: _Grid, nodes: int, partial: bool, seq_len: int, modes: str,
          memory: dict, filters: dict) -> Candidate:
    """:func:`~loongtrain.plan.search.plan`'s first candidate at ``seq_len``, costing only the configurations
    that fit (they rank before every other; the offload and tiling modes only when none fits without them
    under ``modes="auto"``)."""
    world = grid.world
    for with_modes in ([False, True] if modes == "auto" else [modes == "on"]):
        configs = (grid.at(seq_len)[0] if with_modes == grid.search["modes"] else
                   enumerate_configs(model, world, cl.gpus_per_node, seq_len, modes=with_modes, **filters))
        fit: dict[tuple, bool] = {}
        for c in configs:
            key = memory_key(c)
            if key not in fit:
                fit[key] = fits_memory(model, c, cl, world, seq_len, **memory)
        fitting = [c for c in configs if fit[memory_key(c)]]
        if fitting:
            return ranked(model, cl, fitting, nodes=nodes, seq_len=seq_len, world=world if partial else None,
                          **memory)[0]
    raise AssertionError(f"no configuration fits at seq_len={seq_len}, which the bisection found fitting")
