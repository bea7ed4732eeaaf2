"""Load a supported Hugging Face causal LM from a local directory (config.json + optional safetensors).

Never touches the network: the directory must hold ``config.json``; its ``*.safetensors`` files
(one or several shards), if any, must match the config exactly. Without weight files the model is
initialised from the config with a fixed seed (the same on every rank).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from loongtrain.hf.families import check_architecture

# buffers older checkpoints saved that current models recompute
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_hf_config(path: str | Path) -> Any:
    """The HF config of the model directory ``path`` (no weights read).

    Raises ValueError for a directory without config.json, a config transformers cannot read, or an
    unsupported architecture (listing the supported ones).
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"{str(path)!r} is not a Hugging Face model directory: it has no config.json")
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"{str(path / 'config.json')!r} is not a config transformers can read: {exc}") from None
    for name in getattr(config, "architectures", None) or []:
        check_architecture(name)
    model_class = AutoModelForCausalLM._model_mapping.get(type(config), None)
    check_architecture(getattr(model_class, "__name__", f"{type(config).__name__} (no causal LM class)"))
    return config


def check_hf_dir(path: str | Path) -> Any:
    """Validate the model directory ``path`` without loading its weights; return its HF config.

    Besides :func:`read_hf_config`'s checks, the names and shapes in the ``*.safetensors`` headers must
    be exactly the tensors of the model built from config.json (ValueError naming the tensor otherwise).
    """
    from transformers import AutoModelForCausalLM

    config = read_hf_config(path)
    files = sorted(Path(path).glob("*.safetensors"))
    if files:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        _check_weights(model, _read_shapes(files))
    return config


def load_hf_model(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> nn.Module:
    """The HF causal LM in ``path`` (config.json + optional weights) as ``dtype`` on ``device``.

    Weights are checked against the config before loading. Raises ValueError for a directory
    without config.json, an unsupported architecture, or weights that do not match the config
    (naming the tensor and both shapes, or the missing / unexpected tensor names).
    """
    from transformers import AutoModelForCausalLM

    config = read_hf_config(path)
    with torch.random.fork_rng(devices=[]):  # the global RNG is left as it was
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    files = sorted(Path(path).glob("*.safetensors"))
    if files:
        state = _read_safetensors(files)
        _check_weights(model, state)
        model.load_state_dict(state, strict=False)  # names verified; tied heads stay tied
    return model.to(device=device, dtype=dtype)


def _read_shapes(files: list[Path]) -> dict[str, torch.Size]:
    """Tensor name -> shape from the safetensors headers (no tensor data is read)."""
    from safetensors import safe_open

    shapes: dict[str, torch.Size] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    if name in shapes:
                        raise ValueError(f"tensor {name!r} appears in more than one weight file (second: {file.name})")
                    shapes[name] = torch.Size(handle.get_slice(name).get_shape())
        except (OSError, RuntimeError) as exc:  # safetensors raises SafetensorError (a RuntimeError kind)
            raise ValueError(f"weight file {str(file)!r} is not a readable safetensors file: {exc}") from None
    return shapes


def _read_safetensors(files: list[Path]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in load_file(str(file)).items():
            if name in state:
                raise ValueError(f"tensor {name!r} appears in more than one weight file (second: {file.name})")
            state[name] = tensor
    return state


def _check_weights(model: nn.Module, state: dict[str, Any]) -> None:
    """Raise ValueError unless ``state`` (name -> tensor or shape) holds exactly ``model``'s tensors with
    the same shapes (a tied ``lm_head`` and recomputed buffers may be absent; they are dropped)."""
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    optional = {"lm_head.weight"} if tied else set()
    for name in list(state):
        if name.endswith(_IGNORED_SUFFIXES) or (name in optional):
            state.pop(name)
    for name, tensor in sorted(state.items()):
        shape = tuple(getattr(tensor, "shape", tensor))
        if name not in expected:
            raise ValueError(
                f"weight {name!r} (shape {shape}) is not a tensor of {type(model).__name__} built from config.json"
            )
        if shape != expected[name]:
            raise ValueError(f"weight {name!r} has shape {shape} but config.json needs {expected[name]}")
    missing = sorted(set(expected) - set(state) - optional)
    if missing:
        raise ValueError(f"weights missing from the safetensors files: {missing[:8]}"
                         + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
