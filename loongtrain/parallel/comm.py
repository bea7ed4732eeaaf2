"""Communication primitives used by 2D-Attention, and an opt-in counter of what they send.

Every byte the attention path puts on the wire goes through :func:`all_to_all` or
:func:`post_exchange`, so :class:`CommCounter` sees all of it (tests assert it equals the
formulas in :mod:`loongtrain.plan.traffic`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

_ACTIVE: list[CommCounter] = []


@dataclass
class CommCounter:
    """Context manager recording, for this process, ops and bytes sent by kind and by peer.

    kinds: ``a2a`` (head all-to-all), ``kv`` (K/V ring blocks), ``dkv`` (dK/dV ring returns); linear attention's
    ``state`` (its runs' state pairs) and ``halo`` (its runs' convolution tails), and their gradients ``dstate``,
    ``dhalo`` (docs/linear-attention.md).
    ``bytes_by_peer`` counts only data leaving this rank (all-to-all chunks kept locally excluded).
    """

    ops: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)
    bytes_by_peer: Counter = field(default_factory=Counter)

    def record(self, kind: str, peer_bytes: dict[int, int]) -> None:
        self.ops[kind] += 1
        for peer, nbytes in peer_bytes.items():
            self.bytes[kind] += nbytes
            self.bytes_by_peer[peer] += nbytes

    def __enter__(self) -> CommCounter:
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.remove(self)


def _record(kind: str, peer_bytes: dict[int, int]) -> None:
    for counter in _ACTIVE:
        counter.record(kind, peer_bytes)


def resolve_group(name: str) -> dist.ProcessGroup:
    """The process group registered under ``name`` (names travel through custom ops as strings)."""
    return dist.distributed_c10d._resolve_process_group(name)


def all_to_all(x: torch.Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Forward: split ``x`` into ``n`` pieces along ``scatter_dim``, send piece ``i`` to group rank ``i``,
    concatenate received pieces along ``gather_dim`` in group-rank order. Its backward is the same call
    with the two dims swapped (done by the caller's autograd rule). The result's layout (a view where the
    pieces allow one, so not always contiguous) is :func:`all_to_all_result` of the received buffer."""
    n = dist.get_world_size(group)
    if n == 1:
        return x
    send = all_to_all_pieces(x, n, scatter_dim)
    recv = torch.empty_like(send)
    piece_bytes = send[0].numel() * send.element_size()
    me = dist.get_rank(group)
    _record("a2a", {dist.get_global_rank(group, i): piece_bytes for i in range(n) if i != me})
    dist.all_to_all_single(recv, send, group=group)
    return all_to_all_result(recv, gather_dim)


def all_to_all_pieces(x: torch.Tensor, n: int, scatter_dim: int) -> torch.Tensor:
    """``x`` split into ``n`` pieces along ``scatter_dim``, stacked contiguously as ``[n, ...]`` (the send
    buffer of :func:`all_to_all`)."""
    assert x.shape[scatter_dim] % n == 0, (tuple(x.shape), scatter_dim, n)
    shape = list(x.shape)
    split = shape[:scatter_dim] + [n, shape[scatter_dim] // n] + shape[scatter_dim + 1 :]
    return x.reshape(split).movedim(scatter_dim, 0).contiguous()


def all_to_all_result(recv: torch.Tensor, gather_dim: int) -> torch.Tensor:
    """The received ``[n, ...]`` buffer of :func:`all_to_all` (piece ``i`` from group rank ``i``) as its
    result: the group axis moved just before ``gather_dim`` and merged with it. Pure layout (shapes and
    strides follow from ``recv``'s), so a custom op's fake implementation gets the real strides from it."""
    out_shape = list(recv.shape[1:])
    out_shape[gather_dim] *= recv.shape[0]
    return recv.movedim(0, gather_dim).reshape(out_shape)


@dataclass
class Exchange:
    """An in-flight ring exchange: ``wait()`` returns the received tensor."""

    works: list
    received: torch.Tensor

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        return self.received


def post_exchange(
    send: torch.Tensor, dst: int, src: int, group: dist.ProcessGroup, kind: str
) -> Exchange:
    """Forward-only point-to-point step: post an async send of ``send`` to global rank ``dst`` and an
    async receive of a same-shaped tensor from global rank ``src``; returns at once (no autograd:
    the ring's backward posts its own exchanges)."""
    send = send.contiguous()
    received = torch.empty_like(send)
    _record(kind, {dst: send.numel() * send.element_size()})
    ops = [
        dist.P2POp(dist.isend, send, dst, group),
        dist.P2POp(dist.irecv, received, src, group),
    ]
    return Exchange(dist.batch_isend_irecv(ops), received)


def all_gather_stacked(x: torch.Tensor, group: dist.ProcessGroup, kind: str) -> torch.Tensor:
    """Forward: every group member's ``x`` (same shape everywhere) stacked as ``[n, ...]`` in group-rank order;
    ``x`` goes to each of the ``n - 1`` others. Its backward is :func:`reduce_scatter_stacked` (the caller's
    autograd rule)."""
    n = dist.get_world_size(group)
    x = x.contiguous()
    if n == 1:
        return x.unsqueeze(0).clone()
    me = dist.get_rank(group)
    _record(kind, {dist.get_global_rank(group, i): x.numel() * x.element_size() for i in range(n) if i != me})
    pieces = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(pieces, x, group=group)
    return torch.stack(pieces)


def reduce_scatter_stacked(x: torch.Tensor, group: dist.ProcessGroup, kind: str) -> torch.Tensor:
    """Forward: ``x [n, ...]`` (one piece per group member, in group-rank order) summed over the group, this
    member's piece kept: piece ``i`` goes to member ``i`` by one all-to-all (``n - 1`` pieces sent). The
    backward of :func:`all_gather_stacked`."""
    n = dist.get_world_size(group)
    if n == 1:
        return x[0].clone()
    send = x.contiguous()
    me = dist.get_rank(group)
    _record(kind, {dist.get_global_rank(group, i): send[0].numel() * send.element_size() for i in range(n) if i != me})
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.sum(dim=0)


class _SumOverRanks(torch.autograd.Function):
    """Forward: the sum of ``x`` over ``group`` (the same tensor on every rank). Backward: the incoming gradient
    unchanged (no communication), for a sum that every rank uses alike in a loss whose parameter gradients are
    then summed over ``group``: each rank's own part receives ``d loss / d sum`` exactly once."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # noqa: ANN001
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        return grad, None


def sum_over_ranks(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Forward: all-reduce (sum) of ``x`` over ``group`` (``x`` itself when ``group`` is None or of one rank);
    backward: identity (:class:`_SumOverRanks`'s contract: the loss built from the sum is replicated and its
    gradients are summed over ``group``)."""
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _SumOverRanks.apply(x, group)
