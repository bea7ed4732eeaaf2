"""Recompute ("recompute"; docs/memory.md): a block's ``forward`` re-runs in backward
instead of keeping its activations. ``recompute="full"`` recomputes the whole block; ``"selective"``
(selective recompute) saves the outputs of ``torch.ops.loongtrain.head_all_to_all``,
``torch.ops.loongtrain.ring_attention`` (attention output and lse) and ``torch.ops.loongtrain.context_all_gather``
(linear attention's exchanged halos and state pairs) and recomputes everything else, so the recompute pass runs no
softmax attention and sends nothing (linear attention's local recurrence is recomputed). The first
``round(recompute_fraction * num_layers)`` blocks are recomputed (:func:`recomputed_layers`). The block's
``forward`` is replaced on the instance, so module and parameter names are unchanged.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from loongtrain.parallel.config import ParallelConfig


@functools.cache
def selective_saved_ops() -> tuple[torch._ops.OpOverload, ...]:
    """Ops whose outputs selective recompute keeps from the first forward."""
    import loongtrain.attn.linear.ops  # noqa: F401 - registers torch.ops.loongtrain.context_*
    import loongtrain.attn.ops  # noqa: F401 - registers torch.ops.loongtrain.*

    return (
        torch.ops.loongtrain.head_all_to_all.default,
        torch.ops.loongtrain.ring_attention.default,
        torch.ops.loongtrain.context_all_gather.default,
    )


_SAVED_OUTPUT_SINKS = threading.local()


def record_saved_output(output: Any) -> None:
    """Report an op output that SAC stores to the active sinks (used by the memory report)."""
    for sink in getattr(_SAVED_OUTPUT_SINKS, "stack", ()):
        sink(output)


class saved_output_sink:  # noqa: N801 - used like a function-style context manager
    """Context manager: call ``sink(output)`` for every op output selective recompute saves."""

    def __init__(self, sink: Callable[[Any], None]) -> None:
        self.sink = sink

    def __enter__(self) -> saved_output_sink:
        if not hasattr(_SAVED_OUTPUT_SINKS, "stack"):
            _SAVED_OUTPUT_SINKS.stack = []
        _SAVED_OUTPUT_SINKS.stack.append(self.sink)
        return self

    def __exit__(self, *exc: object) -> None:
        _SAVED_OUTPUT_SINKS.stack.remove(self.sink)


def selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """selective recompute: MUST_SAVE the attention all-to-alls and ring attention, recompute the rest."""
    if op in selective_saved_ops():
        if not ctx.is_recompute and not torch.compiler.is_compiling():  # compiled: saved as graph outputs
            record_saved_output(getattr(ctx, "op_output", None))
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def offloaded_selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """:func:`selective_policy` for offloaded blocks: the saved outputs go to the host, so none is
    reported as kept on the device (the offloader reports nothing either: see ``parallelize/offload.py``)."""
    return CheckpointPolicy.MUST_SAVE if op in selective_saved_ops() else CheckpointPolicy.PREFER_RECOMPUTE


#: ``context_fn`` of ``torch.utils.checkpoint`` for selective recompute.
selective_context_fn = partial(create_selective_checkpoint_contexts, selective_policy)


def _recomputed_forward(forward: Callable[..., Any], mode: str, context_fn: Callable[[], Any] | None,
                          *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    if mode == "selective":
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn or selective_context_fn,
                          **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def recomputed_layers(num_layers: int, fraction: float) -> list[int]:
    """Indices of the blocks whose activations are recomputed: the first ``round(fraction * num_layers)``."""
    return list(range(int(round(fraction * num_layers))))




def apply_recompute(layers: nn.ModuleList, mode: str, fraction: float = 1.0, *,
                                   selective_context: Callable[[], Any] | None = None) -> list[int]:
    """Checkpoint the first ``round(fraction * len(layers))`` blocks in ``mode``; return their indices.

    The block's ``forward`` is replaced on the instance (module names and parameters are unchanged);
    forward hooks (FSDP's gather/reshard) still run around the checkpointed region.
    ``selective_context``: the ``context_fn`` of selective blocks (default :data:`selective_context_fn`).
    """
    cfg = ParallelConfig(recompute=mode, recompute_fraction=fraction)  # validates; 'selective recompute' -> 'selective'
    if cfg.recompute == "none":
        return []
    chosen = recomputed_layers(len(layers), cfg.recompute_fraction)
    for i in chosen:
        block = layers[i]
        original = block.__dict__.get("_loongtrain_forward", block.forward)
        block._loongtrain_forward = original
        block.forward = partial(_recomputed_forward, original, cfg.recompute, selective_context)
    return chosen
