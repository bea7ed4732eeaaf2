"""Time of one 2D-Attention call (forward + backward) on a cluster: compute, all-to-all, ring overlap.

Per rank, with ``S`` the replica's sequence, ``sp = hp * cp``, ``n = cp / window`` windows:

- compute: forward causal FLOPs ``2 * B * S^2 * H * D / sp`` at ``attention_tflops``; backward 2.5x.
  Under zigzag every ring step does the same work, so a step costs ``c = forward / cp``.
- all-to-all (blocking, on the critical path): per call ``max(intra bytes / intra_bw, cross bytes /
  NIC share) + latency``; bytes from :mod:`loongtrain.parallel.traffic`.
- ring (see ``Ring.visit``): an inner step with a transfer costs ``max(c, X_in)``; a window costs
  ``T_w = (window - 1) * max(c, X_in) + c``; an outer step costs ``max(T_w, X_out)`` (the outer transfer is
  posted at its start and awaited after ``window`` inner steps); the last outer step has no transfer.
  ``X = bytes / bandwidth + latency`` with the bandwidth of the link's class: intra-node, or the NIC
  shared by the node's devices sending across at once. The backward sends K/V plus dK/dV on each hop;
  the dK/dV chain (``_GradChain``) awaits a window's last inner hop after the next block's compute,
  so only the pass's final inner hop (``X_dkv_in`` when ``window > 1``) and final outer hop
  (``X_dkv_out`` when ``n > 1``) are exposed.
  A synchronous ring runs at its slowest hop, so the worst rank's link decides.
- ``cluster.duplex = False`` (gloo over TCP): an all-to-all, and a ring hop whose next and previous
  peer are the same rank (``window == 2`` inner, two windows outer), take twice their transfer time.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from loongtrain.parallel.layout import Layout
from loongtrain.parallel.traffic import message_bytes
from loongtrain.plan.cluster import Cluster

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

    def kwargs(self) -> dict[str, int]:
        return dict(batch=self.batch, seq_len=self.seq_len, num_heads=self.num_heads,
                    num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype_bytes=self.dtype_bytes)


@dataclass(frozen=True)
class LinkStats:
    """Which hops leave the node, and how many devices of the busiest node send across at once."""

    a2a_intra_peers: int  # max over ranks of head-group peers on the same node
    a2a_cross_peers: int  # max over ranks of head-group peers on other nodes
    a2a_senders: int  # max over nodes of devices with a cross-node a2a peer
    inner_cross: bool  # some rank's inner-ring next peer is on another node
    inner_senders: int
    outer_cross: bool
    outer_senders: int


@lru_cache(maxsize=4096)
def link_stats(layout: Layout, ranks_per_node: int) -> LinkStats:
    """Scan every rank of ``layout`` (node of a rank = ``rank // ranks_per_node``)."""
    node = lambda r: r // ranks_per_node
    a2a_in = a2a_out = 0
    senders: dict[str, dict[int, int]] = {"a2a": {}, "inner": {}, "outer": {}}
    for rank in range(layout.world_size):
        d, c, _ = layout.coords(rank)
        peers = [p for p in layout.grid[d][c] if p != rank]
        cross = sum(node(p) != node(rank) for p in peers)
        a2a_in, a2a_out = max(a2a_in, len(peers) - cross), max(a2a_out, cross)
        hops = {"a2a": cross > 0}
        if layout.cp > 1:
            ring = layout.ring_peers(rank)
            hops["inner"] = layout.window > 1 and node(ring["inner_next"]) != node(rank)
            hops["outer"] = layout.num_windows > 1 and node(ring["outer_next"]) != node(rank)
        for kind, is_cross in hops.items():
            if is_cross:
                senders[kind][node(rank)] = senders[kind].get(node(rank), 0) + 1
    most = {kind: max(s.values(), default=0) for kind, s in senders.items()}
    return LinkStats(a2a_in, a2a_out, most["a2a"], most["inner"] > 0, most["inner"],
                     most["outer"] > 0, most["outer"])


@dataclass(frozen=True)
class AttentionTime:
    """Seconds per rank for one attention call; ``ring_*`` are transfer times NOT hidden by compute."""

    compute_fwd: float
    compute_bwd: float
    a2a_fwd: float
    a2a_bwd: float
    ring_inner_fwd: float
    ring_outer_fwd: float
    ring_inner_bwd: float
    ring_outer_bwd: float

    @property
    def forward(self) -> float:
        return self.compute_fwd + self.a2a_fwd + self.ring_inner_fwd + self.ring_outer_fwd

    @property
    def backward(self) -> float:
        return self.compute_bwd + self.a2a_bwd + self.ring_inner_bwd + self.ring_outer_bwd

    @property
    def total(self) -> float:
        return self.forward + self.backward


def attention_flops(shape: AttnShape, sp: int) -> float:
    """Forward FLOPs per rank of causal attention: ``2 * B * S^2 * H * D / sp``."""
    return 2.0 * shape.batch * shape.seq_len**2 * shape.num_heads * shape.head_dim / sp


def _ring_pass(steps: tuple[int, int], c: float, x_in: float, x_out: float) -> tuple[float, float]:
    """(exposed inner, exposed outer) seconds of one pass round a double ring of ``n`` windows of ``w``."""
    n, w = steps
    window_time = (w - 1) * max(c, x_in) + c
    return n * (w - 1) * max(0.0, x_in - c), (n - 1) * max(0.0, x_out - window_time)


def attention_time(layout: Layout, shape: AttnShape, cluster: Cluster) -> AttentionTime:
    """Forward and backward time of one attention call on ``cluster`` (``gpus_per_node`` ranks per node)."""
    msg = message_bytes(layout, **shape.kwargs())
    links = link_stats(layout, cluster.gpus_per_node)
    intra_lat, inter_lat = cluster.intra_latency_us * 1e-6, cluster.inter_latency_us * 1e-6

    half = 1.0 if cluster.duplex else 2.0  # a connection carrying both directions, one at a time

    def a2a_call(piece: int) -> float:
        if layout.hp == 1:
            return 0.0
        t_in = piece * links.a2a_intra_peers / cluster.intra_bw
        t_out = piece * links.a2a_cross_peers / cluster.cross_bw(links.a2a_senders)
        return half * max(t_in, t_out) + (inter_lat if links.a2a_cross_peers else intra_lat)

    a2a = a2a_call(msg["a2a_qkv"]) + a2a_call(msg["a2a_out"])  # per pass: q/k/v in, output back
    c = attention_flops(shape, layout.sp) / layout.cp / (cluster.attention_tflops * 1e12)
    ring_fwd = ring_bwd = (0.0, 0.0)
    if layout.cp > 1:
        outer_active = layout.num_windows > 1 and links.outer_cross
        in_senders = links.inner_senders + (links.outer_senders if outer_active else 0)
        out_senders = links.outer_senders + (links.inner_senders if links.inner_cross else 0)
        bw_in = cluster.cross_bw(in_senders) if links.inner_cross else cluster.intra_bw
        bw_out = cluster.cross_bw(out_senders) if links.outer_cross else cluster.intra_bw
        if layout.window == 2:  # inner next and previous peer are one rank: one connection, both ways
            bw_in /= half
        if layout.num_windows == 2:
            bw_out /= half
        lat_in = inter_lat if links.inner_cross else intra_lat
        lat_out = inter_lat if links.outer_cross else intra_lat
        steps = (layout.num_windows, layout.window)
        kv, both = msg["kv"], msg["kv"] + msg["dkv"]
        ring_fwd = _ring_pass(steps, c, kv / bw_in + lat_in, kv / bw_out + lat_out)
        cb = BACKWARD_FLOPS_RATIO * c
        inner_b, outer_b = _ring_pass(steps, cb, both / bw_in + 2 * lat_in, both / bw_out + 2 * lat_out)
        if layout.window > 1:  # the pass ends waiting for the last window's last dK/dV inner hop
            inner_b += msg["dkv"] / bw_in + lat_in
        if layout.num_windows > 1:  # the result waits for the last dK/dV outer hop
            outer_b += msg["dkv"] / bw_out + lat_out
        ring_bwd = (inner_b, outer_b)
    return AttentionTime(
        compute_fwd=layout.cp * c, compute_bwd=layout.cp * c * BACKWARD_FLOPS_RATIO,
        a2a_fwd=a2a, a2a_bwd=a2a,
        ring_inner_fwd=ring_fwd[0], ring_outer_fwd=ring_fwd[1],
        ring_inner_bwd=ring_bwd[0], ring_outer_bwd=ring_bwd[1],
    )


def predict_attention_time(layout: Layout, shape: AttnShape, cluster: Cluster) -> float:
    """Seconds for one attention call, forward + backward (for comparing with a measured benchmark)."""
    return attention_time(layout, shape, cluster).total
