"""Building Hugging Face causal LMs for training (docs/memory.md): whole on CPU, or on the meta device
to be sharded and then filled one tensor at a time, and one forward to the final hidden states.

- :func:`build_hf_model`: the model on CPU in the weight dtype (its weights, or a seeded random init);
- :func:`build_hf_model_on_meta` + :func:`hf_initial_weights` (one tensor at a time) +
  :func:`restore_hf_buffers`: for FSDP2 with weight files, so no rank holds the whole model;
- :func:`hf_hidden_and_head`: hidden states and LM head weight for the chunked loss (and
  :func:`hf_prenorm_hidden_and_head`: the final norm's input instead, with the norm);
- :func:`hf_model_from_config_dict`: the structure a checkpoint records (``loongtrain export``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from loongtrain.hf.expert_files import expert_plan, fuse
from loongtrain.hf.families import check_architecture
from loongtrain.hf.load import check_hf_dir, hf_config_from_dict, load_hf_model
from loongtrain.hf.moe import router_stats

Tensor = torch.Tensor


def build_hf_model(directory: str | Path, dtype: torch.dtype, seed: int, config: Any = None) -> nn.Module:
    """The HF causal LM of ``directory`` on CPU in ``dtype``: its weights, or without weight files a
    random init from the config seeded with ``seed`` (the same on every rank). ``config``: the HF config
    to build instead of the directory's (e.g. its RoPE changed)."""
    model = load_hf_model(directory, dtype=dtype, seed=seed, config=config)
    model.config.use_cache = False
    return model


def hf_weight_files(directory: str | Path) -> list[Path]:
    """The ``*.safetensors`` files of a model directory (sorted; empty: initialise from the config)."""
    return sorted(Path(directory).glob("*.safetensors"))


def build_hf_model_on_meta(directory: str | Path, dtype: torch.dtype, config: Any = None) -> nn.Module:
    """The HF causal LM of ``directory`` on the meta device (no memory), its weight files checked against
    it; fill it after sharding with :func:`hf_initial_weights` and :func:`restore_hf_buffers`. ``config``:
    the HF config to build instead of the directory's (same tensor shapes, e.g. its RoPE changed)."""
    from transformers import AutoModelForCausalLM

    checked = check_hf_dir(directory)
    config = copy.deepcopy(config) if config is not None else checked
    config.use_cache = False
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.to(dtype)


def hf_initial_weights(directory: str | Path) -> Callable[[str, torch.Size], Tensor]:
    """``initial(name, shape)`` for :func:`loongtrain.parallelize.compose.materialize_params`: the tensor
    ``name`` read alone from the directory's safetensors files (a tied head reads the embedding)."""
    from safetensors import safe_open

    where: dict[str, Path] = {}
    for file in hf_weight_files(directory):
        with safe_open(str(file), framework="pt") as handle:
            where.update(dict.fromkeys(handle.keys(), file))
    plan = expert_plan(where)  # MoE checkpoints: per-expert tensors, fused on reading

    def read(name: str) -> Tensor:
        assert name in where, f"{name} is in no weight file (check_hf_dir let it through)"
        with safe_open(str(where[name]), framework="pt") as handle:
            return handle.get_tensor(name)

    def initial(name: str, shape: torch.Size) -> Tensor:
        if name in plan:
            how, sources = plan[name]
            tensor = fuse(how, [[read(source) for source in group] for group in sources])
        else:
            tensor = read(name)
        assert tensor.shape == shape, (name, tensor.shape, shape)
        return tensor

    return initial


@torch.no_grad()
def restore_hf_buffers(model: nn.Module, initial: Callable[[str, torch.Size], Tensor] | None = None) -> None:
    """Fill the buffers of a model allocated with ``to_empty`` (their values are garbage): the rotary embeddings'
    inverse frequencies, rebuilt from the config as the model's constructor does, and the buffers the weight
    files hold (``initial(name, shape)``, :func:`hf_initial_weights`: DeepSeek-V3's score-correction biases;
    without ``initial`` such a buffer is a ValueError)."""
    persistent = set(model.state_dict())
    for prefix, module in model.named_modules():
        buffers = dict(module.named_buffers(recurse=False))
        if not buffers:
            continue
        if not type(module).__name__.endswith("RotaryEmbedding"):
            names = {name: f"{prefix}.{name}" if prefix else name for name in buffers}
            unknown = sorted(name for name, full in names.items() if full not in persistent or initial is None)
            if unknown:
                raise ValueError(f"{type(module).__name__} holds buffers {unknown} that loongtrain cannot rebuild "
                                 f"after sharding on the meta device")
            for name, full in names.items():
                buffers[name].copy_(initial(full, buffers[name].shape))
            continue
        with torch.device("cpu"):
            fresh = type(module)(config=getattr(module, "config", model.config))
        for name, value in fresh.named_buffers(recurse=False):
            buffers[name].copy_(value)


def hf_hidden_and_head(model: nn.Module, input_ids: Tensor, position_ids: Tensor,
                       **model_kwargs: Any) -> tuple[Tensor, Tensor]:
    """``(last_hidden_state, lm_head weight)`` of one forward of an HF causal LM, with ``logits_to_keep`` an
    empty index so that no logits are computed (the chunked loss builds them a chunk at a time)."""
    if router_stats(model) is not None:  # bound MoE blocks: the router's statistics are loongtrain's
        model_kwargs["output_router_logits"] = False
    captured: list[Tensor] = []
    handle = model.base_model.register_forward_hook(
        lambda _module, _args, output: captured.append(output.last_hidden_state))
    try:
        no_logits = torch.empty(0, dtype=torch.long, device=input_ids.device)
        model(input_ids=input_ids, position_ids=position_ids, logits_to_keep=no_logits, use_cache=False,
              **model_kwargs)
    finally:
        handle.remove()
    assert len(captured) == 1, "the base model ran more than once"
    return captured[0], model.get_output_embeddings().weight


def hf_prenorm_hidden_and_head(model: nn.Module, input_ids: Tensor, position_ids: Tensor,
                               **model_kwargs: Any) -> tuple[Tensor, Tensor, nn.Module]:
    """``(final norm's input, lm_head weight, the final norm module)`` of one forward of an HF causal LM (the
    base model's ``norm``; ValueError if it has none): the hidden states before the final norm, for a loss
    that applies the norm itself. The model's own norm still runs; its output is dropped."""
    norm = getattr(model.base_model, "norm", None)
    if not isinstance(norm, nn.Module):
        raise ValueError(f"{type(model.base_model).__name__} has no final 'norm' module")
    captured: list[Tensor] = []
    handle = norm.register_forward_pre_hook(lambda _module, args: captured.append(args[0]))
    try:
        _, head = hf_hidden_and_head(model, input_ids, position_ids, **model_kwargs)
    finally:
        handle.remove()
    assert len(captured) == 1, "the final norm ran more than once"
    return captured[0], head, norm


def hf_model_from_config_dict(values: dict[str, Any], dtype: torch.dtype = torch.float32) -> nn.Module:
    """An HF causal LM (fixed init) from a config.json's dict, e.g. the one a checkpoint records; its
    architectures must be supported."""
    from transformers import AutoModelForCausalLM

    hf_config = hf_config_from_dict(values)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    for name in hf_config.architectures or [type(model).__name__]:
        check_architecture(name, model)
    return model.to(dtype)
