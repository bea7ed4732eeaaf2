"""Load a supported Hugging Face causal LM from a local directory (config.json + optional safetensors).

Never touches the network: the directory must hold ``config.json``; its ``*.safetensors`` files
(one or several shards), if any, must match the config exactly. Without weight files the model is
initialised from the config with a fixed seed (the same on every rank).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from loongtrain.hf.families import check_architecture

# buffers older checkpoints saved that current models recompute
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


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
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"{str(path)!r} is not a Hugging Face model directory: it has no config.json")
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    for name in getattr(config, "architectures", None) or []:
        check_architecture(name)
    model_class = AutoModelForCausalLM._model_mapping.get(type(config), None)
    check_architecture(getattr(model_class, "__name__", f"{type(config).__name__} (no causal LM class)"))
    with torch.random.fork_rng(devices=[]):  # the global RNG is left as it was
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    files = sorted(path.glob("*.safetensors"))
    if files:
        state = _read_safetensors(files)
        _check_weights(model, state)
        model.load_state_dict(state, strict=False)  # names verified; tied heads stay tied
    return model.to(device=device, dtype=dtype)


def _read_safetensors(files: list[Path]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in load_file(str(file)).items():
            if name in state:
                raise ValueError(f"tensor {name!r} appears in more than one weight file (second: {file.name})")
            state[name] = tensor
    return state


def _check_weights(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Raise ValueError unless ``state`` holds exactly ``model``'s tensors with the same shapes."""
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    optional = {"lm_head.weight"} if tied else set()
    for name in list(state):
        if name.endswith(_IGNORED_SUFFIXES) or (name in optional):
            state.pop(name)
    for name, tensor in sorted(state.items()):
        if name not in expected:
            raise ValueError(
                f"weight {name!r} (shape {tuple(tensor.shape)}) is not a tensor of "
                f"{type(model).__name__} built from config.json"
            )
        if tuple(tensor.shape) != expected[name]:
            raise ValueError(
                f"weight {name!r} has shape {tuple(tensor.shape)} but config.json needs {expected[name]}"
            )
    missing = sorted(set(expected) - set(state) - optional)
    if missing:
        raise ValueError(f"weights missing from the safetensors files: {missing[:8]}"
                         + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
