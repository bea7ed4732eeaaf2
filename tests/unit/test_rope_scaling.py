"""RoPE scaling (linear, yarn, llama3) in loongtrain's decoder against Hugging Face's own implementation.

- Inverse frequencies and YaRN's attention factor equal HF's ``ROPE_INIT_FUNCTIONS`` run in float64.
- An HF ``LlamaForCausalLM`` with each scaling maps onto the native decoder: fp64 logits and gradients
  within 1e-10 (HF's fp32 RMSNorm and rotary angles recomputed in fp64 by HF's own formulas).
- Export writes ``rope_parameters`` (and the older ``rope_scaling`` + ``rope_theta``); ``from_pretrained``
  gives the same logits; an older config is read; refused types and bad keys are ValueErrors naming them.
(Sharded equals unsharded for each type: ``tests/unit/test_model.py``.)
"""

from __future__ import annotations

import json
import types

import pytest
import torch
import torch.nn.functional as F

from loongtrain.hf import export_hf, hf_to_native_state_dict, model_config_from_hf
from loongtrain.model import ModelConfig, Transformer
from loongtrain.model.rope_scaling import (
    RopeScaling,
    attention_factor,
    inv_freq,
    parse_rope_scaling,
    rope_change,
    rope_scaling_from_mapping,
)
from tests.helpers.fixtures import SCALINGS

SEQ, BATCH, VOCAB = 32, 2, 64


class _Float64Torch(types.ModuleType):
    """``torch`` with ``float``/``float32`` meaning float64: HF's rope functions, run in float64."""

    def __getattr__(self, name: str):
        return torch.float64 if name in ("float", "float32") else getattr(torch, name)


def hf_rope_fp64(config) -> tuple[torch.Tensor, float]:
    """``(inv_freq, attention_scaling)`` of HF's own function for ``config``'s rope type, in float64."""
    import transformers.modeling_rope_utils as rope_utils

    saved = rope_utils.torch
    rope_utils.torch = _Float64Torch("torch")
    try:
        return rope_utils.ROPE_INIT_FUNCTIONS[config.rope_parameters["rope_type"]](config)
    finally:
        rope_utils.torch = saved


def _rope_forward_fp64(self, x, position_ids):  # HF's rotary forward, angles in float64
    angles = torch.cat([position_ids[..., None].double() * self.fp64_inv_freq] * 2, dim=-1)
    return (angles.cos() * self.attention_scaling).to(x.dtype), (angles.sin() * self.attention_scaling).to(x.dtype)


def hf_in_fp64(model):
    """HF computes RMSNorm and RoPE in fp32 by design: recompute both in fp64 (the rotary embedding's
    frequencies by HF's own rope function) to compare at 1e-10."""
    from tests.helpers.hf_models import force_fp64

    force_fp64(model)
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding") and module.rope_type != "default":
            module.fp64_inv_freq, module.attention_scaling = hf_rope_fp64(module.config)
            module.forward = types.MethodType(_rope_forward_fp64, module)
    return model


def _hf_llama(scaling: RopeScaling | None, theta: float = 10000.0, seed: int = 3):
    from transformers import LlamaConfig, LlamaForCausalLM

    params = {**(scaling.hf_parameters() if scaling else {"rope_type": "default"}), "rope_theta": theta}
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_parameters=params,
                         max_position_embeddings=64, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
        for param in model.parameters():
            if param.dim() == 1:  # norms ones-initialised: make them matter
                param.data.add_(0.1 * torch.randn(param.shape))
    return model.double()


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:], torch.arange(SEQ).expand(BATCH, SEQ) + 40  # past the original 16


@pytest.mark.parametrize("case", [
    *SCALINGS.values(),
    RopeScaling("yarn", factor=8.0, original_max_position_embeddings=4096, beta_fast=16.0, beta_slow=2.0,
                truncate=False),
    RopeScaling("yarn", factor=8.0, original_max_position_embeddings=4096, mscale=0.707, mscale_all_dim=1.0),
    RopeScaling("yarn", factor=2.0, original_max_position_embeddings=512, attention_factor=1.5),
    RopeScaling("llama3", factor=8.0, original_max_position_embeddings=8192, low_freq_factor=1.0,
                high_freq_factor=4.0),
], ids=lambda s: s.spec())
@pytest.mark.parametrize("head_dim, theta", [(8, 10000.0), (128, 500000.0)])
def test_frequencies_and_attention_factor_equal_hf(case, head_dim, theta):
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim, num_hidden_layers=1,
                         intermediate_size=8, vocab_size=8, max_position_embeddings=65536,
                         rope_parameters={**case.hf_parameters(), "rope_theta": theta})
    ref, scale = hf_rope_fp64(config)
    assert ref.dtype == torch.float64
    torch.testing.assert_close(inv_freq(head_dim, theta, case), ref, rtol=1e-14, atol=0)
    assert attention_factor(case) == pytest.approx(scale, rel=1e-15)
    plain = inv_freq(head_dim, theta)
    assert not torch.allclose(inv_freq(head_dim, theta, case), plain, rtol=1e-6)  # the scaling changes something


@pytest.mark.parametrize("name", list(SCALINGS))
def test_hf_llama_with_scaled_rope_maps_onto_native(name):
    hf = hf_in_fp64(_hf_llama(SCALINGS[name], theta=500000.0))
    config = model_config_from_hf(hf.config)
    assert config.rope_scaling == SCALINGS[name] and config.rope_theta == 500000.0
    native = Transformer(config, seed=None).double()
    native.load_state_dict(hf_to_native_state_dict(hf.state_dict(), config))
    inputs, labels, positions = _batch(1)
    ref = hf(input_ids=inputs, position_ids=positions, use_cache=False).logits
    out = native(inputs, positions)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)
    F.cross_entropy(ref.reshape(-1, VOCAB), labels.reshape(-1)).backward()
    F.cross_entropy(out.reshape(-1, VOCAB), labels.reshape(-1)).backward()
    hf_grads = hf_to_native_state_dict({n: p.grad for n, p in hf.named_parameters()}, config)
    for param_name, param in native.named_parameters():
        torch.testing.assert_close(param.grad, hf_grads[param_name], rtol=0, atol=1e-10, msg=param_name)
    plain = Transformer(ModelConfig(**{**config.__dict__, "rope_scaling": None}), seed=None).double()
    plain.load_state_dict(native.state_dict())
    assert (plain(inputs, positions) - ref).abs().max() > 1e-5  # 1e5 x the tolerance: the comparison can fail


@pytest.mark.parametrize("name", list(SCALINGS))
def test_native_export_with_scaling_loads_in_transformers(tmp_path, name):
    from transformers import AutoModelForCausalLM

    config = ModelConfig(vocab_size=VOCAB, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=48,
                         rope_theta=20000.0, rope_scaling=SCALINGS[name])
    native = Transformer(config, seed=5).double()
    export_hf(native, None, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    expected = {**SCALINGS[name].hf_parameters(), "rope_theta": 20000.0}
    assert saved["rope_parameters"] == expected
    assert saved["rope_scaling"] == SCALINGS[name].hf_parameters() and saved["rope_theta"] == 20000.0
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64, local_files_only=True)
    assert model_config_from_hf(hf.config) == config
    inputs, _, positions = _batch(2)
    ref = native(inputs, positions)
    stock = hf(input_ids=inputs, position_ids=positions, use_cache=False).logits
    torch.testing.assert_close(stock, ref, rtol=0, atol=1e-4)  # stock HF: fp32 norms and RoPE
    torch.testing.assert_close(hf_in_fp64(hf)(input_ids=inputs, position_ids=positions, use_cache=False).logits,
                               ref, rtol=0, atol=1e-10)


def test_older_rope_scaling_configs_are_read(tmp_path):
    from transformers import AutoConfig

    hf = _hf_llama(None)
    hf.config.save_pretrained(tmp_path)
    values = json.loads((tmp_path / "config.json").read_text())
    values.pop("rope_parameters")
    values.update(rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
                  rope_theta=123456.0)
    (tmp_path / "config.json").write_text(json.dumps(values))
    config = model_config_from_hf(AutoConfig.from_pretrained(tmp_path))
    assert config.rope_theta == 123456.0 and config.rope_scaling == SCALINGS["yarn"]
    from loongtrain.hf.convert import rope_from_hf

    assert rope_from_hf(values) == (123456.0, SCALINGS["yarn"])  # a raw config.json dict


@pytest.mark.parametrize("params, match", [
    ({"rope_type": "dynamic", "factor": 2.0}, r"'dynamic': dynamic NTK scaling is inference-only: its frequencies "
                                              r"depend on the current sequence length"),
    ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}, r"'longrope'.*current sequence length"),
    ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}, r"partial_rotary_factor=0\.5"),
    ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 16, "low_freq_factor": 4.0,
      "high_freq_factor": 1.0}, r"high_freq_factor=1\.0 must exceed low_freq_factor=4\.0"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "short_factor": [1.0]},
     r"'yarn' does not take short_factor=\[1\.0\]; it takes \['factor', 'original_max_position_embeddings'"),
])
def test_unsupported_rope_parameters_are_refused(params, match):
    with pytest.raises(ValueError, match=match):
        rope_scaling_from_mapping(params)


@pytest.mark.parametrize("spec, match", [
    ("ntk:factor=2", r"unknown rope type 'ntk'; valid: \['default', 'linear', 'yarn', 'llama3'\]"),
    ("dynamic:factor=2", r"'dynamic': dynamic NTK scaling is inference-only"),
    ("linear", r"rope type 'linear' needs factor"),
    ("linear:factor=0", r"factor=0\.0 must be positive"),
    ("linear:factor=-2", r"factor=-2\.0 must be positive"),
    ("linear:factor=nan", r"factor=nan must be a finite number"),
    ("linear:factor=2,beta_fast=4", r"rope type 'linear' does not take beta_fast=4\.0; it takes \['factor'\]"),
    ("yarn:factor=4", r"'yarn' needs original_max_position_embeddings \(the context length the model was "
                      r"trained at\)"),
    ("llama3:factor=8,low_freq_factor=1,high_freq_factor=4", r"'llama3' needs original_max_position_embeddings"),
    ("yarn:factor=4,original_max_position_embeddings=1.5", r"original_max_position_embeddings='1\.5' must be a "
                                                           r"positive integer"),
    ("yarn:factor=4,original_max_position_embeddings=8192,truncate=maybe", r"truncate='maybe' must be true or false"),
    ("yarn:factor=4,factor=2", r"factor is given twice"),
    ("yarn:factor", r"'factor' is not key=value"),
    ("default:factor=2", r"'default' takes no parameters"),
])
def test_bad_rope_scaling_specs(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_rope_scaling(spec)
    with pytest.raises(ValueError, match=r"^--rope-scaling " + repr(spec).replace("[", r"\[")):
        rope_change(0.0, spec)


def test_rope_scaling_specs_round_trip():
    spec = "yarn:factor=4,original_max_position_embeddings=8192,beta_fast=16,truncate=false"
    scaling = parse_rope_scaling(spec)
    assert scaling == RopeScaling("yarn", factor=4.0, original_max_position_embeddings=8192, beta_fast=16.0,
                                  truncate=False)
    assert parse_rope_scaling(scaling.spec()) == scaling
    assert parse_rope_scaling("default") is None and not rope_change(0.0, "")
    assert rope_change(5e5, "default").apply(1e4, scaling) == (5e5, None)
    assert rope_change(0.0, "").apply(1e4, scaling) == (1e4, scaling)
    with pytest.raises(ValueError, match=r"--rope-theta=-1 must be a positive number"):
        rope_change(-1, "")
    assert ModelConfig(**{**_config_fields(), "rope_scaling": scaling.__dict__}).rope_scaling == scaling


def _config_fields() -> dict:
    return dict(vocab_size=VOCAB, dim=32, num_layers=1, num_heads=4, num_kv_heads=2, ffn_dim=48)
