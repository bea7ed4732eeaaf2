"""Time of one 2D-Attention call (forward + backward) on a cluster: compute, all-to-all, ring overlap.

Per rank, with ``S`` the replica's sequence, ``sp = hp * cp``, ``n = cp / inner_ring`` inner rings:

- compute: forward causal FLOPs ``2 * B * S^2 * H * D / sp``; backward 2.5x, at the kernel rate of a step's
  call, :meth:`Cluster.attention_rate` of its ``B * S / cp`` query tokens times ``H / hp`` heads (measured rows
  by call size, or ``attention_tflops``). Under zigzag every ring step does the same work, so a step's kernels
  cost ``forward / cp``; with a ring (``cp > 1``) each step also merges its partial output into the fp32
  accumulators by log-sum-exp (backward: adds dQ and the block's dK/dV into them), memory-bound,
  :func:`~loongtrain.plan.step_bytes.ring_step_bytes` over ``memory_bw``: ``c`` = kernels + merge.
- all-to-all (blocking, on the critical path): per call ``max(intra bytes / intra_bw, cross bytes /
  NIC share) / a2a_efficiency + latency``; bytes from :mod:`loongtrain.plan.traffic`.
- ring: the pass is *simulated* event by event from the schedule the code executes
  (:func:`loongtrain.attn.schedule.pass_events`, docs/attention.md#the-ring-schedule): a post starts a transfer, a
  compute
  takes ``c`` (backward ``2.5 c``), a wait costs the time until the awaited transfer has arrived. Transfers of
  one hop class (inner, outer) share that link's bandwidth equally while in flight (K/V and dK/dV use
  two process groups over one link), so the backward's overlap of the dK/dV chain with K/V hops is
  exact for every ``inner_ring`` and number of inner rings. ``X = bytes / bandwidth + latency`` with the
  bandwidth of the link's class: intra-node, or the NIC shared by the node's devices sending across at
  once. All ranks run the same schedule, so a rank's own send stands for the block it receives, and a
  synchronous ring runs at its slowest hop: the worst rank's link decides.
- documents (:class:`~loongtrain.parallel.documents.Documents`: packed rows, zigzag or the balanced chunk
  layout): a compute event takes as long as its *slowest* ring member (hand-offs are synchronous), whose
  visible pairs against the block it holds (:func:`~loongtrain.plan.document_work.step_work`: the executor's
  own kernel pieces, inner rings included) cost ``4 H D / hp`` FLOPs each. Without documents: as above.
- ``cluster.duplex = False`` (gloo over TCP): an all-to-all, and a ring hop whose next and previous
  peer are the same rank (``inner_ring == 2`` inner, two inner rings outer), carry both directions over one
  connection, one after the other: twice the bytes on that link.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from loongtrain.attn.schedule import Compute, Post, pass_events
from loongtrain.parallel.config import effective_kv_heads
from loongtrain.parallel.documents import Documents
from loongtrain.parallel.layout import Layout
from loongtrain.plan.cluster import Cluster
from loongtrain.plan.document_work import step_work
from loongtrain.plan.step_bytes import ring_step_bytes
from loongtrain.plan.traffic import link_stats, message_bytes, ring_reach

BACKWARD_FLOPS_RATIO = 2.5


@dataclass(frozen=True)
class AttnShape:
    """One attention call: ``seq_len`` is the full sequence of a replica; ``batch`` sequences per replica."""

    batch: int
    seq_len: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    sliding_window: int | None = None  # Mistral's convention (query i sees keys i-w < j <= i); None: none
    v_head_dim: int = 0  # the values' head dim (MLA: smaller than the queries' and keys'); 0: head_dim

    @property
    def value_dim(self) -> int:
        return self.v_head_dim or self.head_dim

    def kwargs(self) -> dict[str, int]:
        return dict(batch=self.batch, seq_len=self.seq_len, num_heads=self.num_heads,
                    num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype_bytes=self.dtype_bytes,
                    v_head_dim=self.value_dim)


@dataclass(frozen=True)
class AttentionTime:
    """Seconds per rank for one attention call: the kernels (``compute_*``), the ring steps' log-sum-exp merges
    and accumulations (``memory_*``, memory-bound); ``ring_*`` are transfer times NOT hidden by either."""

    compute_fwd: float
    compute_bwd: float
    a2a_fwd: float
    a2a_bwd: float
    ring_inner_fwd: float
    ring_outer_fwd: float
    ring_inner_bwd: float
    ring_outer_bwd: float
    memory_fwd: float = 0.0
    memory_bwd: float = 0.0

    @property
    def forward(self) -> float:
        return self.compute_fwd + self.memory_fwd + self.a2a_fwd + self.ring_inner_fwd + self.ring_outer_fwd

    @property
    def backward(self) -> float:
        return self.compute_bwd + self.memory_bwd + self.a2a_bwd + self.ring_inner_bwd + self.ring_outer_bwd

    @property
    def total(self) -> float:
        return self.forward + self.backward


def attention_flops(shape: AttnShape, sp: int) -> float:
    """Forward FLOPs per rank of causal attention: ``B * S^2 * H * (D + Dv) / sp`` (``QK^T`` over ``D``, ``PV`` over
    the values' ``Dv``, both ``D`` but for MLA); with a sliding window ``w < S`` only the visible pairs
    ``w*S - w*(w-1)/2`` (instead of ``S^2/2``) count: ``2 * B * pairs * H * (D + Dv) / sp``."""
    s, w = shape.seq_len, shape.sliding_window
    dims = shape.head_dim + shape.value_dim
    if w is not None and w < s:
        return 4.0 * shape.batch * (w * s - w * (w - 1) / 2) * shape.num_heads * dims / 2 / sp
    return 2.0 * shape.batch * s**2 * shape.num_heads * dims / 2 / sp


class _Link:
    """The transfers of one hop class (inner or outer) on this rank's link, as a fluid: transfers in
    flight share ``bandwidth`` equally. Time only moves forward (posts and waits come in rank order)."""

    def __init__(self, bandwidth: float, latency: float, bytes_factor: float) -> None:
        self.bandwidth, self.latency, self.factor = bandwidth, latency, bytes_factor
        self.now = 0.0
        self.left: dict[int, float] = {}  # transfer -> bytes still to move
        self.arrived: dict[int, float] = {}  # transfer -> time its last byte left
        self.blocked = 0.0  # rank time spent waiting on this link

    def _run(self, until: float | None, transfer: int | None = None) -> None:
        """Move bytes up to time ``until``, or until ``transfer`` has moved all of its bytes."""
        assert until is None or until >= self.now - 1e-9 * max(1.0, self.now), "link time went back"
        while self.left and (transfer is None or transfer in self.left):
            share = self.bandwidth / len(self.left)
            smallest = min(self.left.values())
            finish = self.now + smallest / share
            if transfer is None and finish > until:
                for key in self.left:
                    self.left[key] -= (until - self.now) * share
                break
            self.now = finish
            for key, left in list(self.left.items()):
                if left <= smallest * (1 + 1e-9):
                    del self.left[key]
                    self.arrived[key] = finish
                else:
                    self.left[key] = left - smallest
        if until is not None:
            self.now = max(self.now, until)

    def post(self, now: float, nbytes: float) -> int:
        self._run(now)
        key = len(self.arrived) + len(self.left)
        self.left[key] = nbytes * self.factor
        return key

    def wait(self, now: float, transfer: int) -> float:
        """Rank time after waiting for ``transfer`` (posted at or before ``now``)."""
        if transfer in self.left:
            self._run(None, transfer)
        done = self.arrived[transfer] + self.latency
        self.blocked += max(0.0, done - now)
        return max(now, done)


def simulate_pass(
    steps: tuple[int, int], c: float | dict[tuple[int, int], float], inner: _Link, outer: _Link, kv: int,
    dkv: int | None, trace: list[tuple] | None = None, reach: int | None = None,
) -> float:
    """Rank time of one pass round a double ring of ``n`` inner rings of ``w`` (``steps = (n, w)``): the events of
    :func:`loongtrain.attn.schedule.pass_events` (the ones ``attn/ring.py`` executes), forward when ``dkv is
    None``, else backward with ``dkv`` bytes per dK/dV hop. A post starts a transfer on its hop's link now;
    a compute takes ``c`` (a dict: ``c[outer, inner]`` of the event); a wait blocks until the transfer has
    arrived. ``trace`` (if given) receives ``("post", hop, payload)`` (``(..., -1)`` for a post the other way
    round), ``("compute",)`` and ``("wait", index of the awaited post)`` as simulated. ``reach``: the short
    pass of a short sliding window."""
    links = {"inner": inner, "outer": outer}
    nbytes = {"kv": kv, "dkv": dkv}
    t = 0.0
    in_flight: dict[str, tuple[_Link, int, int]] = {}  # transfer -> (link, link key, post index)
    posts = 0
    for event in pass_events(*steps, dkv is not None, reach):
        if isinstance(event, Post):
            link = links[event.hop]
            in_flight[event.transfer] = (link, link.post(t, nbytes[event.payload]), posts)
            step = ("post", event.hop, event.payload) + ((event.direction,) if event.direction != 1 else ())
            posts += 1
        elif isinstance(event, Compute):
            t += c[event.outer, event.inner] if isinstance(c, dict) else c
            step = ("compute",)
        else:
            link, key, index = in_flight.pop(event.transfer)
            t = link.wait(t, key)
            step = ("wait", index)
        if trace is not None:
            trace.append(step)
    assert not in_flight
    return t


def document_steps(layout: Layout, shape: AttnShape, documents: Documents,
                   window: int | None) -> tuple[dict[tuple[int, int], float], int | None]:
    """Forward FLOPs of every compute step ``(outer, inner)`` of the pass under ``documents`` (its busiest
    member's visible pairs, :func:`~loongtrain.plan.document_work.step_work`, at ``4 H D / hp`` FLOPs a pair),
    and the pass's ``reach`` (:func:`~loongtrain.plan.traffic.ring_reach`, as the ring runs it)."""
    order = documents.order(shape.seq_len, layout.cp, layout.hp, window)
    reach = ring_reach(layout, shape.seq_len, window, zigzag=order is None)
    work = step_work(documents.rows(shape.batch), shape.seq_len, layout.num_inner_rings, layout.inner_ring,
                     chunk_order=order, sliding_window=window, reach=reach)
    per_pair = 4.0 * shape.num_heads * (shape.head_dim + shape.value_dim) / 2 / layout.hp
    return {step: per_pair * pairs for step, pairs in work.items()}, reach


def _pass_compute(layout: Layout, c: float | dict[tuple[int, int], float], reach: int | None) -> float:
    """Compute time of one forward pass: the sum of its compute events' times."""
    events = [e for e in pass_events(layout.num_inner_rings, layout.inner_ring, False, reach) if isinstance(e, Compute)]
    return sum(c[e.outer, e.inner] for e in events) if isinstance(c, dict) else len(events) * c


def attention_time(layout: Layout, shape: AttnShape, cluster: Cluster,
                   documents: Documents | None = None) -> AttentionTime:
    """Forward and backward time of one attention call on ``cluster`` (``gpus_per_node`` ranks per node);
    ``documents``: packed rows and their chunk layout (module docstring). Without documents the result is
    remembered per (layout, shape, cluster): the planner asks once per ZeRO and recompute mode of a layout."""
    if documents is None:
        return _plain_attention_time(layout, shape, cluster)
    return _attention_time(layout, shape, cluster, documents)


@lru_cache(maxsize=8192)
def _plain_attention_time(layout: Layout, shape: AttnShape, cluster: Cluster) -> AttentionTime:
    return _attention_time(layout, shape, cluster, None)


def _attention_time(layout: Layout, shape: AttnShape, cluster: Cluster,
                    documents: Documents | None) -> AttentionTime:
    msg = message_bytes(layout, **shape.kwargs())
    links = link_stats(layout, cluster.gpus_per_node)
    intra_lat, inter_lat = cluster.intra_latency_us * 1e-6, cluster.inter_latency_us * 1e-6

    half = 1.0 if cluster.duplex else 2.0  # a connection carrying both directions, one at a time
    a2a = a2a_seconds(layout, cluster, msg["a2a_qkv"]) + a2a_seconds(layout, cluster, msg["a2a_out"])  # in, back
    window = shape.sliding_window if shape.sliding_window and shape.sliding_window < shape.seq_len else None
    block = shape.batch * shape.seq_len / layout.cp  # a step's query tokens
    # the kernels run on the wider head dim (MLA's values padded to it: attn/kernels.py for_head_dims)
    rate = cluster.attention_rate(max(shape.head_dim, shape.value_dim), block * shape.num_heads / layout.hp)
    he = effective_kv_heads(shape.num_heads, shape.num_kv_heads, layout.hp) // layout.hp
    merge_f, merge_b = (x / cluster.memory_bw for x in ring_step_bytes(
        block, shape.num_heads // layout.hp, he, shape.head_dim, shape.dtype_bytes, layout.cp, shape.value_dim)) \
        if layout.cp > 1 else (0.0, 0.0)
    c: float | dict[tuple[int, int], float]
    if documents is not None:
        flops, reach = document_steps(layout, shape, documents, window)
        kernel = {step: f / rate for step, f in flops.items()}
        # a block none of whose keys a query sees costs no call and no merge (attn/ring_step.py)
        c = {step: x + merge_f * (x > 0) for step, x in kernel.items()}
        c_bwd: float | dict[tuple[int, int], float] = {
            step: BACKWARD_FLOPS_RATIO * x + merge_b * (x > 0) for step, x in kernel.items()}
        compute_fwd = _pass_compute(layout, kernel, reach)
        compute_bwd = BACKWARD_FLOPS_RATIO * compute_fwd
        memory_fwd, memory_bwd = _pass_compute(layout, c, reach) - compute_fwd, _pass_compute(layout, c_bwd, reach) \
            - compute_bwd
    else:
        reach = ring_reach(layout, shape.seq_len, window) if window is not None else None
        # the pass's compute steps share the rank's work (a short window's short pass computes only the blocks
        # within reach; a full pass with a window skips invisible blocks, approximated as evenly lighter steps)
        steps_run = layout.cp if reach is None else sum(isinstance(e, Compute) for e in pass_events(
            layout.num_inner_rings, layout.inner_ring, False, reach))
        kernel_s = attention_flops(shape, layout.sp) / steps_run / rate
        c, c_bwd = kernel_s + merge_f, BACKWARD_FLOPS_RATIO * kernel_s + merge_b
        compute_fwd, compute_bwd = steps_run * kernel_s, steps_run * kernel_s * BACKWARD_FLOPS_RATIO
        memory_fwd, memory_bwd = steps_run * merge_f, steps_run * merge_b
    ring_fwd = ring_bwd = (0.0, 0.0)
    if layout.cp > 1:
        outer_active = layout.num_inner_rings > 1 and links.outer_cross
        in_senders = links.inner_senders + (links.outer_senders if outer_active else 0)
        out_senders = links.outer_senders + (links.inner_senders if links.inner_cross else 0)
        bw_in = cluster.cross_bw(in_senders) if links.inner_cross else cluster.intra_bw
        bw_out = cluster.cross_bw(out_senders) if links.outer_cross else cluster.intra_bw
        lat_in = inter_lat if links.inner_cross else intra_lat
        lat_out = inter_lat if links.outer_cross else intra_lat
        # next and previous peer are one rank: one connection carries both directions
        f_in, f_out = (half if layout.inner_ring == 2 else 1.0), (half if layout.num_inner_rings == 2 else 1.0)
        steps = (layout.num_inner_rings, layout.inner_ring)
        exposed = []
        for compute, dkv in ((c, None), (c_bwd, msg["dkv"])):
            inner, outer = _Link(bw_in, lat_in, f_in), _Link(bw_out, lat_out, f_out)
            simulate_pass(steps, compute, inner, outer, msg["kv"], dkv, reach=reach)
            exposed.append((inner.blocked, outer.blocked))
        ring_fwd, ring_bwd = exposed
    return AttentionTime(
        compute_fwd=compute_fwd, compute_bwd=compute_bwd, memory_fwd=memory_fwd, memory_bwd=memory_bwd,
        a2a_fwd=a2a, a2a_bwd=a2a,
        ring_inner_fwd=ring_fwd[0], ring_outer_fwd=ring_fwd[1],
        ring_inner_bwd=ring_bwd[0], ring_outer_bwd=ring_bwd[1],
    )


def a2a_seconds(layout: Layout, cluster: Cluster, piece: float) -> float:
    """One head-group all-to-all sending ``piece`` bytes to each other head rank: the slower of its peers on the
    node and off it (their links shared by the node's senders), at the cluster's all-to-all efficiency, plus a
    latency; 0 at ``hp = 1``."""
    if layout.hp == 1:
        return 0.0
    links = link_stats(layout, cluster.gpus_per_node)
    half = 1.0 if cluster.duplex else 2.0
    t_in = piece * links.a2a_intra_peers / cluster.intra_bw
    t_out = piece * links.a2a_cross_peers / cluster.cross_bw(links.a2a_senders)
    latency = cluster.inter_latency_us if links.a2a_cross_peers else cluster.intra_latency_us
    return half * max(t_in, t_out) / cluster.a2a_efficiency + latency * 1e-6


def predict_attention_time(layout: Layout, shape: AttnShape, cluster: Cluster,
                           documents: Documents | None = None) -> float:
    """Seconds for one attention call, forward + backward (for comparing with a measured benchmark)."""
    return attention_time(layout, shape, cluster, documents).total
