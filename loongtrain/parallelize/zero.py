"""Hybrid ZeRO (``--zero full|hybrid``) through FSDP2's ``fully_shard`` (docs/memory.md).

The ``dp x sp`` ranks all hold the same weights, so parameters, gradients and optimizer state are sharded
over all of them (``zero="full"``) or over consecutive groups of ``zero_shard_size`` ranks, replicated
across groups (``zero="hybrid"``: HSDP on a 2-D ``(replicate, shard)`` DeviceMesh). Each rank
back-propagates ``local_sum / replica_tokens`` (:func:`loongtrain.loss.sharded.sharded_cross_entropy`), so
the exact gradient is the SUM over a replica's ``sp`` ranks AVERAGED over the ``dp`` replicas, i.e. ``sum
over all ranks / dp``: the gradient divide factor is set to ``dp`` (FSDP's default would divide by ``dp *
sp``). ``reshard_after_forward`` chooses between freeing gathered weights after each block's forward
(re-gathered for backward) and keeping them until backward; the root (embedding, final norm, LM head)
always keeps them: the loss reads the head weight after the model's forward. With ``param_dtype`` (bf16
runs) ``MixedPrecisionPolicy(param_dtype, reduce_dtype=float32)`` gathers bf16 weights and reduces fp32
gradients into the fp32 shards. ``--offload-params`` adds FSDP2's ``CPUOffloadPolicy``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from loongtrain.hf.families import decoder_layers
from loongtrain.parallel.config import ParallelConfig
from loongtrain.parallel.mesh import Mesh
from loongtrain.parallel.runtime import is_distributed
from loongtrain.parallelize.offload import pinned_memory_available

_DEVICE_MESHES: dict[tuple[str, tuple[int, ...]], Any] = {}


def zero_device_mesh(device: torch.device, world_size: int, shard_size: int) -> Any:
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


def zero_applies(parallel: ParallelConfig, world_size: int) -> bool:
    """The rule of :func:`uses_zero` for a process group of ``world_size`` ranks: ``zero`` is not none and
    the world has > 1 rank (or, with ``offload_params``, any size: FSDP2 does the offload)."""
    return parallel.zero != "none" and (world_size > 1 or parallel.offload_params)


def uses_zero(parallel: ParallelConfig) -> bool:
    """Whether :func:`parallelize` shards with FSDP2: a process group exists and :func:`zero_applies`."""
    return is_distributed() and zero_applies(parallel, dist.get_world_size())


def apply_zero(model: nn.Module, mesh: Mesh, parallel: ParallelConfig, device: torch.device,
               param_dtype: torch.dtype | None = None) -> nn.Module:
    """``fully_shard`` each block (:func:`decoder_layers`) and then the root, with gradient divide
    factor ``dp``; with ``param_dtype``, weights are gathered in it and gradients reduced in fp32.

    Must run after recompute (:mod:`loongtrain.parallelize.recompute`), with the model on ``device`` or on meta.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    world = dist.get_world_size()
    if world != mesh.world_size:
        raise ValueError(f"torch.distributed world size {world} != mesh world size {mesh.world_size}")
    device_mesh = zero_device_mesh(device, world, parallel.shard_size(world))
    # cast_forward_inputs=False: RoPE's cos/sin stay fp32 (the block's activations are already bf16)
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None,
                              cast_forward_inputs=False)
    opts = {"mesh": device_mesh, "mp_policy": mp, **param_offload_options(parallel, device)}
    for block in decoder_layers(model):
        fully_shard(block, reshard_after_forward=parallel.reshard_after_forward, **opts)
    fully_shard(model, reshard_after_forward=False, **opts)
    # gradient = sum over all dp*sp ranks / dp (module docstring); FSDP would divide by dp*sp.
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

