"""Test instrumentation: count executions of the ring's forward compute, the bytes the memory-bound ops move
and the reads that would synchronise a GPU; record the loongtrain custom ops' calls."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


@contextmanager
def count_ring_forward() -> Iterator[Counter]:
    """Patch ``ring_forward`` as the attention custom op sees it; ``calls["ring_forward"]`` counts runs."""
    from loongtrain.attn import ops
    calls: Counter = Counter()
    original = ops.ring_forward

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls["ring_forward"] += 1
        return original(*args, **kwargs)

    ops.ring_forward = counted
    try:
        yield calls
    finally:
        ops.ring_forward = original


_MATMULS = ("mm", "addmm", "bmm", "baddbmm")
_FREE = ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "alias", "lift_fresh",
         "_unsafe_view",
         "set_", "_local_scalar_dense", "record_stream")
_KERNELS = ("_scaled_dot_product", "_flash_attention", "_efficient_attention", "_cudnn_attention")
_SKIPPED_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_dtensor", "loongtrain")


def _nbytes(t: torch.Tensor) -> int:
    """Bytes a tensor's elements take, a stride-0 (broadcast) dim counted once."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        n *= size if stride else 1
    return n * t.element_size()


class TrafficCounter(TorchDispatchMode):
    """Adds up what the memory-bound ops move: each op's tensor inputs and outputs, views, allocations and
    queries free; matmuls are counted as FLOPs instead, and the attention kernels, loongtrain's custom ops and
    collectives not at all (the planner times them apart: loongtrain/plan/step_bytes.py). ``forward`` and
    ``backward`` split the bytes by autograd phase. ``foreach_in_place``: count the in-place ``_foreach_*_`` ops
    (which return nothing) as writing their first list: the foreach AdamW step's; off, FSDP2's staging copies
    are left to the communication model as before."""

    def __init__(self, foreach_in_place: bool = False) -> None:
        super().__init__()
        self.forward = self.backward = self.flops = 0
        self.foreach_in_place = foreach_in_place

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in _MATMULS and func.namespace == "aten":
            a, b = args[-2], args[-1]
            self.flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
            return out
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if self.foreach_in_place and not outs and name.startswith("_foreach_") and name.endswith("_"):
            outs = [t for t in tree_flatten(args[0])[0] if isinstance(t, torch.Tensor)]  # returns nothing: it writes
            # its first list
        if (func.is_view or name in _FREE or func.namespace in _SKIPPED_NAMESPACES or name.startswith(_KERNELS)
                or (not outs and name != "copy_")):
            return out
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        moved = sum(map(_nbytes, ins)) + sum(map(_nbytes, outs))
        if torch._C._current_graph_task_id() != -1:
            self.backward += moved
        else:
            self.forward += moved
        return out


def step_traffic(model, parallel, world: int, seq_len: int, dtype: str = "bf16") -> dict[str, int]:
    """What :class:`TrafficCounter` counts in one trainer step (``loongtrain.launch.simulate.simulate_step``
    under fake tensors, one rank of ``world``): ``forward``/``backward`` bytes of the loss and its backward
    (recompute included), ``optimizer`` bytes of the AdamW step, ``flops`` of the matmuls."""
    from loongtrain.launch import simulate

    counted: dict[str, int] = {}

    def tracked(simulated, offload_params=False):
        for p in simulated.ctx.model.parameters():  # steady state, as simulate.tracked_step
            p.grad = torch.zeros_like(p)
        simulated.optimizer.step()
        simulated.optimizer.zero_grad(set_to_none=True)
        with TrafficCounter() as step:
            loss, _ = simulated.loss_fn()
            loss.backward()
        with TrafficCounter(foreach_in_place=True) as optimizer:
            simulated.optimizer.step()
        counted.update(forward=step.forward, backward=step.backward, flops=step.flops,
                       optimizer=optimizer.forward + optimizer.backward)
        return 0, {}, 0, {}, {}

    original = simulate.tracked_step
    simulate.tracked_step = tracked
    try:
        simulate.simulate_step(model, parallel, world, seq_len=seq_len, dtype=dtype)
    finally:
        simulate.tracked_step = original
    return counted


def _device_data(t: torch.Tensor, host: set[int]) -> bool:
    """Whether reading ``t`` would synchronise a GPU: on CPU every tensor is a host tensor, so what a CUDA run
    keeps on the host is told apart by kind: index tensors (documents, chunk orders, the gloo digests) are
    integers, and AdamW's step counters (``host``: their ids) live on the CPU unless capturable."""
    return (t.is_floating_point() or t.dtype == torch.bool) and id(t) not in host


class DeviceReads(TorchDispatchMode):
    """Counts the reads that synchronise a CUDA device: ``aten._local_scalar_dense`` (``.item()``, ``float()``,
    ``bool()`` of a tensor) here, and ``.tolist()``/``.numpy()`` through :func:`counted_reads` (on CPU they
    bypass the dispatcher), of device data (:func:`_device_data`)."""

    def __init__(self, host: set[int]) -> None:
        super().__init__()
        self.count, self.host = 0, host

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and _device_data(args[0], self.host):
            self.count += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def counted_reads(host: set[int] = frozenset()) -> Iterator[DeviceReads]:
    """Count the device reads inside the block (:class:`DeviceReads`); ``host``: ids of floating tensors a
    CUDA run keeps on the host."""
    mode = DeviceReads(host)
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}

    def wrap(fn):
        def read(self, *args, **kwargs):
            if _device_data(self, host):
                mode.count += 1
            return fn(self, *args, **kwargs)
        return read

    for name, fn in originals.items():
        setattr(torch.Tensor, name, wrap(fn))
    try:
        with mode:
            yield mode
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)


@contextmanager
def record_loongtrain_ops() -> Iterator[list[tuple[Any, tuple]]]:
    """Record every distinct call of a ``torch.ops.loongtrain.*`` op (forward and backward ops, as the
    dispatcher sees them) as ``(op, args)``, tensors copied with their strides; distinct by op, tensor
    metadata and the other arguments, in first-call order (the same on every rank of a layout)."""
    calls: list[tuple[Any, tuple]] = []
    seen: set = set()

    def copy(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype).copy_(x)
        return x

    def key(x: Any) -> Any:
        return (tuple(x.shape), x.stride(), x.dtype) if isinstance(x, torch.Tensor) else x

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "loongtrain":
                signature = (str(func), tuple(key(a) for a in args))
                if signature not in seen:
                    seen.add(signature)
                    calls.append((func, tuple(copy(a) for a in args)))
            return func(*args, **(kwargs or {}))

    with Recorder():
        yield calls
