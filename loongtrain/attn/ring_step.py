"""The math of one ring step: the kernel calls covering what a member's queries see of one K/V block, and
the log-sum-exp merge (docs/attention.md).

:class:`Pieces` lists a step's visible pieces (:func:`~loongtrain.attn.masking.visible_pieces`, per group
of batch rows); :func:`plan_step` turns them into kernel calls. Each piece is one dense call, except with a
kernel that has a variable-length op (``Kernel.varlen_forward``): then the step's ``full`` pieces go into
one varlen call and its ``causal`` and ``anticausal`` pieces (rows and columns packed in reversed order: a
causal square) into another, each once it has two or more pieces (a single piece stays dense: no packing
cost; one op call takes one causal flag). Where the op aligns causal masks bottom-right (FA2's), a full piece
of one query row (a length-1 document) joins the causal call (:func:`varlen_flag`). Every (batch row, piece) is one
packed sequence; ``masked`` pieces stay reference calls.

Forward (:class:`ForwardStep`): partial results are merged into fp32 (fp64 for fp64 inputs) accumulators
by log-sum-exp; a varlen call's rows are merged in *rounds* whose (batch row, query) sets are disjoint,
one gather and one scatter each. Backward (:class:`BackwardStep`): dQ and the block's dK/dV contribution
are sums, so a varlen call's gradients are added back with accumulating ``index_put_`` (pieces may share
rows or columns). A block with no visible pair costs no call and no merge.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate

import torch

from loongtrain.attn.kernels import Kernel, Seqlens, VarlenMask, reference_backward, reference_forward
from loongtrain.attn.masking import AttnMask, Piece, member_runs, piece_mask, visible_pieces
from loongtrain.attn.sinks import fold_sinks
from loongtrain.parallel.runtime import to_device

Tensor = torch.Tensor
Item = tuple[slice, Piece]  # (batch rows, piece)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulator dtype of the merge: fp64 for fp64 inputs, else fp32 (docs/attention.md#the-ring-schedule)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class KVBlock:
    """The layout of a ring block: K ``[B, Hkv, S_c, D]`` then V ``[B, Hkv, S_c, Dv]``, each contiguous, in one
    flat buffer: what travels round the ring and, in the accumulators' dtype, a block's dK/dV. V's head dim may
    differ from K's (MLA), so the ring sends exactly ``B Hkv S_c (D + Dv)`` elements (docs/attention.md)."""

    k_shape: tuple[int, ...]
    v_shape: tuple[int, ...]

    @classmethod
    def of(cls, k: Tensor, v: Tensor) -> KVBlock:
        return cls(tuple(k.shape), tuple(v.shape))

    @classmethod
    def holding(cls, block: Tensor, q: Tensor, v_head_dim: int) -> KVBlock:
        """The layout of ``block`` against queries ``q [B, H, S_c, D]``: its K/V heads from its size."""
        b, _, s, d = q.shape
        kv_heads = block.numel() // (b * s * (d + v_head_dim))
        return cls((b, kv_heads, s, d), (b, kv_heads, s, v_head_dim))

    @property
    def k_numel(self) -> int:
        return self.k_shape[0] * self.k_shape[1] * self.k_shape[2] * self.k_shape[3]

    @property
    def numel(self) -> int:
        return self.k_numel + self.v_shape[0] * self.v_shape[1] * self.v_shape[2] * self.v_shape[3]

    def pack(self, k: Tensor, v: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """A new block holding ``k`` and ``v`` (in ``dtype``, default k's)."""
        block = k.new_empty(self.numel, dtype=dtype or k.dtype)
        key, value = self.split(block)
        key.copy_(k)
        value.copy_(v)
        return block

    def zeros(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.zeros(self.numel, dtype=dtype, device=device)

    def split(self, block: Tensor) -> tuple[Tensor, Tensor]:
        """Views of the K and V parts of ``block``."""
        return block[:self.k_numel].view(self.k_shape), block[self.k_numel:].view(self.v_shape)


def merge(out_acc: Tensor, lse_acc: Tensor, out_blk: Tensor, lse_blk: Tensor) -> None:
    """In place: combine two partial softmax results by their log-sum-exp, in the accumulators' dtype."""
    lse_blk = lse_blk.to(lse_acc.dtype)
    new_lse = torch.logaddexp(lse_acc, lse_blk)
    out_acc.mul_(torch.exp(lse_acc - new_lse).unsqueeze(-1))
    out_acc.add_(out_blk.to(out_acc.dtype) * torch.exp(lse_blk - new_lse).unsqueeze(-1))
    lse_acc.copy_(new_lse)


@dataclass(frozen=True)
class PieceCalls:
    """Pieces as dense calls of ``kernel`` with softmax ``scale`` (rows and columns already cut out); a ``masked``
    piece as the reference kernel on its explicit mask, which ``band`` (:meth:`AttnMask.band`) gives."""

    kernel: Kernel
    scale: float
    band: tuple[int, int]

    def forward(self, piece: Piece, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """(out, lse) of one piece."""
        kernel, scale = self.kernel, self.scale
        if piece.kind in ("full", "causal"):
            return kernel.forward(q, k, v, piece.kind == "causal", scale)
        if piece.kind == "band":  # a windowed kernel's own window argument
            return kernel.forward(q, k, v, False, scale, window=piece.window)
        if piece.kind == "anticausal":  # reversed on both sides, it is the top-left causal square
            out, lse = kernel.forward(q.flip(2), k.flip(2), v.flip(2), True, scale)
            return out.flip(2), lse.flip(-1)
        acc = acc_dtype(q.dtype)
        mask = piece_mask(piece, self.band, q.device)
        return reference_forward(q.to(acc), k.to(acc), v.to(acc), False, scale, mask)

    def backward(self, piece: Piece, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                 lse: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """dq, dk, dv of one piece, given the rows' final out and lse."""
        kernel, scale = self.kernel, self.scale
        if piece.kind in ("full", "causal"):
            return kernel.backward(dout, q, k, v, out, lse, piece.kind == "causal", scale)
        if piece.kind == "band":
            return kernel.backward(dout, q, k, v, out, lse, False, scale, window=piece.window)
        if piece.kind == "anticausal":
            dq, dk, dv = kernel.backward(dout.flip(2), q.flip(2), k.flip(2), v.flip(2), out.flip(2), lse.flip(-1),
                                         True, scale)
            return dq.flip(2), dk.flip(2), dv.flip(2)
        acc = acc_dtype(q.dtype)
        mask = piece_mask(piece, self.band, q.device)
        return reference_backward(*(t.to(acc) for t in (dout, q, k, v, out, lse)), False, scale, mask)


class Pieces:
    """What a member computes against each source's block: per group of batch rows, the
    :func:`~loongtrain.attn.masking.visible_pieces` of its runs (zigzag, or ``mask.chunk_order``) against
    the source's."""

    def __init__(self, mask: AttnMask, batch: int, block_len: int, cp: int, position: int,
                 windowed: bool = False) -> None:
        self.mask, self.band, self.cp, self.seq_len = mask, mask.band(), cp, block_len * cp
        self.groups = mask.row_groups(batch)
        self.q_runs = member_runs(self.seq_len, cp, position, mask.chunk_order)
        self.windowed = windowed

    def __call__(self, src: int) -> list[Item]:
        k_runs = member_runs(self.seq_len, self.cp, src, self.mask.chunk_order)
        return [(rows, piece) for rows, cu in self.groups
                for piece in visible_pieces(self.q_runs, k_runs, cu, self.band, self.mask.causal, self.mask.tiny,
                                            self.windowed)]


class StepPlans:
    """The pieces and kernel-call plans (:func:`plan_step`) of one member's steps against each source, for one
    mask, each computed on first use: every layer of a step shares them (:func:`step_plans`)."""

    def __init__(self, mask: AttnMask, batch: int, block_len: int, cp: int, position: int, device: torch.device,
                 varlen: bool, bottom_right: bool, windowed: bool = False) -> None:
        self.band, self.batch, self.device = mask.band(), batch, device
        self.varlen, self.bottom_right = varlen, bottom_right
        self._pieces = Pieces(mask, batch, block_len, cp, position, windowed)
        self._items: dict[int, list[Item]] = {}
        self._plans: dict[int, StepPlan] = {}

    def items(self, src: int) -> list[Item]:
        if src not in self._items:
            self._items[src] = self._pieces(src)
        return self._items[src]

    def __call__(self, src: int) -> StepPlan:
        if src not in self._plans:
            self._plans[src] = plan_step(self.items(src), self.batch, self.device, self.varlen, self.bottom_right)
        return self._plans[src]


_PLANS: dict[tuple, tuple[AttnMask, StepPlans]] = {}  # the current mask's plans (docs/kernels.md#host-work)


def step_plans(mask: AttnMask, batch: int, block_len: int, cp: int, position: int, device: torch.device,
               varlen: bool, bottom_right: bool, windowed: bool = False) -> StepPlans:
    """The :class:`StepPlans` of these calls, shared while ``mask`` is the same object (the ops give every layer
    of a step the same one: loongtrain/parallel/step_memo.py); a new mask forgets the old one's. ``windowed``:
    the kernel takes FlashAttention's window argument (``band`` pieces)."""
    key = (id(mask), batch, block_len, cp, position, device, varlen, bottom_right, windowed)
    hit = _PLANS.get(key)
    if hit is not None and hit[0] is mask:
        return hit[1]
    if len(_PLANS) > 64 or any(held is not mask for held, _ in _PLANS.values()):
        _PLANS.clear()
    plans = StepPlans(mask, batch, block_len, cp, position, device, varlen, bottom_right, windowed)
    _PLANS[key] = (mask, plans)
    return plans


def whole_piece(items: Sequence[Item], length: int) -> Piece | None:
    """The step's only piece when it is one full or causal call over every batch row and all ``length`` local
    positions both ways (a ring of one member, one document, no sliding window): its kernel result is the answer as
    it is, so the step needs no accumulator (docs/memory.md, "cp = 1")."""
    if len(items) != 1:
        return None
    rows, piece = items[0]
    whole = rows == slice(None) and (piece.r0, piece.r1, piece.c0, piece.c1) == (0, length, 0, length)
    return piece if whole and piece.kind in ("full", "causal", "band") else None


# ---------------------------------------------------------------- packing pieces into varlen calls


@dataclass(frozen=True)
class VarlenCall:
    """One variable-length kernel call: packed query row ``i`` is local row ``q_pos[i]`` of batch row
    ``q_row[i]`` (keys likewise); sequences ``cu_q`` / ``cu_k`` (int32); the forward merges packed rows
    ``[a, b)`` of each of ``rounds`` at once (no (batch row, query) twice in a round). ``window``: the band
    pieces' FA2 window (one per call); ``natural``: the packed rows are every (batch row, position) in order,
    queries and keys alike (the whole step in one call: its results are the step's, no gather, no merge)."""

    causal: bool
    q_row: Tensor
    q_pos: Tensor
    k_row: Tensor
    k_pos: Tensor
    cu_q: Tensor
    cu_k: Tensor
    max_q: int
    max_k: int
    rounds: tuple[tuple[int, int], ...]
    window: tuple[int, int] | None = None
    natural: bool = False

    @property
    def seqlens(self) -> Seqlens:
        return Seqlens(self.cu_q, self.cu_k, self.max_q, self.max_k)

    def mask(self, scale: float) -> VarlenMask:
        """The kernel call's mask: this call's causal flag and window, softmax ``scale``."""
        return VarlenMask(self.causal, scale, self.window)


@dataclass(frozen=True)
class StepPlan:
    """A step's kernel calls: pieces run one dense call each, and varlen calls."""

    dense: tuple[Item, ...]
    varlen: tuple[VarlenCall, ...]


def varlen_flag(piece: Piece, bottom_right: bool = True) -> bool | None:
    """The causal flag of the varlen call that takes ``piece``: ``True`` for causal and anticausal squares and,
    when the op aligns causal masks bottom-right (``bottom_right``), for full pieces of one query row (that row
    then sees every key); ``False`` for other full pieces and for band pieces (their window says it), ``None``
    for masked ones."""
    if piece.kind == "masked":
        return None
    if piece.kind == "band":
        return False
    return piece.kind != "full" or (bottom_right and piece.r1 - piece.r0 == 1)


def plan_step(items: Sequence[Item], batch: int, device: torch.device, varlen: bool,
              bottom_right: bool = True) -> StepPlan:
    """The kernel calls of one step's pieces (module docstring); ``varlen``: the kernel has the op, which aligns
    causal masks bottom-right when ``bottom_right`` (``Kernel.varlen_bottom_right``). Pieces of one call class
    (causal flag, and a band piece's window) share a call."""
    if not varlen:
        return StepPlan(tuple(items), ())
    spans = tuple((rows.indices(batch)[:2], piece) for rows, piece in items)
    return _plan(spans, batch, torch.device(device), bottom_right)


@lru_cache(maxsize=64)  # per document mix: its index tensors are copied to the device once, without blocking
def _plan(spans: tuple[tuple[tuple[int, int], Piece], ...], batch: int, device: torch.device,
          bottom_right: bool) -> StepPlan:
    classes: dict[tuple[bool, tuple[int, int] | None], list[int]] = {}
    for i, (_, piece) in enumerate(spans):
        flag = varlen_flag(piece, bottom_right)
        if flag is not None:
            classes.setdefault((flag, piece.window), []).append(i)
    packed = {i for members in classes.values() if len(members) > 1 for i in members}
    dense = tuple((slice(*rows), piece) for i, (rows, piece) in enumerate(spans) if i not in packed)
    calls = tuple(_varlen_call([spans[i] for i in members], causal, window, batch, device)
                  for (causal, window), members in sorted(classes.items(), key=_class_order) if len(members) > 1)
    return StepPlan(dense, calls)


def _class_order(item: tuple) -> tuple:
    (causal, window), _ = item
    return causal, window is not None, window or (0, 0)


def _rounds(members: Sequence[tuple[tuple[int, int], Piece]]) -> list[int]:
    """Each piece's merge round: the first in which no piece of the same batch rows overlaps its query rows
    (interval colouring in order of first row, so the fewest rounds). Row groups never partly overlap."""
    ends: dict[tuple[int, int], list[int]] = {}
    rounds = [0] * len(members)
    for i in sorted(range(len(members)), key=lambda i: members[i][1].r0):
        rows, piece = members[i]
        last = ends.setdefault(rows, [])
        r = next((j for j, end in enumerate(last) if end <= piece.r0), len(last))
        last[r:r + 1] = [piece.r1]
        rounds[i] = r
    return rounds


def _positions(first: list[int], lengths: list[int], reverse: list[bool]) -> Tensor:
    """Concatenated ranges ``first[i] + [0, lengths[i])``, each counted down instead when ``reverse[i]``."""
    n = torch.tensor(lengths)
    start = torch.tensor([f + m - 1 if r else f for f, m, r in zip(first, lengths, reverse)])
    step = torch.tensor([-1 if r else 1 for r in reverse])
    offset = torch.arange(int(n.sum())) - (torch.cumsum(n, 0) - n).repeat_interleave(n)
    return start.repeat_interleave(n) + step.repeat_interleave(n) * offset


def _cumulative(lengths: list[int], device: torch.device) -> Tensor:
    """``cu_seqlens`` of these lengths: int32, ``[0, l0, l0 + l1, ...]``."""
    return to_device(torch.tensor([0, *accumulate(lengths)], dtype=torch.int32), device)


def _varlen_call(members: list[tuple[tuple[int, int], Piece]], causal: bool, window: tuple[int, int] | None,
                 batch: int, device: torch.device) -> VarlenCall:
    """Pack pieces of one call class, a sequence per (batch row, piece), ordered by merge round."""
    rounds = _rounds(members)
    order = sorted(range(len(members)), key=lambda i: rounds[i])  # stable: a round is a run of packed rows
    seqs = [(b, members[i][1], rounds[i]) for i in order for b in range(*members[i][0])]
    q_len, k_len = [p.r1 - p.r0 for _, p, _ in seqs], [p.c1 - p.c0 for _, p, _ in seqs]
    assert not causal or all(n in (1, m) for n, m in zip(q_len, k_len)), "causal: squares or single rows"
    rev = [p.kind == "anticausal" for _, p, _ in seqs]
    batch_rows = torch.tensor([b for b, _, _ in seqs])
    ends = [0, *accumulate(q_len)]
    bounds = [ends[j] for j in range(len(seqs) + 1) if j in (0, len(seqs)) or seqs[j][2] != seqs[j - 1][2]]
    q_pos = _positions([p.r0 for _, p, _ in seqs], q_len, rev)
    k_pos = _positions([p.c0 for _, p, _ in seqs], k_len, rev)
    q_row = batch_rows.repeat_interleave(torch.tensor(q_len))
    k_row = batch_rows.repeat_interleave(torch.tensor(k_len))
    return VarlenCall(
        causal, to_device(q_row, device), to_device(q_pos, device), to_device(k_row, device), to_device(k_pos, device),
        _cumulative(q_len, device), _cumulative(k_len, device), max(q_len), max(k_len),
        tuple(zip(bounds, bounds[1:])), window, _natural(q_row, q_pos, batch) and _natural(k_row, k_pos, batch),
    )


def _natural(row: Tensor, pos: Tensor, batch: int) -> bool:
    """Whether packed rows ``(row, pos)`` are every batch row's positions ``0, 1, ...`` in order (host tensors)."""
    n = row.numel()
    if n % batch:
        return False
    length = n // batch
    want = torch.arange(length).repeat(batch), torch.arange(batch).repeat_interleave(length)
    return bool(torch.equal(pos, want[0]) and torch.equal(row, want[1]))


def _gather(x: Tensor, row: Tensor, pos: Tensor) -> Tensor:
    """``[B, H, S, ...]`` -> ``[T, H, ...]``: the packed rows ``(row, pos)``."""
    return x.transpose(1, 2)[row, pos]


# ---------------------------------------------------------------- the steps


class ForwardStep:
    """Online-softmax accumulation of one member's queries over the blocks it is handed; a block none of
    whose keys a local query sees costs nothing (no kernel call, no merge)."""

    def __init__(self, q: Tensor, position: int, mask: AttnMask, cp: int, scale: float, kernel: Kernel,
                 layout: KVBlock) -> None:
        self.q, self.scale, self.kernel, self.layout = q, scale, kernel, layout
        self.plans = step_plans(mask, q.shape[0], q.shape[2], cp, position, q.device,
                                kernel.varlen_forward is not None, kernel.varlen_bottom_right, kernel.windowed)
        self.pieces = PieceCalls(kernel, scale, self.plans.band)
        acc = acc_dtype(q.dtype)
        self.out = torch.zeros((*q.shape[:3], layout.v_shape[3]), dtype=acc, device=q.device)
        self.lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)

    def __call__(self, src: int, block: Tensor) -> None:
        plan = self.plans(src)
        k, v = self.layout.split(block)
        for rows, p in plan.dense:
            out, lse = self.pieces.forward(p, self.q[rows, :, p.r0:p.r1], k[rows, :, p.c0:p.c1],
                                           v[rows, :, p.c0:p.c1])
            merge(self.out[rows, :, p.r0:p.r1], self.lse[rows, :, p.r0:p.r1], out, lse)
        for call in plan.varlen:
            self._varlen(call, k, v)

    def _varlen(self, call: VarlenCall, k: Tensor, v: Tensor) -> None:
        cols = (call.k_row, call.k_pos)
        out, lse = self.kernel.varlen_forward(_gather(self.q, call.q_row, call.q_pos), _gather(k, *cols),
                                              _gather(v, *cols), call.seqlens, call.mask(self.scale))
        out_acc, lse_acc = self.out.transpose(1, 2), self.lse.transpose(1, 2)
        for a, b in call.rounds:
            index = (call.q_row[a:b], call.q_pos[a:b])
            o, m = out_acc[index], lse_acc[index]
            merge(o, m, out[a:b], lse[:, a:b].t())
            out_acc[index], lse_acc[index] = o, m

    def result(self, sinks: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """out (input dtype) and lse of every block merged; ``sinks``: folded in last (:func:`fold_sinks`)."""
        if sinks is not None:
            self.out, self.lse = fold_sinks(self.out, self.lse, sinks)
        return self.out.to(self.q.dtype), self.lse


class BackwardStep:
    """dQ accumulation of one member; returns each block's dK/dV contribution (a :class:`KVBlock` in the
    accumulators' dtype; zeros, without a kernel call, for a block no local query sees)."""

    def __init__(self, dout: Tensor, q: Tensor, out: Tensor, lse: Tensor, position: int, mask: AttnMask,
                 cp: int, scale: float, kernel: Kernel) -> None:
        self.dout, self.q, self.out, self.lse = dout, q, out, lse
        self.scale, self.kernel = scale, kernel
        self.plans = step_plans(mask, q.shape[0], q.shape[2], cp, position, q.device,
                                kernel.varlen_backward is not None, kernel.varlen_bottom_right, kernel.windowed)
        self.pieces = PieceCalls(kernel, scale, self.plans.band)
        b, h, sq, d = q.shape  # [B, S, H, D] storage: the op's result layout, so no copy at the end
        self.dq = torch.zeros((b, sq, h, d), dtype=acc_dtype(q.dtype), device=q.device).transpose(1, 2)

    def __call__(self, src: int, block: Tensor) -> Tensor:
        layout = KVBlock.holding(block, self.q, self.out.shape[-1])
        contrib = layout.zeros(self.dq.dtype, block.device)
        k, v = layout.split(block)
        dk_acc, dv_acc = layout.split(contrib)
        plan = self.plans(src)
        for rows, p in plan.dense:
            r, c = slice(p.r0, p.r1), slice(p.c0, p.c1)
            dq, dk, dv = self.pieces.backward(p, self.dout[rows, :, r], self.q[rows, :, r], k[rows, :, c],
                                              v[rows, :, c], self.out[rows, :, r], self.lse[rows, :, r])
            self.dq[rows, :, r].add_(dq)
            dk_acc[rows, :, c].add_(dk)
            dv_acc[rows, :, c].add_(dv)
        for call in plan.varlen:
            self._varlen(call, k, v, dk_acc, dv_acc)
        return contrib

    def _varlen(self, call: VarlenCall, k: Tensor, v: Tensor, dk_acc: Tensor, dv_acc: Tensor) -> None:
        rows, cols = (call.q_row, call.q_pos), (call.k_row, call.k_pos)
        lse = _gather(self.lse, *rows).t().contiguous()  # [H, Tq]
        dq, dk, dv = self.kernel.varlen_backward(
            _gather(self.dout, *rows), _gather(self.q, *rows), _gather(k, *cols), _gather(v, *cols),
            _gather(self.out, *rows), lse, call.seqlens, call.mask(self.scale),
        )
        self.dq.transpose(1, 2).index_put_(rows, dq.to(self.dq.dtype), accumulate=True)
        dk_acc.transpose(1, 2).index_put_(cols, dk.to(dk_acc.dtype), accumulate=True)
        dv_acc.transpose(1, 2).index_put_(cols, dv.to(dv_acc.dtype), accumulate=True)
