"""loongtrain's LLaMA decoder <-> Hugging Face ``LlamaForCausalLM``: config, weight names, export.

Both use the split-halves RoPE convention (pair ``i`` with ``i + head_dim/2``, HF's ``rotate_half``),
so q/k projection weights map without any permutation; RoPE scaling (``linear``, ``yarn``, ``llama3``) maps
to ``rope_parameters`` and back (an older ``rope_scaling`` + ``rope_theta`` is read too, and written next to
``rope_parameters`` on export for readers that know only those); names map one to one:

    tok_embeddings            model.embed_tokens          norm     model.norm      output  lm_head
    layers.i.attention.wq/wk/wv/wo        model.layers.i.self_attn.q_proj/k_proj/v_proj/o_proj
    layers.i.feed_forward.w1/w2/w3        model.layers.i.mlp.gate_proj/down_proj/up_proj
    layers.i.attention_norm / ffn_norm    model.layers.i.input_layernorm / post_attention_layernorm
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from loongtrain._files import save_safetensors
from loongtrain.hf.families import check_architecture, is_hf_model, supported_architectures
from loongtrain.hf.load import check_config_architectures
from loongtrain.hf.moe import moe_layout
from loongtrain.model.config import LINEAR_FIELDS, ModelConfig
from loongtrain.model.rope_scaling import DEFAULT, RopeScaling, rope_scaling_from_mapping

Tensor = torch.Tensor

_GLOBAL_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}


def hf_config_from_model_config(config: ModelConfig, *, max_position_embeddings: int | None = None) -> Any:
    """The ``LlamaConfig`` of the same decoder. ``max_position_embeddings`` is metadata for the RoPE types
    loongtrain trains (default: ``original_max_position_embeddings * factor`` with a scaling that has
    one, else 8192)."""
    from transformers import LlamaConfig

    if config.attention_sinks:
        raise ValueError("attention_sinks=True has no LlamaForCausalLM equivalent (gpt-oss's sinks: train and export "
                         "the HF GptOssForCausalLM itself)")
    if config.layer_types is not None and "sliding_attention" in config.layer_types:
        raise ValueError(f"layer_types={list(config.layer_types)} (sliding layers) have no LlamaForCausalLM "
                         f"equivalent")
    scaling = config.rope_scaling
    if max_position_embeddings is None:
        original = scaling.original_max_position_embeddings if scaling is not None else None
        max_position_embeddings = round(original * scaling.factor) if original else 8192
    hf_config = LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.dim,
        intermediate_size=config.ffn_dim,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        hidden_act="silu",
        rms_norm_eps=config.norm_eps,
        rope_parameters=rope_parameters(config.rope_theta, scaling),
        tie_word_embeddings=config.tie_embeddings,
        attention_bias=config.attention_bias,
        mlp_bias=False,
        attention_dropout=0.0,
        max_position_embeddings=max_position_embeddings,
    )
    hf_config.architectures = ["LlamaForCausalLM"]
    return hf_config


def rope_parameters(theta: float, scaling: RopeScaling | None) -> dict[str, Any]:
    """HF's ``rope_parameters`` for base ``theta`` and ``scaling``."""
    extra = scaling.hf_parameters() if scaling is not None else {"rope_type": DEFAULT}
    return {**extra, "rope_theta": float(theta)}


def raw_rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The RoPE entries of an HF config object or config.json dict: ``rope_parameters``, or the older
    ``rope_scaling`` with the top-level ``rope_theta`` (``{}`` when it states none)."""
    get = hf_config.get if isinstance(hf_config, dict) else lambda name: getattr(hf_config, name, None)
    params = get("rope_parameters") or get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"rope_parameters={params!r} must be a dict")
    params = dict(params)
    if "rope_theta" not in params and get("rope_theta") is not None:
        params["rope_theta"] = get("rope_theta")
    return params


def rope_from_hf(hf_config: Any) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, scaling)`` of an HF config (object or dict); ValueError naming a RoPE type or key
    loongtrain's decoder does not implement (``dynamic`` with the reason it cannot train)."""
    params = raw_rope_parameters(hf_config)
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"rope_parameters per layer type ({sorted(params)}) have no loongtrain equivalent")
    theta = float(params.get("rope_theta") or 10000.0)
    return theta, rope_scaling_from_mapping(params)


def model_config_from_hf(hf_config: Any) -> ModelConfig:
    """The loongtrain :class:`ModelConfig` of an HF Llama config, RoPE scaling included; ValueError for
    features it lacks."""
    architectures = getattr(hf_config, "architectures", None) or ["LlamaForCausalLM"]
    if architectures != ["LlamaForCausalLM"]:
        raise ValueError(f"only LlamaForCausalLM maps onto loongtrain's model; got architectures={architectures}")
    unsupported = {
        "hidden_act": (hf_config.hidden_act, "silu"),
        "mlp_bias": (hf_config.mlp_bias, False),
    }
    for name, (value, needed) in unsupported.items():
        if value != needed:
            raise ValueError(f"{name}={value!r} has no loongtrain equivalent (needs {needed!r})")
    theta, scaling = rope_from_hf(hf_config)
    return dataclasses.replace(shape_config_from_hf(hf_config), rope_theta=theta, rope_scaling=scaling,
                               attention_bias=bool(hf_config.attention_bias))


def hf_config_with_rope(hf_config: Any, theta: float | None = None, scaling: RopeScaling | None = None, *,
                        replace_scaling: bool = False) -> Any:
    """A copy of an HF config with its RoPE changed: base ``theta`` (None: kept) and, with
    ``replace_scaling``, ``scaling`` in place of the config's own (None: plain RoPE). A scaling with an
    ``original_max_position_embeddings`` raises ``max_position_embeddings`` to ``original * factor``.
    HF's own rotary embeddings then compute it (the model keeps HF's modules)."""
    config = _copy_config(hf_config)
    params = raw_rope_parameters(config)
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"rope_parameters per layer type ({sorted(params)}): --rope-theta/--rope-scaling cannot "
                         f"change them")
    if replace_scaling:
        params = rope_parameters(params.get("rope_theta", 10000.0), scaling)
    if theta is not None:
        params["rope_theta"] = float(theta)
    params.setdefault("rope_type", DEFAULT)
    config.rope_parameters = params
    original = params.get("original_max_position_embeddings")
    if replace_scaling and scaling is not None and original:
        config.max_position_embeddings = max(int(config.max_position_embeddings or 0), round(original * scaling.factor))
    return config


def shape_config_from_hf(hf_config: Any) -> ModelConfig:
    """The :class:`ModelConfig` with the shape of any supported HF causal LM, for planning and FLOPs.

    Layers, hidden size, heads, KV heads, head_dim (which may differ from hidden/heads), FFN width,
    vocabulary, tied head, RoPE theta, norm eps, the experts (:func:`loongtrain.hf.moe.moe_layout`: which layers,
    how many, top-k, their width, the shared experts' width), MLA's latent ranks and head dims (DeepSeek-V3), and
    the sliding window with, when only some layers use it, the ``layer_types`` (each layer planned with its own
    window). qkv biases and q/k norms are ignored
    (negligible for cost); :func:`model_config_from_hf` is the exact mapping.
    """
    check_config_architectures(hf_config)
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    window = getattr(hf_config, "sliding_window", None) or None  # HF: None (or 0) for none
    layer_types = tuple(getattr(hf_config, "layer_types", None) or ())
    linear = _linear_shape(hf_config) if "linear_attention" in layer_types else {}
    if linear:  # linear and softmax layers, each planned as its kind
        window = window if "sliding_attention" in layer_types else None
    elif window is None or "sliding_attention" not in layer_types:  # every layer full (a window HF does not use)
        window, layer_types = (window, ()) if not layer_types else (None, ())
    elif set(layer_types) == {"sliding_attention"}:  # every layer windowed
        layer_types = ()
    moe = moe_layout(hf_config)
    experts = {} if moe is None else dict(num_experts=moe.num_experts, top_k=moe.top_k, moe_ffn_dim=moe.ffn_dim,
                                          moe_layers=moe.layers, shared_ffn_dim=moe.shared_ffn_dim)
    latent = {}
    if getattr(hf_config, "kv_lora_rank", None):  # MLA (DeepSeek-V3): its head_dim is only the RoPE part
        rope = int(hf_config.qk_rope_head_dim)
        head_dim = int(hf_config.qk_nope_head_dim) + rope
        latent = dict(kv_lora_rank=int(hf_config.kv_lora_rank), q_lora_rank=int(hf_config.q_lora_rank or 0),
                      qk_rope_head_dim=rope, v_head_dim=int(hf_config.v_head_dim))
    return ModelConfig(
        vocab_size=hf_config.vocab_size,
        dim=hf_config.hidden_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=hf_config.num_attention_heads,
        num_kv_heads=hf_config.num_key_value_heads or hf_config.num_attention_heads,
        ffn_dim=hf_config.intermediate_size,
        rope_theta=float(raw_rope_parameters(hf_config).get("rope_theta") or 10000.0),
        norm_eps=float(hf_config.rms_norm_eps),
        tie_embeddings=bool(hf_config.tie_word_embeddings),
        head_dim=int(head_dim),
        sliding_window=None if window is None else int(window),
        layer_types=layer_types or None,  # sliding, full and linear layers, each planned as its own
        **experts,
        **linear,
        **latent,
    )


#: HF model types whose softmax attention gates its output with a second half of q_proj
_GATED_ATTENTION = ("qwen3_5_text", "qwen3_next")


def _linear_shape(hf_config: Any) -> dict[str, Any]:
    """The :class:`ModelConfig` fields of a hybrid's Gated DeltaNet layers (HF's names, the same as
    ModelConfig's) and its gated attention output. Kimi-Linear's KDA layers (``linear_num_heads`` heads of
    ``linear_head_dim`` for keys and values alike) are planned as Gated DeltaNet layers of those heads: the same
    projections, convolution and recurrence; their low-rank decay and output-gate projections counted as a
    Gated DeltaNet's full-width ones (more parameters: at Kimi-Linear-48B's shape 0.3% of the model)."""
    if getattr(hf_config, "model_type", None) == "kimi_linear":
        heads, dim = int(hf_config.linear_num_heads), int(hf_config.linear_head_dim)
        return dict(linear_num_key_heads=heads, linear_num_value_heads=heads, linear_key_head_dim=dim,
                    linear_value_head_dim=dim, linear_conv_kernel_dim=int(hf_config.linear_conv_kernel_dim),
                    attention_output_gate=False)
    missing = [name for name in LINEAR_FIELDS if not isinstance(getattr(hf_config, name, None), int)]
    if missing:
        raise ValueError(f"{getattr(hf_config, 'model_type', '?')}: linear-attention layers without {missing} in "
                         f"config.json (loongtrain plans Gated DeltaNet layers: docs/linear-attention.md)")
    return {name: int(getattr(hf_config, name)) for name in LINEAR_FIELDS} | {
        "attention_output_gate": getattr(hf_config, "model_type", None) in _GATED_ATTENTION}


def _name_map(config: ModelConfig) -> dict[str, str]:
    """native name -> HF name for every tensor of ``Transformer(config)``."""
    names = {k: v for k, v in _GLOBAL_NAMES.items() if not (config.tie_embeddings and k == "output.weight")}
    layer_names = dict(_LAYER_NAMES)
    if config.attention_bias:  # Llama's attention_bias: the four projections' biases
        layer_names.update({k.replace(".weight", ".bias"): v.replace(".weight", ".bias")
                            for k, v in _LAYER_NAMES.items() if k.startswith("attention.w")})
    for i in range(config.num_layers):
        names.update({f"layers.{i}.{k}": f"model.layers.{i}.{v}" for k, v in layer_names.items()})
    return names


def native_module_name(module: str, config: ModelConfig) -> str:
    """The ``LlamaForCausalLM`` name of a linear module of ``Transformer(config)`` (``layers.0.attention.wq`` ->
    ``model.layers.0.self_attn.q_proj``), by the weight mapping above; ValueError for a module it has none for."""
    name = _name_map(config).get(f"{module}.weight")
    if name is None:
        raise ValueError(f"{module!r} is not a module of loongtrain's decoder with a Hugging Face name")
    return name[: -len(".weight")]


def _rename(state: dict[str, Tensor], mapping: dict[str, str], drop: set[str], what: str) -> dict[str, Tensor]:
    state = {k: v for k, v in state.items() if k not in drop}
    unknown, missing = sorted(set(state) - set(mapping)), sorted(set(mapping) - set(state))
    if unknown or missing:
        raise ValueError(
            f"{what} state dict does not match the config: unexpected {unknown[:8]}, missing {missing[:8]}"
        )
    return {mapping[k]: v for k, v in state.items()}


def native_to_hf_state_dict(state: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """Rename a ``Transformer`` state dict to ``LlamaForCausalLM`` names (no tensor is changed)."""
    return _rename(state, _name_map(config), set(), "loongtrain")


def hf_to_native_state_dict(state: dict[str, Tensor], config: ModelConfig) -> dict[str, Tensor]:
    """Rename a ``LlamaForCausalLM`` state dict to ``Transformer`` names (a tied ``lm_head`` is dropped)."""
    inverse = {v: k for k, v in _name_map(config).items()}
    drop = {"lm_head.weight"} if config.tie_embeddings else set()
    return _rename(state, inverse, drop, "Hugging Face")


def export_hf(
    model_or_state_dict: nn.Module | dict[str, Tensor],
    model_config: ModelConfig | Any | None,
    out_dir: str | Path,
    *,
    max_position_embeddings: int | None = None,
) -> Path:
    """Write ``config.json`` + ``model.safetensors`` to ``out_dir`` for ``from_pretrained``; returns ``out_dir``.
    ``max_position_embeddings``: a loongtrain model's (default: :func:`hf_config_from_model_config`'s).

    Accepts loongtrain's ``Transformer`` (``model_config`` may be None), a loongtrain state dict with
    its :class:`ModelConfig`, an HF causal LM (``model_config`` None), or an HF state dict with its
    HF config. Tensors are written in their own dtype; a tied ``lm_head`` is not written.
    """
    import safetensors.torch  # noqa: F401 - first: missing, it is named as itself, not as transformers' failure

    if is_hf_model(model_or_state_dict):
        hf_config = _copy_config(model_or_state_dict.config)
        hf_config.architectures = [type(model_or_state_dict).__name__]
        state = model_or_state_dict.state_dict()
    else:
        is_module = isinstance(model_or_state_dict, nn.Module)
        state = model_or_state_dict.state_dict() if is_module else dict(model_or_state_dict)
        config = model_config if model_config is not None else getattr(model_or_state_dict, "config", None)
        if isinstance(config, ModelConfig):
            hf_config = hf_config_from_model_config(config, max_position_embeddings=max_position_embeddings)
            state = native_to_hf_state_dict(state, config)
        elif config is not None and hasattr(config, "to_json_string"):
            hf_config = _copy_config(config)
        else:
            raise ValueError(f"export_hf needs a ModelConfig or an HF config for a state dict; got {config!r}")
    architectures = getattr(hf_config, "architectures", None)
    if not architectures:
        raise ValueError(
            f"the HF config has no architectures entry; set it to one of {supported_architectures()}"
        )
    if is_hf_model(model_or_state_dict):
        check_architecture(architectures[0], model_or_state_dict)
    else:
        check_config_architectures(hf_config)
    if getattr(hf_config, "tie_word_embeddings", False):
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    state = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    dtypes = {v.dtype for v in state.values()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if len(dtypes) == 1:
        hf_config.dtype = next(iter(dtypes))
    hf_config.save_pretrained(out)
    add_legacy_rope_keys(out / "config.json")
    save_safetensors(state, out / "model.safetensors")
    return out


def add_legacy_rope_keys(file: Path) -> None:
    """Write a scaled ``rope_parameters`` also as the older ``rope_scaling`` + ``rope_theta`` into the
    config.json ``file`` (what transformers 4.x and other readers know; transformers >= 5 reads the same
    values from either)."""
    values = json.loads(file.read_text())
    params = values.get("rope_parameters")
    if not isinstance(params, dict) or params.get("rope_type", DEFAULT) == DEFAULT or "rope_theta" not in params:
        return
    if any(isinstance(v, dict) for v in params.values()):
        return
    values["rope_scaling"] = {k: v for k, v in params.items() if k != "rope_theta"}
    values["rope_theta"] = params["rope_theta"]
    file.write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")


def _copy_config(hf_config: Any) -> Any:
    """A copy of an HF config, so that export never changes the caller's."""
    return hf_config.__class__.from_dict(hf_config.to_dict())
