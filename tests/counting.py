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
