"""Cross-rank agreement before collectives: ranks that disagree fail at once, by name (docs/launching.md).

Collectives called with different shapes, dtypes or flags on different ranks either hang, abort inside
the backend with a message that names nothing, or (a different ``causal`` flag) complete with wrong
results. :func:`check_agreement` compares the arguments with one all-reduce of a digest; only when they
differ does it gather them (one ``all_gather_object``) and raise the same ValueError on every rank,
naming each field that differs and which ranks hold which value.

:func:`agree_on_attention` checks EVERY call (:data:`ATTENTION_CHECK` = "every"): a digest of the
arguments (shapes, dtypes, causal, scale, document boundaries, inner_ring, chunk order), one all-reduce of
two int64 on the replica's ranks, so a rank that changes its arguments after any number of agreed calls
fails with its peers instead of hanging them. Under NCCL the digest travels on a gloo group of the same
ranks (``Mesh.check_group``): no device synchronisation. Its cost is measured in
``benchmarks/agreement.py`` (benchmarks/results/RESULTS.md). :func:`agree_once` (the "once" mode) checks once per
distinct signature and group, a set lookup afterwards; its limit: a rank that reaches a signature the
others have already checked calls the exchange alone and waits for the process group's timeout.

:func:`deferred_attention_checks` (the trainer's steady state, docs/launching.md) replaces the per-call
exchange inside a ``with`` block: each call's fields are digested on the host (Python values, no device
data) and kept; :meth:`AttentionLog.check` compares the digest of all of them, in order, in ONE exchange
at the block's end, and on a mismatch names the first call and field that differ. It cannot tell a
disagreement before the calls' own collectives run, so its caller agrees up front on what decides their
shapes (the trainer: each micro-batch's sizes, documents and chunk order); what a disagreement among the
rest does to a collective is bounded by the process group's timeout.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from loongtrain.parallel.runtime import is_distributed

#: "every": :func:`agree_on_attention` checks every call; "once": once per signature (:func:`agree_once`)
ATTENTION_CHECKS = ("every", "once")
ATTENTION_CHECK = "every"


def set_attention_check(mode: str) -> str:
    """Set how often attention arguments are checked across ranks (:data:`ATTENTION_CHECKS`); return
    the previous mode. Every rank must use the same mode."""
    global ATTENTION_CHECK
    if mode not in ATTENTION_CHECKS:
        raise ValueError(f"attention check mode {mode!r} is not one of {ATTENTION_CHECKS}")
    previous, ATTENTION_CHECK = ATTENTION_CHECK, mode
    return previous


# (group name, call site, signature) already checked; group names are never reused, so entries stay true
_CHECKED: set[tuple[str, str, tuple[tuple[str, Any], ...]]] = set()
_MAX_CHECKED = 4096


def check_agreement(what: str, fields: Mapping[str, Any], group: dist.ProcessGroup | None = None) -> None:
    """Collective over ``group`` (default: the world): raise ValueError on every rank unless all ranks
    pass equal ``fields`` (picklable values). No-op without an initialised process group."""
    if not is_distributed():
        return
    size = dist.get_world_size(group)
    if size == 1 or _same_everywhere(repr(list(fields.items())), group):
        return
    gathered: list[Any] = [None] * size
    dist.all_gather_object(gathered, dict(fields), group=group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(size))
    problems = []
    for name in fields:
        holders: dict[str, list[int]] = {}
        for rank, got in zip(ranks, gathered):
            holders.setdefault(repr(got.get(name)), []).append(rank)
        if len(holders) > 1:
            problems.append(f"{name}: " + ", ".join(f"{value} on ranks {r}" for value, r in holders.items()))
    if problems:
        raise ValueError(f"{what}: ranks {ranks} must pass the same arguments, but they differ in "
                         + "; ".join(problems))


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


def _same_everywhere(text: str, group: dist.ProcessGroup | None) -> bool:
    """One all-reduce: do all ranks of ``group`` hold the same ``text``? (a 56-bit digest, min vs max)"""
    digest = _digest(text)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    both = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MIN, group=group)
    return int(both[0]) == -int(both[1])


def agree_once(what: str, fields: Mapping[str, Any], group: dist.ProcessGroup | None) -> None:
    """:func:`check_agreement` the first time this rank sees ``fields`` for ``what`` on ``group``; free
    afterwards. Skipped while torch.compile traces (the exchange is host-side)."""
    if group is None or not is_distributed() or torch.compiler.is_compiling():
        return
    key = (group.group_name, what, tuple(fields.items()))
    if key in _CHECKED:
        return
    check_agreement(what, fields, group)
    if len(_CHECKED) >= _MAX_CHECKED:  # every rank that agreed so far holds the same keys: clears alike
        _CHECKED.clear()
    _CHECKED.add(key)


def agree_on_attention(mesh: Any, q: Any, k: Any, v: Any, **call: Any) -> None:
    """Collective over ``mesh``'s replica ranks: ValueError on every rank, naming the field, unless all
    pass the same arguments to this ``loongtrain.attention`` call (``q``, ``k``, ``v`` and ``call``: ``causal``,
    ``softmax_scale``, ``cu_seqlens``, ``sliding_window``, ``chunk_order``, ``sinks``), taken as given (before
    validation, so a rank whose arguments are invalid and differ from its peers' does not leave them waiting): the
    shapes of q, k, v (batch, S, heads, KV heads, head dim), dtypes, causal, softmax_scale, sliding
    inner_ring, document boundaries, chunk order and the sinks' shape. Every call (:data:`ATTENTION_CHECK`): one
    all-reduce of a digest on :func:`attention_check_group`; inside :func:`deferred_attention_checks` for that group,
    no exchange: the fields are recorded and checked at the block's end."""
    if mesh.sp_group is None or torch.compiler.is_compiling():
        return
    fields: dict[str, Any] = {"q": _describe(q)}
    if isinstance(q, torch.Tensor) and q.dim() == 4:
        fields = dict(zip(("batch", "seq", "num_heads", "head_dim"), q.shape), dtype=str(q.dtype))
    if isinstance(k, torch.Tensor) and k.dim() == 4:
        fields["num_kv_heads"] = k.shape[2]
    fields.update(k=_describe(k), v=_describe(v), causal=_describe(call.get("causal")),
                  softmax_scale=_describe(call.get("softmax_scale")),
                  sliding_window=_describe(call.get("sliding_window")), documents=_describe(call.get("cu_seqlens")),
                  chunk_order=_describe(call.get("chunk_order")), sinks=_describe(call.get("sinks")))
    _agree_on_call(mesh, "attention", fields)


def agree_on_linear_attention(mesh: Any, tensors: Mapping[str, Any], options: Mapping[str, Any]) -> None:
    """:func:`agree_on_attention` for a ``loongtrain.linear_attention`` call: the tensors' shapes and dtypes
    (``tensors``), the options' values (``options``: scale, convolution, document boundaries, chunk order), in
    the same mode and on the same group (deferred inside :func:`deferred_attention_checks`)."""
    if mesh.sp_group is None or torch.compiler.is_compiling():
        return
    fields = {name: _describe(value) for name, value in {**tensors, **options}.items()}
    _agree_on_call(mesh, "linear attention", fields)


def _agree_on_call(mesh: Any, what: str, fields: dict[str, Any]) -> None:
    group = attention_check_group(mesh)
    deferred = next((log for log in reversed(_DEFERRED) if log.group is group), None)
    if deferred is not None:
        deferred.record(fields)
    elif ATTENTION_CHECK == "once":
        agree_once(what, fields, group)
    else:
        check_agreement(what, fields, group)


def attention_check_group(mesh: Any) -> dist.ProcessGroup | None:
    """The group attention arguments are agreed on: ``mesh.check_group`` (gloo, under NCCL), else the
    replica's ``sp_group``; both hold the replica's ranks, so no check moves device data."""
    return getattr(mesh, "check_group", None) or mesh.sp_group


def _describe(value: Any) -> Any:
    """A hashable, comparable stand-in: a tensor's shape and dtype (its values for a 1-D integer tensor,
    i.e. document boundaries), sequences as tuples, scalars as they are."""
    if isinstance(value, torch.Tensor):
        if value.device.type == "meta":  # no values to compare (and invalid input: raised after agreeing)
            return ("meta", tuple(value.shape), str(value.dtype))
        if value.dim() <= 1 and not value.is_floating_point():
            return tuple(value.tolist()) if value.dim() == 1 else value.item()
        return (tuple(value.shape), str(value.dtype))
    if isinstance(value, (list, tuple)):
        return tuple(_describe(x) for x in value)
    return value


class AttentionLog:
    """The attention calls of one :func:`deferred_attention_checks` block: a digest per call (of the same
    fields the per-call check exchanges), and each distinct set of fields once (for the error message)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.calls: list[int] = []  # per call: its 56-bit digest
        self.fields: dict[int, dict[str, Any]] = {}  # digest -> the fields it was made from

    def record(self, fields: Mapping[str, Any]) -> None:
        digest = _digest(repr(list(fields.items())))
        self.calls.append(digest)
        self.fields.setdefault(digest, dict(fields))

    def check(self) -> None:
        """Collective over :attr:`group`: raise the same ValueError on every rank unless all ranks recorded
        the same calls in the same order; it names the first call that differs and its differing fields
        (as :func:`check_agreement` does). One all-reduce when they agree. Forgets the recorded calls."""
        calls, self.calls = self.calls, []
        fields, self.fields = self.fields, {}
        if not is_distributed() or dist.get_world_size(self.group) == 1:
            return
        if _same_everywhere(repr(calls), self.group):
            return
        gathered: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, calls, group=self.group)
        first = next(i for i in range(max(map(len, gathered)))
                     if len({tuple(c[i:i + 1]) for c in gathered}) > 1)
        mine = fields[calls[first]] if first < len(calls) else {}
        what = f"attention (call {first + 1} of {len(calls)} since the last check on this rank)"
        check_agreement(what, {"calls": len(calls), **mine}, self.group)
        raise AssertionError(f"{what}: the digests differ but no field does")  # a digest collision


_DEFERRED: list[AttentionLog] = []  # the open deferred_attention_checks blocks, innermost last


@contextmanager
def deferred_attention_checks(mesh: Any) -> Iterator[AttentionLog]:
    """Inside the block, :func:`agree_on_attention` on ``mesh`` exchanges nothing: it records each call
    (host-side: shapes, dtypes and Python values) in the yielded :class:`AttentionLog`. Every rank of the
    replica must call ``log.check()`` (one collective) before trusting what the calls computed; the
    block does not check by itself (an exception inside it leaves peers where they are). The caller
    agrees beforehand on every argument that changes the calls' collectives (module docstring)."""
    log = AttentionLog(attention_check_group(mesh))
    _DEFERRED.append(log)
    try:
        yield log
    finally:
        _DEFERRED.remove(log)
