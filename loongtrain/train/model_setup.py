"""What a run trains: a loongtrain preset or a local Hugging Face model directory (``--model``).

- :func:`hf_model_dir`: the HF directory ``--model`` names (None for a preset).
- :func:`tokenizer_spec`: ``--tokenizer auto`` resolved (the model directory's tokenizer when it has one).
- :func:`model_config_for`: the :class:`ModelConfig` shape of the run (FLOPs, planning, head rules), with
  the model's vocabulary checked against (presets: widened to) the tokenizer's; for a preset, the exact
  model, its RoPE as ``--init-from``'s checkpoint recorded it and changed by ``--rope-theta`` /
  ``--rope-scaling`` (docs/context-extension.md#rope-scaling).
- :func:`hf_run_config`: the HF config a Hugging Face run trains (the directory's, its RoPE taken from
  ``--init-from``'s record and changed by the flags; HF's own modules compute it).
- :func:`hidden_and_head`: one forward to the final normed hidden states and the LM head weight, for
  the chunked loss (:func:`loongtrain.loss.chunked.chunked_cross_entropy`); no logits are built.
- :func:`loss_inputs`: the same forward stopped before the final norm, and the norm, for the trainer's loss.
- :func:`build_model`: the run's model, parallelized (sharded on the meta device under FSDP2), with
  ``--lora``'s adapters on a frozen base (:func:`lora_targets`: the modules they adapt, checked by the launcher).
- :func:`model_record` / :func:`model_from_record`: what a checkpoint records to rebuild the model.
- :func:`init_checkpoint`: the checkpoint ``--init-from`` names and its trainer state.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import nn

from loongtrain.data.tokenizer import Tokenizer, build_tokenizer
from loongtrain.hf.build import (
    build_hf_model,
    build_hf_model_on_meta,
    hf_hidden_and_head,
    hf_initial_weights,
    hf_model_from_config_dict,
    hf_prenorm_hidden_and_head,
    hf_weight_files,
    restore_hf_buffers,
)
from loongtrain.hf.convert import hf_config_with_rope, raw_rope_parameters, shape_config_from_hf
from loongtrain.hf.families import is_hf_model
from loongtrain.hf.load import check_hf_dir, hf_config_from_dict, read_hf_config
from loongtrain.hf.norms import LLAMA_RMS_NORMS
from loongtrain.loss.chunked import FinalNorm
from loongtrain.model.config import PRESETS, ModelConfig, first_difference, get_preset
from loongtrain.model.llama import Transformer, initial_weight
from loongtrain.model.rope_scaling import REFUSED_TYPES
from loongtrain.parallel.mesh import Mesh
from loongtrain.parallelize.compile import compile_enabled
from loongtrain.parallelize.compose import materialize_params, parallelize
from loongtrain.parallelize.lora import find_targets, with_adapters
from loongtrain.parallelize.zero import uses_zero
from loongtrain.sections.model import ModelSection, param_dtype
from loongtrain.train.checkpoint import find_checkpoint, read_trainer_state
from loongtrain.train.config import TrainSections

Tensor = torch.Tensor

AUTO_TOKENIZER = "auto"
#: files that make a directory a Hugging Face tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def hf_model_dir(model: str) -> Path | None:
    """The Hugging Face model directory ``--model`` names, or None when it names a preset.

    ValueError for anything else (naming the presets); the directory itself is checked by
    :func:`model_config_for` (config.json, architecture, weights)."""
    if model in PRESETS:
        return None
    path = Path(model)
    if path.is_dir():
        return path
    if path.is_file():
        raise ValueError(f"--model {model!r} is a file: pass the Hugging Face model directory that holds "
                         f"config.json (and optional *.safetensors), or a preset {sorted(PRESETS)}")
    raise ValueError(f"--model {model!r}: unknown preset and no such directory; presets: {sorted(PRESETS)}, or "
                     f"a local Hugging Face model directory (config.json + optional *.safetensors)")


def tokenizer_spec(cfg: ModelSection) -> str:
    """``--tokenizer`` with ``auto`` resolved: the model directory when it holds a Hugging Face tokenizer,
    else ``byte``."""
    if cfg.tokenizer != AUTO_TOKENIZER:
        return cfg.tokenizer
    directory = hf_model_dir(cfg.model)
    if directory is not None and any((directory / name).is_file() for name in TOKENIZER_FILES):
        return str(directory)
    return "byte"


def build_run_tokenizer(cfg: ModelSection) -> Tokenizer:
    """The run's tokenizer (:func:`tokenizer_spec` built); ValueError naming ``--tokenizer`` when it can't
    be loaded."""
    try:
        return build_tokenizer(tokenizer_spec(cfg))
    except (ImportError, OSError, ValueError) as exc:
        raise ValueError(f"--tokenizer {cfg.tokenizer!r}: {exc}") from None


def model_config_for(cfg: ModelSection, tokenizer: Tokenizer | None = None) -> ModelConfig:
    """The shape of the model ``cfg`` trains. A preset is widened to the tokenizer's vocabulary if that
    is larger; a Hugging Face directory is validated (:func:`loongtrain.hf.check_hf_dir`: config.json,
    a supported architecture, weights matching it) and must hold the tokenizer's vocabulary. With
    ``--init-from``, the checkpoint's model must be this one; a preset then takes the checkpoint's RoPE.
    ``--rope-theta`` / ``--rope-scaling`` change the RoPE last. ValueError naming the problem otherwise."""
    directory = hf_model_dir(cfg.model)
    vocab = int((tokenizer or build_run_tokenizer(cfg)).vocab_size)
    record = _init_record(cfg)
    if directory is None:
        config = get_preset(cfg.model)
        config = get_preset(cfg.model, vocab_size=vocab) if vocab > config.vocab_size else config
        if record is not None:
            config = _same_model(config, ModelConfig(**record["model_config"]), cfg)
        theta, scaling = cfg.rope_change().apply(config.rope_theta, config.rope_scaling)
        return dataclasses.replace(config, rope_theta=theta, rope_scaling=scaling)
    config = shape_config_from_hf(check_hf_dir(directory))
    if vocab > config.vocab_size:
        raise ValueError(f"tokenizer {tokenizer_spec(cfg)!r} has {vocab} tokens but the model {cfg.model!r} has a "
                         f"vocabulary of {config.vocab_size}: pass a --tokenizer that fits the model")
    hf_config = hf_run_config(cfg)
    if record is not None:
        _same_model(config, shape_config_from_hf(hf_config_from_dict(record["hf_config"])), cfg)
    rope_type = raw_rope_parameters(hf_config).get("rope_type")
    if rope_type in REFUSED_TYPES:
        raise ValueError(f"--model {cfg.model!r}: its rope type {rope_type!r} cannot train: "
                         f"{REFUSED_TYPES[rope_type]} (--rope-scaling replaces it)")
    return dataclasses.replace(config, rope_theta=float(raw_rope_parameters(hf_config).get("rope_theta") or 10000.0))


def init_checkpoint(cfg: ModelSection) -> tuple[Path, dict[str, Any]] | None:
    """``(checkpoint directory, trainer state)`` of ``--init-from`` (None without it); ValueError naming
    ``--init-from`` when it names no checkpoint, or one of another model."""
    if not cfg.init_from:
        return None
    try:
        path = find_checkpoint(cfg.init_from)
        state = read_trainer_state(path)
    except ValueError as exc:
        raise ValueError(f"--init-from {cfg.init_from!r}: {exc}") from None
    saved = (state.get("config") or {}).get("model")
    if saved is not None and saved != cfg.model:
        raise ValueError(f"--init-from {cfg.init_from!r} holds a run of --model {saved!r}, not {cfg.model!r}: "
                         f"pass --model {saved}")
    if "model_config" not in state and "hf_config" not in state:
        raise ValueError(f"--init-from {cfg.init_from!r}: the checkpoint records no model (written by an older "
                         f"loongtrain); export it (loongtrain export) and pass the directory as --model")
    return path, state


def _init_record(cfg: ModelSection) -> dict[str, Any] | None:
    found = init_checkpoint(cfg)
    return None if found is None else found[1]


def _same_model(run: ModelConfig, saved: ModelConfig, cfg: ModelSection) -> ModelConfig:
    """``saved`` when it is ``run``'s model up to its RoPE (which ``--init-from`` carries over); ValueError
    naming the first field that differs otherwise."""
    name = first_difference(run, saved)
    if name is not None:
        raise ValueError(f"--init-from {cfg.init_from!r}: its model has {name}={getattr(saved, name)!r}, "
                         f"this run's {getattr(run, name)!r} (same --model and --tokenizer needed)")
    return saved


def hf_run_config(cfg: ModelSection) -> Any:
    """The HF config a Hugging Face run (``--model DIR``) trains: config.json's, with the RoPE of
    ``--init-from``'s checkpoint when given, changed by ``--rope-theta`` / ``--rope-scaling``."""
    directory = hf_model_dir(cfg.model)
    assert directory is not None, "hf_run_config is for Hugging Face model directories"
    config = read_hf_config(directory)
    record = _init_record(cfg)
    if record is not None:
        saved = hf_config_from_dict(record["hf_config"])
        config.rope_parameters = raw_rope_parameters(saved)
        config.max_position_embeddings = saved.max_position_embeddings
    change = cfg.rope_change()
    if change:
        config = hf_config_with_rope(config, change.theta, change.scaling, replace_scaling=change.replace_scaling)
    return config


def hidden_and_head(model: nn.Module, input_ids: Tensor, position_ids: Tensor,
                    cu_seqlens: Any = None, chunk_order: Any = None) -> tuple[Tensor, Tensor]:
    """``(hidden [B, S, dim], head_weight [V, dim])``: the final normed hidden states of one forward and
    the LM head weight (tied or not), so that ``logits = hidden @ head_weight.T``.

    The forward runs through the model's own ``__call__`` (FSDP2's root hooks gather the embedding and
    head; with the root's ``reshard_after_forward=False`` the head is still gathered afterwards).
    loongtrain's decoder: ``return_hidden=True``; a Hugging Face causal LM:
    :func:`loongtrain.hf.build.hf_hidden_and_head` (no logits are computed). ``cu_seqlens`` (packed
    documents) and ``chunk_order`` (the inputs' sharded layout), when given, are passed to the model's
    forward as keywords.
    """
    model_kwargs = {name: value for name, value in (("cu_seqlens", cu_seqlens), ("chunk_order", chunk_order))
                    if value is not None}
    if is_hf_model(model):
        return hf_hidden_and_head(model, input_ids, position_ids, **model_kwargs)
    return model(input_ids, position_ids, return_hidden=True, **model_kwargs), model.head_weight()


def loss_inputs(model: nn.Module, input_ids: Tensor, position_ids: Tensor, cu_seqlens: Any = None,
                chunk_order: Any = None) -> tuple[Tensor, Tensor, FinalNorm | None]:
    """``(hidden, head_weight, norm)`` for the trainer's chunked loss: the hidden states *before* the final
    RMSNorm and that norm (:class:`~loongtrain.loss.chunked.FinalNorm`), so the loss applies it a chunk at a
    time and keeps neither its input nor its output (docs/memory.md). loongtrain's decoder, and HF
    Llama-family norms (:data:`loongtrain.hf.norms.LLAMA_RMS_NORMS`; float64 excepted: HF rounds those
    statistics to float32, see ``hf/norms.py``); otherwise :func:`hidden_and_head` with ``norm=None``."""
    model_kwargs = {name: value for name, value in (("cu_seqlens", cu_seqlens), ("chunk_order", chunk_order))
                    if value is not None}
    if not is_hf_model(model):
        hidden = model(input_ids, position_ids, return_hidden=True, final_norm=False, **model_kwargs)
        return hidden, model.head_weight(), FinalNorm(model.norm.weight, model.norm.eps)
    norm = getattr(model.base_model, "norm", None)
    if type(norm).__name__ in LLAMA_RMS_NORMS and norm.weight.dtype != torch.float64:
        hidden, head, norm = hf_prenorm_hidden_and_head(model, input_ids, position_ids, **model_kwargs)
        return hidden, head, FinalNorm(norm.weight, norm.variance_epsilon, torch.float32)
    return (*hidden_and_head(model, input_ids, position_ids, cu_seqlens, chunk_order), None)


def model_record(model_config: ModelConfig, cfg: ModelSection) -> dict[str, Any]:
    """What a checkpoint records to rebuild the model without the run's inputs (``loongtrain export``):
    ``{"model_config": ModelConfig fields}`` for a preset (vocabulary as trained), ``{"hf_config": the
    directory's config.json}`` for a Hugging Face model."""
    directory = hf_model_dir(cfg.model)
    if directory is None:
        return {"model_config": dataclasses.asdict(model_config)}
    return {"hf_config": hf_run_config(cfg).to_dict()}


def model_from_record(record: dict[str, Any], dtype: torch.dtype = torch.float32) -> nn.Module:
    """An unparallelized model with the structure :func:`model_record` describes (weights: a fixed init,
    to be overwritten by a checkpoint's). ValueError when ``record`` describes no model."""
    if "hf_config" in record:
        return hf_model_from_config_dict(record["hf_config"], dtype)
    if "model_config" in record:
        return Transformer(ModelConfig(**record["model_config"]), seed=0).to(dtype)
    raise ValueError("the checkpoint records no model (neither 'model_config' nor 'hf_config'): it was written "
                     "by an older loongtrain; pass the model")


def build_model(model_config: ModelConfig, cfg: TrainSections, mesh: Mesh, device: torch.device,
                fsdp_param_dtype: torch.dtype | None = None) -> nn.Module:
    """The seeded :class:`Transformer`, parallelized. Under FSDP2 it is built on the meta device,
    sharded, and each rank fills its shards from the parameters' full initial values (one parameter at
    a time, on CPU): no rank holds the whole model, and the weights equal ``Transformer(seed=cfg.optim.seed)``
    bit for bit. ``fsdp_param_dtype``: FSDP2's gathered-weight dtype. A Hugging Face model directory
    (``--model DIR``) with weight files is sharded the same way, each shard read from the files one
    tensor at a time; without FSDP2, or without weight files (a seeded init from the config), it is
    built whole on CPU and then parallelized."""
    options, seed, parallel = cfg.model, cfg.optim.seed, cfg.parallel
    directory = hf_model_dir(options.model)
    steps = dict(compile=compile_enabled(options.compile, device),  # --compile: docs/compile.md
                 lora=options.lora_config(), seed=seed)  # --lora: docs/lora.md
    dtype = param_dtype(options.dtype)
    if directory is not None:
        hf_config = hf_run_config(options)
        if not (uses_zero(parallel) and hf_weight_files(directory)):
            model = build_hf_model(directory, dtype, seed, hf_config)
            return parallelize(model, mesh, parallel, device, **steps)
        model = build_hf_model_on_meta(directory, dtype, hf_config)
        model = parallelize(model, mesh, parallel, device, param_dtype=fsdp_param_dtype, **steps)
        initial = hf_initial_weights(directory)
        materialize_params(model, with_adapters(initial, seed))
        restore_hf_buffers(model, initial)
        return model
    if not uses_zero(parallel):
        model = Transformer(model_config, seed=seed).to(dtype)
        return parallelize(model, mesh, parallel, device, **steps)
    with torch.device("meta"):
        model = Transformer(model_config, seed=None).to(dtype)
    model = parallelize(model, mesh, parallel, device, param_dtype=fsdp_param_dtype, **steps)
    materialize_params(model, with_adapters(lambda name, shape: initial_weight(name, shape, seed), seed))
    return model


def lora_targets(cfg: ModelSection, model_config: ModelConfig) -> list[str]:
    """The modules ``--lora`` adapts (none without it), found on the run's model built on the meta device, so
    the launcher refuses targets that match nothing (naming the valid ones) before any worker starts."""
    lora = cfg.lora_config()
    if lora is None:
        return []
    directory = hf_model_dir(cfg.model)
    if directory is None:
        with torch.device("meta"):
            model = Transformer(model_config, seed=None)
    else:
        model = build_hf_model_on_meta(directory, torch.float32, hf_run_config(cfg))
    return [name for name, _ in find_targets(model, lora)]
