"""The composer: parallelism and the memory modes applied to a plain model from outside, in order
(docs/memory.md). Each step is a module of this room; this file only composes them.

``parallelize(model, mesh, parallel, device)`` moves the model to ``device`` and applies

1. **2D-Attention**: :func:`loongtrain.hf.apply.apply_2d_attention` rebinds every ``attention_fn`` to
   attention over ``mesh``; the attention's input norm is fused into q/k/v
   (:mod:`loongtrain.parallelize.norm_linear`) and HF norms run as one function; with ``lora``, the base
   frozen and LoRA adapters on its target modules (:mod:`loongtrain.parallelize.lora`, docs/lora.md);
2. **MLP tiles** (``mlp_tiles``, :mod:`loongtrain.parallelize.mlp_tiles`): every block's norm + MLP over tiles
   of the local sequence;
3. **recompute** (:mod:`loongtrain.parallelize.recompute`) of the first
   ``round(recompute_fraction * num_layers)`` blocks, full or selective recompute;
4. **activation offload** (``offload_activations``, :mod:`loongtrain.parallelize.offload`): what the recomputed
   blocks keep lives on the host, prefetched one block ahead;
5. **compiled blocks** (``compile=True``, :mod:`loongtrain.parallelize.compile`, docs/compile.md);
6. **hybrid ZeRO** through FSDP2 (:mod:`loongtrain.parallelize.zero`), with ``offload_params`` on the host.

Sharded set-ups never hold the whole model: :func:`parallelize` takes a model built on the meta
device, shards it, allocates only the local shards (``to_empty``), and :func:`materialize_params`
fills each shard from the parameter's full initial value, built on CPU one parameter at a time.

The options are one :class:`~loongtrain.parallel.config.ParallelConfig` (docs/configuration.md). Parameter
names are unchanged (recompute replaces the block's ``forward`` on the instance instead of wrapping
the module), so optimizer ordering and DCP checkpoints are layout-independent.
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from loongtrain.hf.apply import apply_2d_attention
from loongtrain.hf.families import decoder_layers
from loongtrain.hf.moe import bind_moe
from loongtrain.hf.norms import use_rms_norm_function
from loongtrain.model.lora import LoraConfig
from loongtrain.parallel.config import ParallelConfig
from loongtrain.parallel.mesh import Mesh
from loongtrain.parallelize.compile import check_compile_options, compile_blocks
from loongtrain.parallelize.lora import apply_lora
from loongtrain.parallelize.mlp_tiles import apply_mlp_tiling
from loongtrain.parallelize.norm_linear import fuse_norm_linear
from loongtrain.parallelize.offload import OFFLOADER_ATTR, ActivationOffloader, offload_blocks, offloaded_blocks
from loongtrain.parallelize.recompute import apply_recompute, offloaded_selective_policy, record_saved_output
from loongtrain.parallelize.zero import apply_zero, uses_zero


def _on_meta(model: nn.Module) -> bool:
    return any(p.device.type == "meta" for p in model.parameters())


def parallelize(model: nn.Module, mesh: Mesh, parallel: ParallelConfig, device: torch.device, *,
                param_dtype: torch.dtype | None = None, compile: bool = False, lora: LoraConfig | None = None,
                seed: int = 0) -> nn.Module:
    """Move ``model`` to ``device``, then 2D-Attention on ``mesh`` -> the attention norm fused into q/k/v
    (:func:`~loongtrain.parallelize.norm_linear.fuse_norm_linear`) -> HF norms as one function -> with ``lora``,
    LoRA adapters (:func:`~loongtrain.parallelize.lora.apply_lora`, their A drawn from ``seed``) -> MLP tiling
    -> recompute -> activation offload -> (with ``compile``) compiled blocks -> FSDP2 (with
    ``offload_params``, CPU offload).

    ``model`` must have decoder blocks (:func:`decoder_layers`). With ``zero="none"`` parameters
    stay plain tensors and the trainer's own gradient all-reduce applies; otherwise they become
    DTensors and the trainer must not all-reduce (``loongtrain.train.sync.needs_grad_sync`` returns
    False). Without an initialised process group (or a world of 1) ``zero`` is ignored
    (:func:`~loongtrain.parallelize.zero.uses_zero`). ``param_dtype``: FSDP2's gathered-weight dtype
    (ignored without ZeRO).

    A model on the meta device is sharded first and then allocated on ``device`` (local shards only,
    uninitialised: fill them with :func:`materialize_params`); without FSDP it is allocated whole.
    """

    if not isinstance(parallel, ParallelConfig):
        raise ValueError(f"parallel must be a ParallelConfig; got {type(parallel).__name__}")
    blocks = decoder_layers(model)
    meta = _on_meta(model)
    model = apply_2d_attention(model if meta else model.to(device), mesh)
    bind_moe(model)  # HF's sparse MoE blocks run loongtrain's experts and record the router's statistics
    fuse_norm_linear(model)  # the attention's input norm inside its q/k/v projections: its output is never kept
    use_rms_norm_function(model)  # HF's Llama-family norms keep only their input (before the tiles wrap them)
    if lora is not None:  # the base frozen, adapters on the targets (before the tiles and recompute wrap them)
        apply_lora(model, lora, seed)
    apply_mlp_tiling(model, parallel.mlp_tiles)
    offloader = ActivationOffloader(device, record_saved_output) if parallel.offload_activations else None
    selective = partial(offloader.selective_contexts, offloaded_selective_policy) if offloader else None
    chosen = apply_recompute(blocks, parallel.recompute, parallel.recompute_fraction,
                                            selective_context=selective)
    if offloader is not None:  # the recomputed blocks' kept tensors live on the host (parallelize/offload.py)
        offload_blocks(blocks, offloaded_blocks(chosen, parallel.offload_keep), offloader)
        model.__dict__[OFFLOADER_ATTR] = offloader
    if compile:  # docs/compile.md (not with activation offload or MLP tiles: check_compile_options)
        check_compile_options(parallel)
        compile_blocks(model, blocks)
    if uses_zero(parallel):
        apply_zero(model, mesh, parallel, device, param_dtype)
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
