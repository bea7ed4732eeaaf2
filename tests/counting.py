"""Test instrumentation: count executions of the ring's forward compute, and the reads that would
synchronise a GPU."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


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
