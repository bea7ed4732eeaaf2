"""Test instrumentation: count executions of the ring's forward compute, and the bytes the memory-bound ops move."""

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
    ``backward`` split the bytes by autograd phase."""

    def __init__(self) -> None:
        super().__init__()
        self.forward = self.backward = self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in _MATMULS and func.namespace == "aten":
            a, b = args[-2], args[-1]
            self.flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
            return out
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
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
    """What :class:`TrafficCounter` counts in one trainer step (``loongtrain.train.simulate.simulate_step``
    under fake tensors, one rank of ``world``): ``forward``/``backward`` bytes of the loss and its backward
    (recompute included), ``optimizer`` bytes of the AdamW step, ``flops`` of the matmuls."""
    from loongtrain.train import simulate

    counted: dict[str, int] = {}

    def tracked(trainer, batch):
        for p in trainer.model.parameters():  # steady state, as simulate.tracked_step
            p.grad = torch.zeros_like(p)
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        with TrafficCounter() as step:
            loss, _ = trainer.loss(batch)
            loss.backward()
        with TrafficCounter() as optimizer:
            trainer.optimizer.step()
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
