"""Load a supported Hugging Face causal LM from a local directory (config.json + optional safetensors).

Never touches the network: the directory must hold ``config.json``; its ``*.safetensors`` files
(one or several shards), if any, must match the config exactly. Without weight files the model is
initialised from the config with a fixed seed (the same on every rank).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from loongtrain.hf.expert_files import fuse_shapes, fuse_tensors
from loongtrain.hf.families import SUPPORTED_ARCHITECTURES, check_architecture
from loongtrain.hf.moe import moe_layout

log = logging.getLogger(__name__)

# buffers older checkpoints saved that current models recompute
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_hf_config(path: str | Path) -> Any:
    """The HF config of the model directory ``path`` (no weights read).

    Raises ValueError for a directory without config.json, a config transformers cannot read, or an
    architecture whose layers do not match (naming what differs; docs/hf-models.md#families).
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"{str(path)!r} is not a Hugging Face model directory: it has no config.json")
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = read_config_json(path / "config.json")
    if raw.get("quantization_config"):
        method = raw["quantization_config"].get("quant_method", "?") if isinstance(raw["quantization_config"], dict) \
            else "?"
        raise ValueError(f"{str(path / 'config.json')!r} has a quantization_config (quant_method={method!r}): "
                         f"loongtrain trains unquantized weights; convert the checkpoint to bf16 or fp32 first")
    try:
        check_stated_sizes(raw, path / "config.json")
        sizes_error = None
    except ValueError as exc:  # raised after the architecture's check: an unsupported one is named first
        sizes_error = exc
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - whatever transformers raises, the file is the problem
        if sizes_error is not None:
            raise sizes_error from None
        raise ValueError(f"{str(path / 'config.json')!r} is not a config transformers can read: "
                         f"{type(exc).__name__}: {exc}") from None
    model_class = AutoModelForCausalLM._model_mapping.get(type(config), None)
    names = {*(getattr(config, "architectures", None) or []),
             getattr(model_class, "__name__", f"{type(config).__name__} (no causal LM class)")}
    if model_class is None:
        check_architecture(min(names, key=lambda n: "no causal LM class" not in n))
    if not names <= set(SUPPORTED_ARCHITECTURES):  # a family not tested by name: checked by its structure
        model = build_on_meta(config, path / "config.json")
        for name in sorted(names):
            check_architecture(name, model)
    try:
        moe_layout(config)  # experts and top-k that fit each other
    except ValueError as exc:
        raise ValueError(f"{str(path / 'config.json')!r}: {exc}") from None
    if sizes_error is not None:
        raise sizes_error
    return config


def hf_config_from_dict(values: dict[str, Any]) -> Any:
    """The HF config object of a config.json's dict (e.g. the one a checkpoint records); its
    ``model_type`` picks the class."""
    from transformers import AutoConfig

    values = dict(values)
    return AutoConfig.for_model(values.pop("model_type"), **values)


#: sizes a config.json must state itself: transformers' defaults for them describe a 7B model
REQUIRED_SIZES = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")


def read_config_json(file: Path) -> dict[str, Any]:
    """The raw JSON object of a config.json; ValueError naming the file when it is not one."""
    import json

    try:
        raw = json.loads(file.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{str(file)!r} is not a readable JSON file: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{str(file)!r} must hold a JSON object; it holds a {type(raw).__name__}")
    return raw


def check_stated_sizes(raw: dict[str, Any], file: Path) -> None:
    """ValueError unless the raw config.json states every size in :data:`REQUIRED_SIZES` (under its
    name or an alias of its ``model_type``'s ``attribute_map``) as a positive integer, naming the
    missing keys: a size transformers would fill in from its defaults is not the user's model."""
    from transformers import CONFIG_MAPPING

    model_type = raw.get("model_type")
    config_class = CONFIG_MAPPING[model_type] if isinstance(model_type, str) and model_type in CONFIG_MAPPING else None
    stored_as = getattr(config_class, "attribute_map", {}) or {}  # e.g. GPT-2: hidden_size -> n_embd
    missing, bad = [], []
    for name in REQUIRED_SIZES:
        keys = [name, *([stored_as[name]] if name in stored_as else [])]
        stated = [k for k in keys if k in raw]
        if not stated:
            missing.append(name)
            continue
        value = raw[stated[0]]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            bad.append(f"{stated[0]}={value!r}")
    if missing:
        raise ValueError(f"{str(file)!r} does not state {missing}: the model's sizes must be given, not taken "
                         f"from transformers' defaults (a 7B model)")
    if bad:
        raise ValueError(f"{str(file)!r}: {', '.join(bad)} must be "
                         + ("positive integers" if len(bad) > 1 else "a positive integer"))


def check_config_architectures(hf_config: Any) -> None:
    """ValueError (one line) unless every ``architectures`` entry of the HF config object is a tested family or,
    built on the meta device, has layers that match (:func:`~loongtrain.hf.families.check_architecture`)."""
    names = list(getattr(hf_config, "architectures", None) or [])
    if set(names) <= set(SUPPORTED_ARCHITECTURES):
        return
    model = build_on_meta(hf_config, Path("config.json"))
    for name in names:
        check_architecture(name, model)


def build_on_meta(config: Any, file: Path) -> nn.Module:
    """The causal LM of ``config`` on the meta device (no memory), so that every error of the config
    (an unknown ``hidden_act``, sizes that do not divide) surfaces here, as ValueError naming ``file``."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001 - any failure to build is the config's
        raise ValueError(f"{str(file)!r}: the model cannot be built from it: {type(exc).__name__}: {exc}") from None


def check_hf_dir(path: str | Path) -> Any:
    """Validate the model directory ``path`` without loading its weights; return its HF config.

    Besides :func:`read_hf_config`'s checks, the names and shapes in the ``*.safetensors`` headers must
    be exactly the tensors of the model built from config.json (ValueError naming the tensor otherwise).
    """
    config = read_hf_config(path)
    model = build_on_meta(config, Path(path) / "config.json")  # with or without weights (docs/launching.md)
    check_architecture(type(model).__name__, model)  # by structure, the tested families too
    files = sorted(Path(path).glob("*.safetensors"))
    if files:
        _check_weights(model, fuse_shapes(_read_shapes(files)))
    return config


def load_hf_model(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    config: Any = None,
) -> nn.Module:
    """The HF causal LM in ``path`` (config.json + optional weights) as ``dtype`` on ``device``; ``config``:
    the HF config to build instead of config.json's (e.g. with its RoPE changed; same tensor shapes).

    Weights are checked against the config before loading. Raises ValueError for a directory
    without config.json, an unsupported architecture, or weights that do not match the config
    (naming the tensor and both shapes, or the missing / unexpected tensor names).
    """
    from transformers import AutoModelForCausalLM

    config = config if config is not None else read_hf_config(path)
    with torch.random.fork_rng(devices=[]):  # the global RNG is left as it was
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    files = sorted(Path(path).glob("*.safetensors"))
    if files:
        state = fuse_tensors(_read_safetensors(files))  # per-expert tensors of MoE checkpoints fused
        _check_weights(model, state)
        model.load_state_dict(state, strict=False)  # names verified; tied heads stay tied
    return model.to(device=device, dtype=dtype)


def _read_shapes(files: list[Path]) -> dict[str, torch.Size]:
    """Tensor name -> shape from the safetensors headers (no tensor data is read)."""
    from safetensors import safe_open

    shapes: dict[str, torch.Size] = {}
    for file in files:
        check_safetensors_size(file)
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    if name in shapes:
                        raise ValueError(f"tensor {name!r} appears in more than one weight file (second: {file.name})")
                    shapes[name] = torch.Size(handle.get_slice(name).get_shape())
        except ValueError:
            raise
        except Exception as exc:  # noqa: BLE001 - safetensors' own error class derives from Exception
            raise ValueError(f"weight file {str(file)!r} is not a readable safetensors file: "
                             f"{type(exc).__name__}: {exc}") from None
    return shapes


def check_safetensors_size(file: Path) -> None:
    """ValueError naming ``file`` unless its header parses and its length is exactly the 8-byte header
    size, the header and the tensor bytes the header places (a cut or padded file fails here)."""
    import json

    size = file.stat().st_size
    try:
        with file.open("rb") as handle:
            head = handle.read(8)
            header_len = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 < header_len <= size - 8:
                raise ValueError(f"a header of {header_len} bytes in a file of {size}")
            header = json.loads(handle.read(header_len).decode("utf-8"))
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except Exception as exc:  # noqa: BLE001 - any failure to read the header is a corrupt file
        raise ValueError(f"weight file {str(file)!r} is not a readable safetensors file (header: {exc})") from None
    if size != 8 + header_len + end:
        raise ValueError(f"weight file {str(file)!r} has {size} bytes but its header needs {8 + header_len + end} "
                         f"(truncated or corrupt)")


def _read_safetensors(files: list[Path]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors = load_file(str(file))
        except Exception as exc:  # noqa: BLE001 - safetensors' own error class derives from Exception
            raise ValueError(f"weight file {str(file)!r} is not a readable safetensors file: "
                             f"{type(exc).__name__}: {exc}") from None
        for name, tensor in tensors.items():
            if name in state:
                raise ValueError(f"tensor {name!r} appears in more than one weight file (second: {file.name})")
            state[name] = tensor
    return state


def _check_weights(model: nn.Module, state: dict[str, Any]) -> None:
    """Raise ValueError unless ``state`` (name -> tensor or shape) holds exactly ``model``'s tensors with
    the same shapes (a tied ``lm_head`` and recomputed buffers may be absent; they are dropped, and so, with a
    warning naming them, are the tensors the model class itself declares not part of it, e.g. DeepSeek-V3's
    multi-token-prediction layer: ``_keys_to_ignore_on_load_unexpected``)."""
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    optional = {"lm_head.weight"} if tied else set()
    not_part = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []]
    ignored = []
    for name in list(state):
        if name.endswith(_IGNORED_SUFFIXES) or (name in optional):
            state.pop(name)
        elif name not in expected and any(p.search(name) for p in not_part):
            ignored.append(state.pop(name))
    if ignored:
        log.warning("%d tensors of the weight files (experts fused) are not part of %s (its "
                    "_keys_to_ignore_on_load_unexpected, e.g. a multi-token-prediction layer): not loaded, and not "
                    "in what loongtrain exports",
                    len(ignored), type(model).__name__)
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
