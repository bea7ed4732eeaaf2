"""Test instrumentation: count executions of the ring's forward compute."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


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


@contextmanager
def record_loongtrain_ops() -> Iterator[list[tuple[Any, tuple]]]:
    """Record every distinct call of a ``torch.ops.loongtrain.*`` op (forward and backward ops, as the
    dispatcher sees them) as ``(op, args)``, tensors copied with their strides; distinct by op, tensor
    metadata and the other arguments, in first-call order (the same on every rank of a layout)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

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
