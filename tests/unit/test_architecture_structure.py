"""``check_architecture`` by structure (docs/hf-models.md#families): every tested family's layers match, families
not named in the list whose layers match are accepted, and one whose layers do not gets one line naming what
differs (a config entry, a module and its class, a parameter), from a built model and from a model directory."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from loongtrain.hf.families import SUPPORTED_ARCHITECTURES, check_architecture
from loongtrain.hf.load import read_hf_config

COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _meta(name: str, **extra) -> nn.Module:
    import transformers

    cls = getattr(transformers, name)
    config = cls.config_class(**{**COMMON, **extra})
    config.architectures = [name]
    with torch.device("meta"):
        return cls(config)


def _one_line_error(name: str, model: nn.Module, *needles: str) -> str:
    with pytest.raises(ValueError) as info:
        check_architecture(name, model)
    message = str(info.value)
    assert "\n" not in message and name in message, message
    for needle in needles:
        assert needle in message, (needle, message)
    return message


@pytest.mark.parametrize("name", SUPPORTED_ARCHITECTURES)
def test_tested_families_match_by_structure(name):
    assert check_architecture(name, _meta(name)) == name


@pytest.mark.parametrize("name", ["Olmo2ForCausalLM", "GraniteForCausalLM", "Starcoder2ForCausalLM",
                                  "Gemma3ForCausalLM"])
def test_untested_families_whose_layers_match_are_accepted(name):
    assert name not in SUPPORTED_ARCHITECTURES
    assert check_architecture(name, _meta(name)) == name
    with pytest.raises(ValueError, match="checked by structure once built"):
        check_architecture(name)  # by name alone it cannot be told


@pytest.mark.parametrize("name, needles", [
    ("Gemma2ForCausalLM", ["attn_logit_softcapping=50.0"]),
    ("NemotronHForCausalLM", ["config layer_types[1]='moe'"]),
    ("LlamaForSequenceClassification", ["has no output embedding (an LM head): it is not a causal LM"]),
    ("GPT2LMHeadModel", ["has no decoder layers at base_model.layers"]),
])
def test_families_whose_layers_differ_name_what(name, needles):
    _one_line_error(name, _meta(name), *needles)


def test_mamba_layers_are_named():
    # Nemotron-H names its Mamba2 layers "linear_attention" too: they are checked by their modules
    model = _meta("NemotronHForCausalLM", layer_types=["linear_attention", "full_attention"])
    _one_line_error("NemotronHForCausalLM", model, "layer 0 (NemotronHBlock) has no self_attn (or linear_attn) module")


def test_a_linear_attention_block_loongtrain_does_not_compute_is_named():
    model = _meta("Qwen3_5ForCausalLM", layer_types=["linear_attention", "full_attention"])
    model.model.layers[0].linear_attn.activation = "gelu"
    _one_line_error("Qwen3_5ForCausalLM", model, "layer 0 linear_attn (Qwen3_5GatedDeltaNet) activation='gelu'")
    model.model.layers[0].linear_attn.conv1d = nn.Conv1d(4, 4, 3, padding=1, groups=4, device="meta")
    _one_line_error("Qwen3_5ForCausalLM", model, "is not a depthwise causal convolution")


def test_a_module_that_is_not_token_wise_is_named():
    model = _meta("LlamaForCausalLM")
    model.model.layers[1].mlp.mix = nn.Conv1d(32, 32, 3, device="meta")
    _one_line_error("LlamaForCausalLM", model, "layer 1 mlp.mix (Conv1d) is not a token-wise layer")


def test_an_attention_parameter_without_equivalent_is_named():
    model = _meta("LlamaForCausalLM")
    model.model.layers[0].self_attn.temperature = nn.Parameter(torch.ones(4, device="meta"))
    _one_line_error("LlamaForCausalLM", model, "layer 0 self_attn (LlamaAttention) holds parameters ['temperature']")


def test_an_attention_that_bypasses_the_interface_is_named():
    model = _meta("LlamaForCausalLM")
    attn = model.model.layers[0].self_attn

    class OwnAttention(type(attn)):
        def forward(self, hidden_states, *args, **kwargs):  # its own softmax: loongtrain cannot replace it
            return hidden_states, None

    attn.__class__ = OwnAttention
    _one_line_error("LlamaForCausalLM", model, "does not call transformers' attention interface")


def test_model_directories_are_checked_by_structure(tmp_path):
    for name in ("Olmo2ForCausalLM", "Gemma2ForCausalLM"):
        model = _meta(name)
        directory = tmp_path / name
        directory.mkdir()
        values = json.loads(model.config.to_json_string())
        values.pop("_attn_implementation", None)
        (directory / "config.json").write_text(json.dumps(values))
    assert type(read_hf_config(tmp_path / "Olmo2ForCausalLM")).__name__ == "Olmo2Config"
    with pytest.raises(ValueError, match=r"'Gemma2ForCausalLM': config attn_logit_softcapping=50.0") as info:
        read_hf_config(tmp_path / "Gemma2ForCausalLM")
    assert "\n" not in str(info.value)


def test_adapted_projections_still_match():
    # LoRA adapters inside the projections (loongtrain's, applied after 2D-Attention): still projections
    import transformers

    from loongtrain.model.lora import LoraConfig
    from loongtrain.parallelize.lora import apply_lora

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON))
    apply_lora(model, LoraConfig(r=2, alpha=4.0, targets=("q_proj", "v_proj", "gate_proj")))
    assert check_architecture("LlamaForCausalLM", model) == "LlamaForCausalLM"
