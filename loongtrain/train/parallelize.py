"""Memory features applied from outside the model: hybrid ZeRO (FSDP2) and per-layer activation checkpointing.

``parallelize(model, mesh, cfg, device)`` is the trainer's single hook (DESIGN.md section 8):

* **Hybrid ZeRO** via FSDP2 (:func:`torch.distributed.fsdp.fully_shard`). The ``dp x sp`` ranks all hold
  the same weights, so parameters, gradients and optimizer state are sharded over all of them
  (``zero="full"``) or over consecutive groups of ``zero_shard_size`` ranks, replicated across groups
  (``zero="hybrid"``: HSDP on a 2-D ``(replicate, shard)`` DeviceMesh). Each rank back-propagates
  ``local_sum / replica_tokens`` (:func:`loongtrain.model.loss.sharded_cross_entropy`), so the exact
  gradient is the SUM over a replica's ``sp`` ranks AVERAGED over the ``dp`` replicas, i.e.
  ``sum over all ranks / dp``: the gradient divide factor is set to ``dp`` (FSDP's default would divide
  by ``dp * sp``). ``reshard_after_forward`` chooses between freeing gathered weights after each
  block's forward (re-gathered for backward) and keeping them until backward.
* **Activation checkpointing** of the first ``round(ac_fraction * num_layers)`` blocks:
  ``ac_mode="full"`` recomputes the whole block in backward; ``"selective"`` (Selective Checkpoint++)
  saves the outputs of ``torch.ops.loongtrain.head_all_to_all`` and ``torch.ops.loongtrain.ring_attention``
  (attention output and lse) and recomputes everything else, so the recompute pass runs no attention
  and sends nothing.

Parameter names are unchanged (checkpointing replaces the block's ``forward`` on the instance instead of
wrapping the module), so optimizer ordering and DCP checkpoints are layout-independent.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, fields
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from loongtrain.parallel.mesh import Mesh

ZERO_MODES = ("none", "full", "hybrid")
CKPT_MODES = ("none", "full", "selective")
_CKPT_ALIASES = {"selective++": "selective", "sac": "selective"}


@dataclass
class MemoryConfig:
    """Options of :func:`parallelize` (flat, so a TrainConfig can carry the same field names).

    ``zero``: ``none`` (replicated weights, the trainer all-reduces gradients), ``full`` (FSDP2 over all
    ``dp*sp`` ranks) or ``hybrid`` (HSDP: shard over groups of ``zero_shard_size`` consecutive ranks,
    replicate across the groups). ``zero_shard_size``: shard-group size for ``hybrid`` (0: all ranks,
    i.e. the same as ``full``). ``reshard_after_forward``: free gathered weights after each block's
    forward (True, ZeRO-3) or keep them until its backward (False, ZeRO-2-like memory).
    ``ac_mode``: ``none``, ``full`` or ``selective`` (Selective Checkpoint++; ``selective++`` accepted).
    ``ac_fraction``: fraction of the blocks (the first ones) that are checkpointed.
    """

    zero: str = "none"
    zero_shard_size: int = 0
    reshard_after_forward: bool = True
    ac_mode: str = "none"
    ac_fraction: float = 1.0

    def __post_init__(self) -> None:
        self.ac_mode = _CKPT_ALIASES.get(self.ac_mode, self.ac_mode)
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the bad value and the valid choices."""
        if self.zero not in ZERO_MODES:
            raise ValueError(f"zero={self.zero!r} is not one of {ZERO_MODES}")
        if isinstance(self.zero_shard_size, bool) or not isinstance(self.zero_shard_size, int) \
                or self.zero_shard_size < 0:
            raise ValueError(
                f"zero_shard_size={self.zero_shard_size!r} must be an integer >= 0 (0: all ranks)"
            )
        if self.zero_shard_size and self.zero != "hybrid":
            raise ValueError(
                f"zero_shard_size={self.zero_shard_size} needs zero='hybrid' (got zero={self.zero!r})"
            )
        if not isinstance(self.reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward={self.reshard_after_forward!r} must be True or False")
        if self.ac_mode not in CKPT_MODES:
            raise ValueError(
                f"ac_mode={self.ac_mode!r} is not one of {CKPT_MODES} (alias: 'selective++')"
            )
        if isinstance(self.ac_fraction, bool) or not isinstance(self.ac_fraction, (int, float)) \
                or not 0.0 <= self.ac_fraction <= 1.0:
            raise ValueError(f"ac_fraction={self.ac_fraction!r} must be a number in [0, 1]")

    def shard_size(self, world_size: int) -> int:
        """Ranks that shard one copy of the weights (``world_size`` for ``full``, 1 for ``none``)."""
        if self.zero == "none":
            return 1
        if self.zero == "full" or self.zero_shard_size in (0, world_size):
            return world_size
        if self.zero_shard_size < 2 or world_size % self.zero_shard_size != 0:
            raise ValueError(
                f"zero_shard_size={self.zero_shard_size} must divide the world size {world_size} and be "
                f">= 2 (valid: {[s for s in range(2, world_size + 1) if world_size % s == 0]}, or 0 for all)"
            )
        return self.zero_shard_size


def memory_config(cfg: Any) -> MemoryConfig:
    """The :class:`MemoryConfig` carried by ``cfg``.

    ``cfg`` may be a MemoryConfig, an object with a ``memory`` attribute holding one, or any object with
    (some of) the flat fields ``zero``, ``zero_shard_size``, ``reshard_after_forward``, ``ac_mode``,
    ``ac_fraction`` (e.g. a TrainConfig); missing fields take their defaults.
    """
    if isinstance(cfg, MemoryConfig):
        return cfg
    if isinstance(getattr(cfg, "memory", None), MemoryConfig):
        return cfg.memory
    values = {f.name: getattr(cfg, f.name) for f in fields(MemoryConfig) if hasattr(cfg, f.name)}
    return MemoryConfig(**values)


# --------------------------------------------------------------------------------------------------
# Activation checkpointing

#: Ops whose outputs Selective Checkpoint++ keeps from the first forward.
ATTENTION_OPS: tuple[torch._ops.OpOverload, ...] = ()


def _attention_ops() -> tuple[torch._ops.OpOverload, ...]:
    global ATTENTION_OPS
    if not ATTENTION_OPS:
        import loongtrain.attn.ops  # noqa: F401 - registers torch.ops.loongtrain.*

        ATTENTION_OPS = (
            torch.ops.loongtrain.head_all_to_all.default,
            torch.ops.loongtrain.ring_attention.default,
        )
    return ATTENTION_OPS


_SAVED_OUTPUT_SINKS = threading.local()


def _record_saved_output(output: Any) -> None:
    """Report an op output that SAC stores to the active sinks (used by the memory report)."""
    for sink in getattr(_SAVED_OUTPUT_SINKS, "stack", ()):
        sink(output)


class saved_output_sink:  # noqa: N801 - used like a function-style context manager
    """Context manager: call ``sink(output)`` for every op output Selective Checkpoint++ saves."""

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
    """Selective Checkpoint++: MUST_SAVE the attention all-to-alls and ring attention, recompute the rest."""
    if op in _attention_ops():
        if not ctx.is_recompute:
            _record_saved_output(getattr(ctx, "op_output", None))
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


#: ``context_fn`` of ``torch.utils.checkpoint`` for Selective Checkpoint++.
selective_context_fn = partial(create_selective_checkpoint_contexts, selective_policy)


def _checkpointed_forward(forward: Callable[..., Any], mode: str, *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    if mode == "selective":
        return checkpoint(forward, *args, use_reentrant=False, context_fn=selective_context_fn, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def checkpointed_layers(num_layers: int, fraction: float) -> list[int]:
    """Indices of the blocks to checkpoint: the first ``round(fraction * num_layers)``."""
    return list(range(int(round(fraction * num_layers))))


def apply_activation_checkpointing(layers: nn.ModuleList, mode: str, fraction: float = 1.0) -> list[int]:
    """Checkpoint the first ``round(fraction * len(layers))`` blocks in ``mode``; return their indices.

    The block's ``forward`` is replaced on the instance (module names and parameters are unchanged);
    forward hooks (FSDP's gather/reshard) still run around the checkpointed region.
    """
    cfg = MemoryConfig(ac_mode=mode, ac_fraction=fraction)
    if cfg.ac_mode == "none":
        return []
    chosen = checkpointed_layers(len(layers), cfg.ac_fraction)
    for i in chosen:
        block = layers[i]
        original = block.__dict__.get("_loongtrain_forward", block.forward)
        block._loongtrain_forward = original
        block.forward = partial(_checkpointed_forward, original, cfg.ac_mode)
    return chosen


# --------------------------------------------------------------------------------------------------
# FSDP2

_DEVICE_MESHES: dict[tuple[str, tuple[int, ...]], Any] = {}


def fsdp_device_mesh(device: torch.device, world_size: int, shard_size: int) -> Any:
    """A 1-D (``shard``) DeviceMesh over all ranks, or a 2-D ``(replicate, shard)`` one for HSDP.

    Shard groups are consecutive ranks (with head-first placement: a head group, then its neighbours).
    Cached per shape: creating a mesh is collective and makes new process groups.
    """
    from torch.distributed.device_mesh import init_device_mesh

    shape = (world_size,) if shard_size == world_size else (world_size // shard_size, shard_size)
    key = (device.type, shape)
    if key not in _DEVICE_MESHES:
        names = ("shard",) if len(shape) == 1 else ("replicate", "shard")
        _DEVICE_MESHES[key] = init_device_mesh(device.type, shape, mesh_dim_names=names)
    return _DEVICE_MESHES[key]


def apply_fsdp(model: nn.Module, mesh: Mesh, cfg: MemoryConfig, device: torch.device) -> nn.Module:
    """``fully_shard`` each block of ``model.layers`` and then the root, with gradient divide factor ``dp``.

    Must run after :func:`apply_activation_checkpointing` and with the model already on ``device``.
    """
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    if world != mesh.world_size:
        raise ValueError(f"torch.distributed world size {world} != mesh world size {mesh.world_size}")
    device_mesh = fsdp_device_mesh(device, world, cfg.shard_size(world))
    for block in model.layers:
        fully_shard(block, mesh=device_mesh, reshard_after_forward=cfg.reshard_after_forward)
    fully_shard(model, mesh=device_mesh, reshard_after_forward=cfg.reshard_after_forward)
    # gradient = sum over all dp*sp ranks / dp (see module docstring); FSDP would divide by dp*sp.
    force_sum = device.type != "cuda"  # gloo has neither AVG nor PREMUL_SUM: SUM, then divide
    for module in model.modules():
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(float(mesh.dp))
            module.set_force_sum_reduction_for_comms(force_sum)
    return model


def is_sharded(model: nn.Module) -> bool:
    """True when ``model``'s parameters are FSDP2 DTensors (gradients are reduced by FSDP)."""
    return any(type(p).__name__ == "DTensor" for p in model.parameters())


def parallelize(model: nn.Module, mesh: Mesh, cfg: Any, device: torch.device) -> nn.Module:
    """The trainer's hook: move ``model`` to ``device``, checkpoint its blocks, shard it with FSDP2.

    ``cfg``: anything :func:`memory_config` accepts (a TrainConfig with the MemoryConfig field names, a
    MemoryConfig, or an object with a ``memory`` attribute). With ``zero="none"`` parameters stay plain
    tensors and the trainer's own gradient all-reduce applies; otherwise parameters become DTensors and
    the trainer must not all-reduce (``loongtrain.train.sync.needs_grad_sync`` returns False). Without an
    initialised process group (or a world of 1) ``zero`` is ignored.
    """
    mcfg = memory_config(cfg)
    model = model.to(device)
    if not hasattr(model, "layers"):
        raise ValueError(f"{type(model).__name__} has no .layers ModuleList of blocks to checkpoint/shard")
    apply_activation_checkpointing(model.layers, mcfg.ac_mode, mcfg.ac_fraction)
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if mcfg.zero != "none" and distributed:
        apply_fsdp(model, mesh, mcfg, device)
    return model
