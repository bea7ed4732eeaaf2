"""Exact per-rank communication of one 2D-Attention layer, as the code sends it.

Notation: ``B`` batch, ``S`` the replica's full sequence length, ``H`` query heads, ``Hkv`` KV heads,
``D`` head dim (of queries and keys), ``Dv`` the values' (MLA: smaller; else ``D``), ``b`` bytes per element of the
input dtype, ``sp = hp * cp``.
``He = Hkv`` when ``hp <= Hkv`` else ``hp`` (KV heads replicated to one per head rank before the
all-to-all: :func:`loongtrain.parallel.config.effective_kv_heads`); after it each rank holds
``Hkv' = He / hp`` KV heads.

- ``a2a`` (head all-to-all, only when ``hp > 1``): forward sends q, k, v packed in ONE all-to-all, then the
  output in another; backward repeats both (grad of out, packed grad of q, k, v). Each call sends
  ``1/hp`` of the local tensor to each of the ``hp - 1`` other head ranks, so per peer::

      qkv piece = B * (S/sp) * ((H + He) * D + He * Dv) * b / hp        out piece = B * (S/sp) * H * Dv * b / hp

- ``kv`` (ring, only when ``cp > 1``): a block, K ``[B, Hkv', S/cp, D]`` then V ``[B, Hkv', S/cp, Dv]``, of
  ``B*Hkv'*(S/cp)*(D + Dv)*b`` bytes.
  The forward sends ``cp - 1`` blocks: ``inner_ring - 1`` to the inner-next peer per outer step
  (``num_inner_rings * (inner_ring - 1)`` in all) and ``num_inner_rings - 1`` to the outer-next peer; the backward
  re-circulates the same ``cp - 1`` blocks.
- ``dkv`` (backward only): ``cp - 1`` dK/dV partial sums of the same shape in the accumulation dtype
  (``max(4, b)`` bytes: fp32 for fp16/bf16/fp32, fp64 for fp64), same peers as ``kv``.
- a sliding window ``w`` with ``r = ceil((w - 1) / (S / 2cp))`` whose short pass sends fewer than ``cp - 1``
  blocks (:func:`ring_reach`): per pass the K/V hops of its route,
  :func:`loongtrain.attn.schedule.short_sends` (a single ring: ``r`` to each ring neighbour; ``n = 4, w = 2``
  or ``n = 2, w = 4`` with ``r = 1``: 5), and backward as many dK/dV partials along the same links the
  opposite way.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from loongtrain.attn.short_pass import pass_reach, short_hops, short_sends
from loongtrain.parallel.config import effective_kv_heads
from loongtrain.parallel.layout import DoubleRing, Layout
from loongtrain.parallel.zigzag import check_sequence_length

KINDS = ("a2a", "kv", "dkv")


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
    """Every rank of ``layout`` at once (node of a rank = ``rank // ranks_per_node``), as tensors over the
    ``[dp, cp, hp]`` rank grid: each rank's head-group peers on its node and off it, and whether its inner- and
    outer-ring next peer (:class:`~loongtrain.parallel.layout.DoubleRing`) is on another node; the senders of
    a node are counted by node. The ranks' roles and nodes repeat every ``lcm(sp, ranks_per_node)`` ranks
    (replicas are contiguous), so a larger world is scanned over one such period: the same maxima, in time
    bounded by the sp group, not by ``dp`` (tests/unit/test_traffic.py checks it against a scan rank by rank)."""
    period = math.lcm(layout.sp, ranks_per_node)
    if layout.world_size > period:
        return link_stats(dataclasses.replace(layout, world_size=period), ranks_per_node)
    nodes = torch.tensor(layout.grid, dtype=torch.int64) // ranks_per_node  # [dp, cp, hp]
    here = (nodes[..., :, None] == nodes[..., None, :]).sum(-1) - 1  # head-group peers on the rank's node
    cross = layout.hp - 1 - here
    flat = nodes.flatten()

    def busiest(crossing: torch.Tensor) -> int:  # the most ranks of one node whose hop leaves the node
        chosen = flat[crossing.flatten()]
        return int(torch.bincount(chosen).max()) if chosen.numel() else 0

    most = {"a2a": busiest(cross > 0), "inner": 0, "outer": 0}
    ring = DoubleRing(layout.num_inner_rings, layout.inner_ring)
    for hop, size in (("inner", layout.inner_ring), ("outer", layout.num_inner_rings)):
        if layout.cp > 1 and size > 1:
            nxt = torch.tensor([ring.peer(c, hop, 1) for c in range(layout.cp)])
            most[hop] = busiest(nodes[:, nxt, :] != nodes)
    return LinkStats(int(here.max()), int(cross.max()), most["a2a"], most["inner"] > 0, most["inner"],
                     most["outer"] > 0, most["outer"])


def acc_bytes(dtype_bytes: int) -> int:
    """Bytes per element of the ring's fp32/fp64 accumulators (dK/dV on the wire)."""
    return max(4, dtype_bytes)


def message_bytes(
    layout: Layout, *, batch: int, seq_len: int, num_heads: int, num_kv_heads: int, head_dim: int,
    dtype_bytes: int, v_head_dim: int | None = None,
) -> dict[str, int]:
    """Bytes of one message of each kind: ``a2a_qkv`` / ``a2a_out`` (per peer per call), ``kv``, ``dkv``;
    ``v_head_dim``: the values' head dim when it is not ``head_dim`` (MLA)."""
    hp, cp, sp = layout.hp, layout.cp, layout.sp
    he = effective_kv_heads(num_heads, num_kv_heads, hp)
    check_sequence_length(seq_len, hp, cp)
    dv = v_head_dim or head_dim
    local = batch * (seq_len // sp)  # tokens of the local shard
    block = (he // hp) * batch * (seq_len // cp) * (head_dim + dv)
    return {
        "a2a_qkv": local * ((num_heads + he) * head_dim + he * dv) // hp * dtype_bytes,
        "a2a_out": local * num_heads * dv // hp * dtype_bytes,
        "kv": block * dtype_bytes,
        "dkv": block * acc_bytes(dtype_bytes),
    }


def _add(d: dict[int, int], peer: int, nbytes: int) -> None:
    d[peer] = d.get(peer, 0) + nbytes


def attention_traffic(layout: Layout, rank: int, *, backward: bool = True, sliding_window: int | None = None,
                      **shape: int) -> dict[str, dict[int, int]]:
    """kind (``a2a``, ``kv``, ``dkv``; all keys always present) -> {peer global rank: bytes ``rank`` sends}
    for one attention call (forward, plus backward when ``backward``) of ``shape`` (:func:`message_bytes`'s
    ``batch``, ``seq_len``, ``num_heads``, ``num_kv_heads``, ``head_dim``, ``dtype_bytes``, ``v_head_dim``);
    ``sliding_window``: see :func:`ring_reach`."""
    msg = message_bytes(layout, **shape)
    seq_len = shape["seq_len"]
    out: dict[str, dict[int, int]] = {kind: {} for kind in KINDS}
    passes = 2 if backward else 1
    d, c, _ = layout.coords(rank)
    if layout.hp > 1:
        for peer in layout.grid[d][c]:
            if peer != rank:
                _add(out["a2a"], peer, passes * (msg["a2a_qkv"] + msg["a2a_out"]))
    if layout.cp > 1:
        peers = layout.ring_peers(rank)
        n, w = layout.num_inner_rings, layout.inner_ring
        reach = ring_reach(layout, seq_len, sliding_window)
        if reach is None:
            per_pass = [(peers["inner_next"], n * (w - 1)), (peers["outer_next"], n - 1)]
        else:  # the short pass: K/V along its route, dK/dV partials back the opposite way
            sends = short_sends(DoubleRing(n, w), reach)
            per_pass = [(peers[f"{hop}_{'next' if d == 1 else 'prev'}"], count) for (hop, d), count in sends.items()]
            grads = [(peers[f"{hop}_{'prev' if d == 1 else 'next'}"], count) for (hop, d), count in sends.items()]
        for peer, count in per_pass:
            if count:
                _add(out["kv"], peer, passes * count * msg["kv"])
        for peer, count in per_pass if reach is None else grads:
            if count and backward:
                _add(out["dkv"], peer, count * msg["dkv"])
    return out


def ring_reach(layout: Layout, seq_len: int, sliding_window: int | None, zigzag: bool = True) -> int | None:
    """``r`` when a sliding window this short runs the short ring pass (:func:`loongtrain.attn.schedule.pass_reach`):
    then a pass sends the blocks of :func:`loongtrain.attn.schedule.short_sends` (fewer than ``cp - 1``;
    backward: as many dK/dV partials back); else ``None``."""
    if layout.cp == 1:
        return None
    return pass_reach(DoubleRing(layout.num_inner_rings, layout.inner_ring), seq_len // (2 * layout.cp), sliding_window,
                      zigzag)


def attention_ops(layout: Layout, *, backward: bool = True, seq_len: int = 0,
                  sliding_window: int | None = None) -> dict[str, int]:
    """Communication calls per rank per attention call: a2a ``2`` (+2 backward) when ``hp > 1``;
    kv ``cp - 1`` (+ ``cp - 1`` backward); dkv ``cp - 1`` (backward only); with a short sliding window
    (:func:`ring_reach` ``r``) the short pass's hop count (``2 r`` on a single ring) instead of ``cp - 1``."""
    passes = 2 if backward else 1
    reach = ring_reach(layout, seq_len, sliding_window) if sliding_window is not None else None
    ring = layout.cp - 1 if reach is None else short_hops(DoubleRing(layout.num_inner_rings, layout.inner_ring), reach)
    return {
        "a2a": 2 * passes if layout.hp > 1 else 0,
        "kv": passes * ring,
        "dkv": ring if backward else 0,
    }


def split_by_node(peer_bytes: dict[int, int], rank: int, ranks_per_node: int) -> tuple[int, int]:
    """``(intra_bytes, cross_bytes)``: bytes to peers on ``rank``'s node (``rank // ranks_per_node``) and
    to other nodes."""
    if ranks_per_node < 1:
        raise ValueError(f"ranks_per_node={ranks_per_node} must be a positive integer")
    node = rank // ranks_per_node
    intra = sum(n for peer, n in peer_bytes.items() if peer // ranks_per_node == node)
    return intra, sum(peer_bytes.values()) - intra


def traffic_report(layout: Layout, ranks_per_node: int, backward: bool = True, **shape: int) -> list[dict]:
    """One row per global rank: ``{"rank", "node", "<kind>_intra", "<kind>_cross", "intra", "cross"}``
    in bytes. ``shape``: batch, seq_len, num_heads, num_kv_heads, head_dim, dtype_bytes."""
    rows = []
    for rank in range(layout.world_size):
        row: dict = {"rank": rank, "node": rank // ranks_per_node, "intra": 0, "cross": 0}
        for kind, peers in attention_traffic(layout, rank, backward=backward, **shape).items():
            intra, cross = split_by_node(peers, rank, ranks_per_node)
            row[f"{kind}_intra"], row[f"{kind}_cross"] = intra, cross
            row["intra"] += intra
            row["cross"] += cross
        rows.append(row)
    return rows


def format_traffic_report(rows: list[dict], unit: float = 2**20, unit_name: str = "MiB") -> str:
    """A fixed-width table of :func:`traffic_report` rows (bytes shown in ``unit_name``)."""
    cols = ["rank", "node"] + [f"{k}_{w}" for k in KINDS for w in ("intra", "cross")] + ["intra", "cross"]
    lines = ["  ".join(f"{c:>10s}" for c in cols)]
    for row in rows:
        cells = [f"{row['rank']:>10d}", f"{row['node']:>10d}"]
        cells += [f"{row[c] / unit:>10.2f}" for c in cols[2:]]
        lines.append("  ".join(cells))
    return "\n".join(lines) + f"\n(bytes sent per rank, in {unit_name})"
