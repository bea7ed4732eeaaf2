"""Which (query, key) pairs see each other, and the kernel calls that cover exactly those
(docs/attention.md#the-ring-schedule).

Visibility of query ``i`` and key ``j`` (global token positions of the replica's full sequence):

- documents (``cu_seqlens``, flash-attn's convention: ``0 = c_0 < c_1 < ... < c_n = S``): ``i`` and ``j``
  lie in the same document ``[c_d, c_{d+1})``;
- ``causal``: ``j <= i``;
- ``sliding_window = w`` (Mistral's convention): ``i - w < j <= i`` when causal; ``|i - j| < w`` when not.

Inside one document visibility depends only on ``d = j - i``: ``lo <= d <= hi`` (:meth:`AttnMask.band`).

A member's tokens, and a key block's, are lists of *runs* ``(local start, global start, length)``: local
positions ``[l, l + n)`` hold global tokens ``[g, g + n)`` (:func:`member_runs`; zigzag: two runs of
``S / (2 cp)``).
:func:`visible_pieces` covers the visible pairs of a (query runs, key runs) pair exactly once with
:class:`Piece` s, each one kernel call: ``full`` (no mask), ``causal`` (top-left causal square),
``anticausal`` (the mirror image: the causal kernel on both sides reversed) or, only for pieces of at most
``AttnMask.tiny`` cells that no kernel shape fits, ``masked`` (the reference kernel with an explicit mask).
For a kernel that takes FlashAttention's window argument (``windowed``), any other trimmed box of one run each
way is one ``band`` call instead (``Piece.window``: FA2's ``(left, right)``, bottom-right aligned), so a sliding
window over a long run is one call, not ``2 S / w`` pieces. Boxes that do not fit a shape are cut in two
(:func:`_cut`) on an explicit work list, never by recursion: a run of any length is planned.
No piece covers an invisible row or column, so an empty result means: no kernel call, no merge.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from functools import lru_cache

import torch

Run = tuple[int, int, int]  # (local start, global start, length)
UNBOUNDED = 1 << 62
TINY_CELLS = 32 * 32  # default: pieces up to this many (q, k) cells may use the masked reference


@dataclass(frozen=True)
class AttnMask:
    """The attention mask of one call: ``cu_seqlens`` per batch row (``None``: one document), and the
    layout of the tokens (``chunk_order``, :func:`loongtrain.parallel.zigzag.shard_indices`)."""

    causal: bool = True
    sliding_window: int | None = None
    cu_seqlens: tuple[tuple[int, ...], ...] | None = None
    tiny: int = TINY_CELLS
    chunk_order: tuple[int, ...] | None = None  # the sequence layout (None: zigzag)

    def band(self) -> tuple[int, int]:
        """``(lo, hi)``: inside a document, ``j`` is visible from ``i`` iff ``lo <= j - i <= hi``."""
        w = self.sliding_window
        lo = -(w - 1) if w is not None else -UNBOUNDED
        hi = 0 if self.causal else (w - 1 if w is not None else UNBOUNDED)
        return lo, hi

    def row_groups(self, batch: int) -> list[tuple[slice, tuple[int, ...] | None]]:
        """Consecutive batch rows sharing one ``cu_seqlens``: ``[(rows, cu_seqlens or None)]``."""
        if self.cu_seqlens is None:
            return [(slice(None), None)]
        assert len(self.cu_seqlens) == batch, (len(self.cu_seqlens), batch)
        groups: list[tuple[slice, tuple[int, ...] | None]] = []
        start = 0
        for b in range(1, batch + 1):
            if b == batch or self.cu_seqlens[b] != self.cu_seqlens[start]:
                rows = slice(None) if (start, b) == (0, batch) else slice(start, b)
                groups.append((rows, self.cu_seqlens[start]))
                start = b
        return groups


@dataclass(frozen=True)
class Piece:
    """One kernel call: local query rows ``[r0, r1)`` against local key columns ``[c0, c1)``. ``masked`` and
    ``band`` pieces lie in one run each way: ``offset = first key's global - first query's global position``;
    a ``band`` piece's ``window = (left, right)``: local row ``r`` sees columns ``c`` with ``-left <= c - r -
    (cols - rows) <= right`` (FlashAttention's bottom-right aligned window; every bound finite)."""

    r0: int
    r1: int
    c0: int
    c1: int
    kind: str  # "full" | "causal" | "anticausal" | "masked" | "band"
    offset: int = 0
    window: tuple[int, int] | None = None  # "band": FA2's (window_size_left, window_size_right)

    @property
    def cells(self) -> int:
        return (self.r1 - self.r0) * (self.c1 - self.c0)


@lru_cache(maxsize=1024)
def member_runs(seq_len: int, cp: int, position: int, chunk_order: tuple[int, ...] | None = None) -> tuple[Run, ...]:
    """Runs of ring member ``position``'s block: its chunks of ``chunk_order`` (default zigzag: chunks
    ``position`` and ``2 cp - 1 - position``, docs/attention.md#zigzag-sharding), neighbouring chunks merged."""
    order = chunk_order or tuple(x for c in range(cp) for x in (c, 2 * cp - 1 - c))
    chunk, per_rank = seq_len // len(order), len(order) // cp
    runs: list[Run] = []
    for i, c in enumerate(order[position * per_rank : (position + 1) * per_rank]):
        if runs and runs[-1][1] + runs[-1][2] == c * chunk:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + chunk)
        else:
            runs.append((i * chunk, c * chunk, chunk))
    return tuple(runs)


def _by_document(runs: tuple[Run, ...], bounds: tuple[int, ...]) -> dict[int, list[Run]]:
    """Document index -> the parts of ``runs`` inside it (in local order)."""
    out: dict[int, list[Run]] = {}
    for local, start, length in runs:
        pos, end = start, start + length
        d = bisect.bisect_right(bounds, pos) - 1
        while pos < end:
            stop = min(end, bounds[d + 1])
            out.setdefault(d, []).append((local + pos - start, pos, stop - pos))
            pos, d = stop, d + 1
    return out


@lru_cache(maxsize=4096)
def visible_pieces(
    q_runs: tuple[Run, ...], k_runs: tuple[Run, ...], cu_seqlens: tuple[int, ...] | None,
    band: tuple[int, int], causal: bool, tiny: int, windowed: bool = False,
) -> tuple[Piece, ...]:
    """Pieces covering exactly the visible (query, key) pairs of ``q_runs`` x ``k_runs`` (module docstring);
    ``windowed``: the kernel takes FlashAttention's window argument (``band`` pieces)."""
    if cu_seqlens is None:
        total = max(g + n for _, g, n in q_runs + k_runs)
        cu_seqlens = (0, total)
    q_docs, k_docs = _by_document(q_runs, cu_seqlens), _by_document(k_runs, cu_seqlens)
    pieces: list[Piece] = []
    for d in sorted(q_docs.keys() & k_docs.keys()):
        pieces += _split(tuple(q_docs[d]), tuple(k_docs[d]), band, causal, tiny, windowed)
    return tuple(pieces)


def _contiguous_kind(q: Run, k: Run, band: tuple[int, int]) -> str:
    """``empty``, ``full`` or ``mixed`` for one run each way (one document)."""
    lo, hi = band
    d_min, d_max = k[1] - (q[1] + q[2] - 1), (k[1] + k[2] - 1) - q[1]
    if d_max < lo or d_min > hi:
        return "empty"
    return "full" if lo <= d_min and d_max <= hi else "mixed"


def _span(runs: tuple[Run, ...]) -> tuple[int, int]:
    return runs[0][0], runs[-1][0] + runs[-1][2]


def _local_contiguous(runs: tuple[Run, ...]) -> bool:
    return all(a[0] + a[2] == b[0] for a, b in zip(runs, runs[1:]))


def _split(q_runs: tuple[Run, ...], k_runs: tuple[Run, ...], band: tuple[int, int], causal: bool,
           tiny: int, windowed: bool) -> list[Piece]:
    """Pieces for runs of one document (recursing once per run: a member has a few)."""
    if len(q_runs) == 1 and len(k_runs) == 1:
        return _contiguous(q_runs[0], k_runs[0], band, tiny, windowed)
    kinds = {_contiguous_kind(q, k, band) for q in q_runs for k in k_runs}
    if kinds == {"empty"}:
        return []
    if _local_contiguous(q_runs) and _local_contiguous(k_runs):
        (r0, r1), (c0, c1) = _span(q_runs), _span(k_runs)
        if kinds == {"full"}:
            return [Piece(r0, r1, c0, c1, "full")]
        globals_q = [(g, n) for _, g, n in q_runs]
        extent = q_runs[-1][1] + q_runs[-1][2] - q_runs[0][1]
        if causal and globals_q == [(g, n) for _, g, n in k_runs] and extent - 1 <= -band[0]:
            return [Piece(r0, r1, c0, c1, "causal")]  # same tokens both ways, in the same order
    by_rows = ([p for q in q_runs for p in _split((q,), k_runs, band, causal, tiny, windowed)]
               if len(q_runs) > 1 else None)
    by_cols = ([p for k in k_runs for p in _split(q_runs, (k,), band, causal, tiny, windowed)]
               if len(k_runs) > 1 else None)
    options = [o for o in (by_rows, by_cols) if o is not None]
    return min(options, key=len)


Box = tuple[int, int, int, int]  # global rows [i0, i1) x columns [j0, j1)


def _trim(box: Box, lo: int, hi: int) -> Box | None:
    """The smallest box holding every visible pair of ``box`` (``None``: nothing visible). Rows ``i`` see
    columns ``[i + lo, i + hi]``."""
    i0, i1, j0, j1 = box
    i0, i1 = max(i0, j0 - hi), min(i1, j1 - lo)  # rows with a visible column
    if i0 >= i1:
        return None
    j0, j1 = max(j0, i0 + lo), min(j1, i1 + hi)  # columns some kept row sees
    return (i0, i1, j0, j1) if j0 < j1 else None


def _kind(box: Box, lo: int, hi: int) -> str:
    """``full``, ``causal`` (top-left square), ``anticausal`` (its mirror image) or ``mixed``, for a trimmed box."""
    i0, i1, j0, j1 = box
    d_min, d_max = j0 - (i1 - 1), (j1 - 1) - i0
    if lo <= d_min and d_max <= hi:
        return "full"
    if i1 - i0 == j1 - j0 and j0 - i0 == hi and d_min >= lo:
        return "causal"
    if i1 - i0 == j1 - j0 and j0 - i0 == lo and d_max <= hi:
        return "anticausal"
    return "mixed"


def _contiguous(q: Run, k: Run, band: tuple[int, int], tiny: int, windowed: bool) -> list[Piece]:
    """Pieces for one query run and one key run of one document."""
    lo, hi = band
    box = _trim((q[1], q[1] + q[2], k[1], k[1] + k[2]), lo, hi)
    if box is None:
        return []
    return _pieces(box, lo, hi, tiny, q[0] - q[1], k[0] - k[1], windowed)


def _pieces(box: Box, lo: int, hi: int, tiny: int, row_shift: int, col_shift: int, windowed: bool) -> list[Piece]:
    """A trimmed box as kernel-shaped pieces (local = global + shift), in order: each box on the work list is
    its own shape, a band call (``windowed``), a tiny masked piece, or the two sides of :func:`_cut` (pushed
    back, the first on top: no recursion, so a long run with a narrow window plans in ``2 S / w`` iterations)."""
    out: list[Piece] = []
    work = [box]
    while work:
        i0, i1, j0, j1 = box = work.pop()
        kind = _kind(box, lo, hi)
        window = None
        if windowed and kind != "full" and (kind != "causal" or lo > -UNBOUNDED):  # a window: one class of calls
            window = _band_window(box, lo, hi)
            kind = "band" if window is not None else "mixed"
        if kind == "mixed" and (i1 - i0) * (j1 - j0) <= tiny:
            kind = "masked"
        if kind != "mixed":
            out.append(Piece(i0 + row_shift, i1 + row_shift, j0 + col_shift, j1 + col_shift, kind, j0 - i0, window))
            continue
        sides = [t for t in (_trim(side, lo, hi) for side in _cut(box, lo, hi)) if t is not None]
        work.extend(reversed(sides))
    return out


def _band_window(box: Box, lo: int, hi: int) -> tuple[int, int] | None:
    """FA2's ``(window_size_left, window_size_right)`` of a trimmed box (bottom-right aligned: row ``r`` sees
    ``-left <= c - r - (cols - rows) <= right``; ``-1``: unbounded), or None where the kernel's own reading
    could change its meaning: FlashAttention replaces a bound at or past the key length by "unbounded" or by the
    key length itself, both harmless for ``left`` (it never binds there), and for ``right`` only while no
    right bound of at least the key length binds (``rows <= cols + 1``: the first row sees the last key)."""
    i0, i1, j0, j1 = box
    rows, cols = i1 - i0, j1 - j0
    left = -1 if lo <= -UNBOUNDED else j1 - i1 - lo  # >= 0 for a trimmed box
    right = -1 if hi >= UNBOUNDED else hi - j1 + i1
    if (right < 0 or right >= cols) and rows > cols + 1:
        return None
    return left, right


def _cut(box: Box, lo: int, hi: int) -> tuple[Box, Box]:
    """Cut a mixed box in two. Candidates: rows in blocks of a narrow band's width (``hi - lo + 1``),
    where the band's edges meet the box's corners (rows ``j0 - lo + 1``, ``j1 - 1 - hi``; columns
    ``i0 + hi + 1``, ``i1 + lo``), and halves; the cut whose kernel-shaped sides cover the most pairs wins
    (so a causal or mirrored square, or a full block, comes off whole), ties to the more even cut."""
    i0, i1, j0, j1 = box
    rows, cols, width = i1 - i0, j1 - j0, hi - lo + 1
    row_cuts = {j0 - lo + 1, j1 - 1 - hi, i0 + rows // 2}
    if width < rows:
        row_cuts.add(i0 + width * max(1, rows // 2 // width))
    col_cuts = {i0 + hi + 1, i1 + lo, j0 + cols // 2}
    options = [((i0, r, j0, j1), (r, i1, j0, j1)) for r in row_cuts if i0 < r < i1]
    options += [((i0, i1, j0, c), (i0, i1, c, j1)) for c in col_cuts if j0 < c < j1]

    def score(option: tuple[Box, Box]) -> tuple[int, int]:
        covered = 0
        for side in option:
            t = _trim(side, lo, hi)
            if t is not None and _kind(t, lo, hi) != "mixed":
                covered += (t[1] - t[0]) * (t[3] - t[2])
        a, b = option
        return covered, -abs((a[1] - a[0]) * (a[3] - a[2]) - (b[1] - b[0]) * (b[3] - b[2]))

    return max(sorted(options), key=score)


def piece_mask(piece: Piece, band: tuple[int, int], device: torch.device) -> torch.Tensor:
    """``[rows, cols]`` bool visibility of a ``masked`` piece."""
    rows = torch.arange(piece.r1 - piece.r0, device=device)
    cols = torch.arange(piece.c1 - piece.c0, device=device)
    d = cols[None, :] - rows[:, None] + piece.offset
    return (d >= band[0]) & (d <= band[1])


def dense_mask(seq_len: int, mask: AttnMask, row: int = 0) -> torch.Tensor:
    """``[S, S]`` bool visibility of batch row ``row`` over global positions (a reference for tests and tools)."""
    i = torch.arange(seq_len)
    doc = torch.zeros(seq_len, dtype=torch.long)
    if mask.cu_seqlens is not None:
        doc = torch.bucketize(i, torch.tensor(mask.cu_seqlens[row][1:-1]), right=True)
    lo, hi = mask.band()
    d = i[None, :] - i[:, None]
    return (doc[:, None] == doc[None, :]) & (d >= max(lo, -seq_len)) & (d <= min(hi, seq_len))


def flatten_cu_seqlens(rows: tuple[tuple[int, ...], ...] | None) -> list[int]:
    """Per-row ``cu_seqlens`` as one int list (rows concatenated; each starts with 0), for custom-op schemas."""
    return [] if rows is None else [x for row in rows for x in row]


def unflatten_cu_seqlens(flat: list[int]) -> tuple[tuple[int, ...], ...] | None:
    """Inverse of :func:`flatten_cu_seqlens`."""
    if not flat:
        return None
    rows: list[list[int]] = []
    for x in flat:
        if x == 0:
            rows.append([])
        rows[-1].append(x)
    return tuple(tuple(r) for r in rows)
