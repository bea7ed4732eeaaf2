"""Parallelism applied to a plain model from outside, in three steps and the memory modes (docs/design.md §7):

``parallelize(model, mesh, parallel, device)`` moves the model to ``device`` and composes

1. **2D-Attention**: :func:`loongtrain.hf.apply.apply_2d_attention` rebinds every ``attention_fn`` to
   attention over ``mesh``;
2. **activation checkpointing** of the first ``round(ac_fraction * num_layers)`` blocks:
   ``ac_mode="full"`` recomputes the whole block in backward; ``"selective"`` (Selective Checkpoint++)
   saves the outputs of ``torch.ops.loongtrain.head_all_to_all`` and ``torch.ops.loongtrain.ring_attention``
   (attention output and lse) and recomputes everything else, so the recompute pass runs no attention
   and sends nothing (docs/design.md §6);
3. **hybrid ZeRO** via FSDP2 (:func:`torch.distributed.fsdp.fully_shard`) of every block
   (:func:`decoder_layers`) and then the root. The ``dp x sp`` ranks all hold
   the same weights, so parameters, gradients and optimizer state are sharded over all of them
   (``zero="full"``) or over consecutive groups of ``zero_shard_size`` ranks, replicated across groups
   (``zero="hybrid"``: HSDP on a 2-D ``(replicate, shard)`` DeviceMesh). Each rank back-propagates
   ``local_sum / replica_tokens`` (:func:`loongtrain.loss.sharded.sharded_cross_entropy`), so the exact
   gradient is the SUM over a replica's ``sp`` ranks AVERAGED over the ``dp`` replicas, i.e.
   ``sum over all ranks / dp``: the gradient divide factor is set to ``dp`` (FSDP's default would divide
   by ``dp * sp``). ``reshard_after_forward`` chooses between freeing gathered weights after each
   block's forward (re-gathered for backward) and keeping them until backward; the root (embedding,
   final norm, LM head) always keeps them (``reshard_after_forward=False``): the loss reads the head
   weight after the model's forward. With ``param_dtype`` (bf16 runs) FSDP2's
   ``MixedPrecisionPolicy(param_dtype, reduce_dtype=float32)`` gathers bf16 weights and reduces fp32
   gradients into the fp32 shards; the trainer then runs without autocast (docs/design.md §7).

Compiled blocks (``compile=True``, ``--compile``; docs/design.md §13) are a step of their own after
checkpointing and before FSDP2: :func:`loongtrain.train.compile.compile_blocks` replaces each block's
(checkpointed) ``forward`` by a ``torch.compile``-d one.

The memory modes (docs/design.md §7, *Memory modes*) are steps of their own: ``mlp_tiles`` tiles every
block's norm + MLP before checkpointing (:func:`loongtrain.train.mlp_tiles.apply_mlp_tiling`);
``offload_activations`` runs the checkpointed blocks inside an
:class:`~loongtrain.train.offload.ActivationOffloader` after checkpointing (their kept tensors live on the
host, prefetched one block ahead); ``offload_params`` adds FSDP2's ``CPUOffloadPolicy`` to step 3.

Sharded set-ups never hold the whole model: :func:`parallelize` takes a model built on the meta
device, shards it, allocates only the local shards (``to_empty``), and :func:`materialize_params`
fills each shard from the parameter's full initial value, built on CPU one parameter at a time.

The options are one :class:`~loongtrain.parallel.config.ParallelConfig` (docs/design.md §8). Parameter
names are unchanged (checkpointing replaces the block's ``forward`` on the instance instead of wrapping
the module), so optimizer ordering and DCP checkpoints are layout-independent.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
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

from loongtrain.hf.apply import apply_2d_attention
from loongtrain.hf.families import decoder_layers
from loongtrain.hf.norms import use_rms_norm_function
from loongtrain.parallel.config import ParallelConfig
from loongtrain.parallel.mesh import Mesh
from loongtrain.parallel.runtime import is_distributed
from loongtrain.train.compile import check_compile_options, compile_blocks
from loongtrain.train.mlp_tiles import apply_mlp_tiling
from loongtrain.train.norm_linear import fuse_norm_linear
from loongtrain.train.offload import (
    OFFLOADER_ATTR,
    ActivationOffloader,
    offload_blocks,
    offloaded_blocks,
    pinned_memory_available,
)

# --------------------------------------------------------------------------------------------------
# Activation checkpointing

@functools.cache
def selective_saved_ops() -> tuple[torch._ops.OpOverload, ...]:
    """Ops whose outputs Selective Checkpoint++ keeps from the first forward."""
    import loongtrain.attn.ops  # noqa: F401 - registers torch.ops.loongtrain.*

    return (
        torch.ops.loongtrain.head_all_to_all.default,
        torch.ops.loongtrain.ring_attention.default,
    )


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
    if op in selective_saved_ops():
        if not ctx.is_recompute and not torch.compiler.is_compiling():  # compiled: saved as graph outputs
            _record_saved_output(getattr(ctx, "op_output", None))
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def offloaded_selective_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """:func:`selective_policy` for offloaded blocks: the saved outputs go to the host, so none is
    reported as kept on the device (the offloader reports nothing either: see ``train/offload.py``)."""
    return CheckpointPolicy.MUST_SAVE if op in selective_saved_ops() else CheckpointPolicy.PREFER_RECOMPUTE


#: ``context_fn`` of ``torch.utils.checkpoint`` for Selective Checkpoint++.
selective_context_fn = partial(create_selective_checkpoint_contexts, selective_policy)


def _checkpointed_forward(forward: Callable[..., Any], mode: str, context_fn: Callable[[], Any] | None,
                          *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    if mode == "selective":
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn or selective_context_fn,
                          **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def checkpointed_layers(num_layers: int, fraction: float) -> list[int]:
    """Indices of the blocks to checkpoint: the first ``round(fraction * num_layers)``."""
    return list(range(int(round(fraction * num_layers))))


def apply_activation_checkpointing(layers: nn.ModuleList, mode: str, fraction: float = 1.0, *,
                                   selective_context: Callable[[], Any] | None = None) -> list[int]:
    """Checkpoint the first ``round(fraction * len(layers))`` blocks in ``mode``; return their indices.

    The block's ``forward`` is replaced on the instance (module names and parameters are unchanged);
    forward hooks (FSDP's gather/reshard) still run around the checkpointed region.
    ``selective_context``: the ``context_fn`` of selective blocks (default :data:`selective_context_fn`).
    """
    cfg = ParallelConfig(ac_mode=mode, ac_fraction=fraction)  # validates; 'selective++' -> 'selective'
    if cfg.ac_mode == "none":
        return []
    chosen = checkpointed_layers(len(layers), cfg.ac_fraction)
    for i in chosen:
        block = layers[i]
        original = block.__dict__.get("_loongtrain_forward", block.forward)
        block._loongtrain_forward = original
        block.forward = partial(_checkpointed_forward, original, cfg.ac_mode, selective_context)
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


def fsdp_applies(parallel: ParallelConfig, world_size: int) -> bool:
    """The rule of :func:`uses_fsdp` for a process group of ``world_size`` ranks: ``zero`` is not none and
    the world has > 1 rank (or, with ``offload_params``, any size: FSDP2 does the offload)."""
    return parallel.zero != "none" and (world_size > 1 or parallel.offload_params)


def uses_fsdp(parallel: ParallelConfig) -> bool:
    """Whether :func:`parallelize` shards with FSDP2: a process group exists and :func:`fsdp_applies`."""
    return is_distributed() and fsdp_applies(parallel, dist.get_world_size())


def apply_fsdp(model: nn.Module, mesh: Mesh, parallel: ParallelConfig, device: torch.device,
               param_dtype: torch.dtype | None = None) -> nn.Module:
    """``fully_shard`` each block (:func:`decoder_layers`) and then the root, with gradient divide
    factor ``dp``; with ``param_dtype``, weights are gathered in it and gradients reduced in fp32.

    Must run after :func:`apply_activation_checkpointing`, with the model on ``device`` or on meta.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    world = dist.get_world_size()
    if world != mesh.world_size:
        raise ValueError(f"torch.distributed world size {world} != mesh world size {mesh.world_size}")
    device_mesh = fsdp_device_mesh(device, world, parallel.shard_size(world))
    # cast_forward_inputs=False: RoPE's cos/sin stay fp32 (the block's activations are already bf16)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None,
                              cast_forward_inputs=False)
    opts = {"mesh": device_mesh, "mp_policy": mp, **param_offload_options(parallel, device)}
    for block in decoder_layers(model):
        fully_shard(block, reshard_after_forward=parallel.reshard_after_forward, **opts)
    fully_shard(model, reshard_after_forward=False, **opts)
    # gradient = sum over all dp*sp ranks / dp (see module docstring); FSDP would divide by dp*sp.
    force_sum = device.type != "cuda"  # gloo has neither AVG nor PREMUL_SUM: SUM, then divide
    for module in model.modules():
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(float(mesh.dp))
            module.set_force_sum_reduction_for_comms(force_sum)
    return model


def param_offload_options(parallel: ParallelConfig, device: torch.device) -> dict[str, Any]:
    """``fully_shard`` options of ``--offload-params``: FSDP2's ``CPUOffloadPolicy`` (sharded parameters,
    gradients and so AdamW's states and step on the host; pinned on CUDA when the machine supports it)."""
    if not parallel.offload_params:
        return {}
    from torch.distributed.fsdp import CPUOffloadPolicy

    return {"offload_policy": CPUOffloadPolicy(pin_memory=device.type == "cuda" and pinned_memory_available())}


def _on_meta(model: nn.Module) -> bool:
    return any(p.device.type == "meta" for p in model.parameters())


def parallelize(model: nn.Module, mesh: Mesh, parallel: ParallelConfig, device: torch.device, *,
                param_dtype: torch.dtype | None = None, compile: bool = False) -> nn.Module:
    """Move ``model`` to ``device``, then 2D-Attention on ``mesh`` -> the attention norm fused into q/k/v
    (:func:`~loongtrain.train.norm_linear.fuse_norm_linear`) -> HF norms as one function -> MLP tiling
    -> activation checkpointing -> activation offload -> (with ``compile``) compiled blocks -> FSDP2 (with
    ``offload_params``, CPU offload).

    ``model`` must have decoder blocks (:func:`decoder_layers`). With ``zero="none"`` parameters
    stay plain tensors and the trainer's own gradient all-reduce applies; otherwise they become
    DTensors and the trainer must not all-reduce (``loongtrain.train.sync.needs_grad_sync`` returns
    False). Without an initialised process group (or a world of 1) ``zero`` is ignored
    (:func:`uses_fsdp`). ``param_dtype``: FSDP2's gathered-weight dtype (ignored without FSDP).

    A model on the meta device is sharded first and then allocated on ``device`` (local shards only,
    uninitialised: fill them with :func:`materialize_params`); without FSDP it is allocated whole.
    """

    if not isinstance(parallel, ParallelConfig):
        raise ValueError(f"parallel must be a ParallelConfig; got {type(parallel).__name__}")
    blocks = decoder_layers(model)
    meta = _on_meta(model)
    model = apply_2d_attention(model if meta else model.to(device), mesh)
    fuse_norm_linear(model)  # the attention's input norm inside its q/k/v projections: its output is never kept
    use_rms_norm_function(model)  # HF's Llama-family norms keep only their input (before the tiles wrap them)
    apply_mlp_tiling(model, parallel.mlp_tiles)
    offloader = ActivationOffloader(device, _record_saved_output) if parallel.offload_activations else None
    selective = partial(offloader.selective_contexts, offloaded_selective_policy) if offloader else None
    chosen = apply_activation_checkpointing(blocks, parallel.ac_mode, parallel.ac_fraction,
                                            selective_context=selective)
    if offloader is not None:  # the checkpointed blocks' kept tensors live on the host (train/offload.py)
        offload_blocks(blocks, offloaded_blocks(chosen, parallel.offload_keep), offloader)
        model.__dict__[OFFLOADER_ATTR] = offloader
    if compile:  # docs/design.md §13 (not with activation offload or MLP tiles: check_compile_options)
        check_compile_options(parallel)
        compile_blocks(model, blocks)
    if uses_fsdp(parallel):
        apply_fsdp(model, mesh, parallel, device, param_dtype)
    if meta:
        model.to_empty(device=device)
    return model


@torch.no_grad()
def materialize_params(model: nn.Module, initial: Callable[[str, torch.Size], torch.Tensor]) -> None:
    """Fill every parameter from ``initial(name, full_shape)`` (the whole tensor, any device): plain
    parameters get it whole, FSDP2 DTensors their local shard of it. One full tensor exists at a time,
    so no rank holds the whole model; the result equals initialising an unsharded model in place."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, param in model.named_parameters():
        full = initial(name, param.shape).to(device=param.device, dtype=param.dtype)
        if isinstance(param, DTensor):
            shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            local = param.to_local()
            assert local.shape == shard.to_local().shape, (name, local.shape, shard.to_local().shape)
            local.copy_(shard.to_local())
        else:
            param.copy_(full)
