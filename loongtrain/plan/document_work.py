"""What packed documents leave to each rank, for the planner (docs/planner.md): visible pairs per ring
step counted from the executor's own kernel pieces, imbalance, and a realistic document mix.

The per-token rule (:func:`loongtrain.parallel.documents.visible_keys`, :func:`rank_work`) lives with the
documents; this module counts the same pairs the way the ring's kernel calls cover them.
"""

from __future__ import annotations

import random
from functools import lru_cache

import torch

from loongtrain.attn.masking import AttnMask, member_runs, piece_mask, visible_pieces
from loongtrain.attn.schedule import Compute, pass_events
from loongtrain.parallel.documents import balanced_chunk_order, check_cu_seqlens, rank_work
from loongtrain.parallel.layout import DoubleRing


def pair_work(cu_seqlens: list | None, seq_len: int, cp: int, *, chunk_order: tuple[int, ...] | None = None,
              causal: bool = True, sliding_window: int | None = None) -> tuple[tuple[int, ...], ...]:
    """``work[p][s]``: visible (query, key) pairs of context rank ``p``'s queries against rank ``s``'s keys,
    summed over the batch's rows (``cu_seqlens`` as in :func:`rank_work`): exactly the pairs the ring's kernel
    calls cover, counted from the executor's own pieces (:func:`loongtrain.attn.masking.visible_pieces` of
    :func:`~loongtrain.attn.masking.member_runs`, docs/attention.md#the-ring-schedule), so ``sum(work[p]) ==
    rank_work(...)[p]``.
    The planner charges ring steps with it (docs/planner.md)."""
    rows = [None] if cu_seqlens is None else [tuple(int(x) for x in cu) for cu in cu_seqlens]
    for cu in rows:
        if cu is not None:
            check_cu_seqlens(cu, seq_len)
    counts: dict[tuple[int, ...] | None, int] = {}
    for cu in rows:
        counts[cu] = counts.get(cu, 0) + 1
    return _pair_work(tuple(counts.items()), seq_len, cp, chunk_order, causal, sliding_window)


@lru_cache(maxsize=64)
def _pair_work(rows: tuple[tuple[tuple[int, ...] | None, int], ...], seq_len: int, cp: int,
               chunk_order: tuple[int, ...] | None, causal: bool,
               sliding_window: int | None) -> tuple[tuple[int, ...], ...]:
    mask = AttnMask(causal, sliding_window, chunk_order=chunk_order)
    band = mask.band()
    runs = [member_runs(seq_len, cp, p, chunk_order) for p in range(cp)]

    def pairs(p: int, s: int) -> int:
        return sum(count * sum(piece_pairs(piece, band) for piece in visible_pieces(
            runs[p], runs[s], cu, band, causal, mask.tiny)) for cu, count in rows)

    return tuple(tuple(pairs(p, s) for s in range(cp)) for p in range(cp))


def step_work(cu_seqlens: list | None, seq_len: int, num_inner_rings: int, inner_ring: int, *,
              chunk_order: tuple[int, ...] | None = None, causal: bool = True, sliding_window: int | None = None,
              reach: int | None = None) -> dict[tuple[int, int], int]:
    """Per compute step ``(outer, inner)`` of the ring pass (:func:`loongtrain.attn.schedule.pass_events`,
    ``reach``: the short pass), the visible pairs of its busiest member: member ``p`` holds the block of
    :meth:`~loongtrain.attn.schedule.DoubleRing.source` and computes :func:`pair_work` against it."""
    ring = DoubleRing(num_inner_rings, inner_ring)
    work = pair_work(cu_seqlens, seq_len, ring.size, chunk_order=chunk_order, causal=causal,
                     sliding_window=sliding_window)
    steps = {(e.outer, e.inner) for backward in (False, True)
             for e in pass_events(num_inner_rings, inner_ring, backward, reach) if isinstance(e, Compute)}
    return {(o, t): max(work[p][ring.source(p, o, t)] for p in range(ring.size)) for o, t in steps}


def piece_pairs(piece, band: tuple[int, int]) -> int:
    """Visible (query, key) pairs of one kernel call (:class:`loongtrain.attn.masking.Piece`): all cells of
    a ``full`` piece, the triangle (diagonal included) of a ``causal`` or ``anticausal`` square, the mask's
    count (:func:`~loongtrain.attn.masking.piece_mask`) of a ``masked`` one."""
    if piece.kind == "full":
        return piece.cells
    if piece.kind in ("causal", "anticausal"):
        n = piece.r1 - piece.r0
        return n * (n + 1) // 2
    return int(piece_mask(piece, band, torch.device("cpu")).sum())


def imbalance(work: list[int]) -> float:
    """``max / mean`` of per-rank work (1.0: perfectly balanced)."""
    mean = sum(work) / len(work)
    return max(work) / mean if mean else 1.0


def lognormal_documents(seq_len: int, median: int, sigma: float = 1.0, seed: int = 0) -> list[int]:
    """``cu_seqlens`` of one packed row of documents with lognormal lengths (``median`` tokens, shape
    ``sigma``; at least 1 token each; the last one cut at ``seq_len``): a stated, realistic length mix."""
    if median < 1 or seq_len < 1:
        raise ValueError(f"median={median} and seq_len={seq_len} must be positive")
    rng = random.Random(seed)
    bounds = [0]
    while bounds[-1] < seq_len:
        bounds.append(min(seq_len, bounds[-1] + max(1, round(median * rng.lognormvariate(0.0, sigma)))))
    return bounds


def balance_report(cu_seqlens: list, seq_len: int, cp: int, hp: int = 1, *, causal: bool = True,
                   sliding_window: int | None = None) -> dict[str, float]:
    """Per-rank visible-pair work (max/mean) of a batch under zigzag and under :func:`balanced_chunk_order`,
    and the fraction of causal attention's pairs that remain visible."""
    kw = dict(causal=causal, sliding_window=sliding_window)
    zigzag = rank_work(cu_seqlens, seq_len, cp, **kw)
    order = balanced_chunk_order(cu_seqlens, seq_len, cp, hp, **kw)
    balanced = rank_work(cu_seqlens, seq_len, cp, chunk_order=order, **kw)
    full = len(cu_seqlens) * seq_len * (seq_len + 1) // 2
    return {"zigzag_imbalance": imbalance(zigzag), "balanced_imbalance": imbalance(balanced),
            "visible_fraction": sum(zigzag) / full}
