"""Hugging Face causal LMs on 2D-Attention: sharded equals stock unsharded, loading, export, errors."""

from __future__ import annotations

import json

import pytest
import torch

import loongtrain
from loongtrain.hf import (
    apply_to_hf,
    export_hf,
    hf_config_from_model_config,
    hf_to_native_state_dict,
    load_hf_model,
    model_config_from_hf,
    supported_architectures,
)
from loongtrain.model import ModelConfig, Transformer
from tests.helpers.hf_batches import BATCH, _batch
from tests.helpers.hf_models import COMMON, FAMILIES, SEQ, VOCAB, force_fp64, tiny_hf

pytest.importorskip("transformers", reason="the hf extra is not installed (pip install -e '.[hf]')")


# ---- single process: the registered implementation, its errors --------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
def test_single_process_matches_stock(family):
    inputs, _, positions = _batch(5)
    ref = tiny_hf(family)(input_ids=inputs, position_ids=positions + 7, use_cache=False).logits
    model = apply_to_hf(tiny_hf(family), loongtrain.single_process_mesh())
    assert model.config._attn_implementation == "loongtrain"
    out = model(input_ids=inputs, position_ids=positions + 7).logits
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)


@pytest.mark.parametrize("window", [1, 5, SEQ // 2])
def test_single_process_short_sliding_window_matches_stock(window):
    inputs, _, positions = _batch(6)
    ref = tiny_hf("MistralForCausalLM", sliding_window=window)(input_ids=inputs, position_ids=positions,
                                                             use_cache=False).logits
    model = apply_to_hf(tiny_hf("MistralForCausalLM", sliding_window=window), loongtrain.single_process_mesh())
    torch.testing.assert_close(model(input_ids=inputs, position_ids=positions).logits, ref, rtol=0, atol=1e-10)


@pytest.mark.parametrize("family", ["LlamaForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM"])
def test_packed_documents_equal_each_document_alone(family):
    # the document mask through transformers' attention interface: cu_seqlens reaches loongtrain.attention
    inputs, _, _ = _batch(8)
    bounds = [0, 5, 6, 19, SEQ]  # lengths 5, 1, 13, 13: a one-token document, none aligned to anything
    overrides = dict(sliding_window=4) if family == "MistralForCausalLM" else {}
    stock = tiny_hf(family, **overrides)
    ref = torch.cat([
        stock(input_ids=inputs[:, a:b], position_ids=torch.arange(b - a).expand(BATCH, b - a), use_cache=False).logits
        for a, b in zip(bounds[:-1], bounds[1:])
    ], dim=1)
    positions = torch.cat([torch.arange(b - a) for a, b in zip(bounds[:-1], bounds[1:])]).expand(BATCH, SEQ)
    cu_seqlens = [torch.tensor(bounds)] * BATCH
    model = apply_to_hf(tiny_hf(family, **overrides), loongtrain.single_process_mesh())
    out = model(input_ids=inputs, position_ids=positions, cu_seqlens=cu_seqlens).logits
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)
    with pytest.raises(AssertionError):  # without the boundaries, documents see each other
        torch.testing.assert_close(model(input_ids=inputs, position_ids=torch.arange(SEQ).expand(BATCH, SEQ)).logits,
                                   ref, rtol=0, atol=1e-6)


def test_unsupported_inputs_raise():
    mesh = loongtrain.single_process_mesh()
    inputs, _, positions = _batch(5)
    model = apply_to_hf(tiny_hf("Qwen2ForCausalLM"), mesh)
    padding = torch.ones(BATCH, SEQ, dtype=torch.long)
    padding[0, -3:] = 0
    with pytest.raises(ValueError, match="padding"):
        model(input_ids=inputs, position_ids=positions, attention_mask=padding)
    packed = torch.cat([torch.arange(SEQ // 2), torch.arange(SEQ // 2)]).expand(BATCH, SEQ)
    with pytest.raises(ValueError, match="packed documents"):
        model(input_ids=inputs, position_ids=packed)
    dropout = apply_to_hf(tiny_hf("LlamaForCausalLM", attention_dropout=0.1), mesh)
    with pytest.raises(ValueError, match="dropout=0.1"):
        dropout.train()(input_ids=inputs, position_ids=positions)


def test_unsupported_architecture_lists_supported():
    from transformers import LlamaConfig, LlamaForSequenceClassification

    moe = ["MixtralForCausalLM", "Qwen3MoeForCausalLM"]  # tests/unit/test_moe.py
    linear = ["Qwen3_5ForCausalLM"]  # tests/dist/test_linear_dist.py
    deepseek = ["DeepseekV3ForCausalLM"]  # tests/dist/test_deepseek_v3_dist.py
    hybrid_moe = ["Qwen3NextForCausalLM", "KimiLinearForCausalLM"]  # tests/dist/test_hybrid_moe_dist.py
    assert set(supported_architectures()) == {*FAMILIES, *moe, *linear, *deepseek, *hybrid_moe, "GptOssForCausalLM"}
    model = LlamaForSequenceClassification(LlamaConfig(**COMMON))
    with pytest.raises(ValueError, match="LlamaForSequenceClassification.*Qwen3ForCausalLM"):
        apply_to_hf(model, loongtrain.single_process_mesh())


# ---- loading and export ---------------------------------------------------------------------------


NATIVE = dict(vocab_size=VOCAB, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=48,
              rope_theta=500000.0, norm_eps=1e-6)


@pytest.mark.parametrize("tie", [False, True])
def test_native_export_loads_in_transformers_with_equal_logits(tmp_path, tie):
    from transformers import AutoModelForCausalLM

    config = ModelConfig(**NATIVE, tie_embeddings=tie)
    native = Transformer(config, seed=11).double()
    export_hf(native, None, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["rms_norm_eps"] == 1e-6 and saved["tie_word_embeddings"] is tie
    assert saved["num_key_value_heads"] == 2 and saved["intermediate_size"] == 48 and saved["head_dim"] == 8
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64, local_files_only=True)
    assert model_config_from_hf(hf.config) == config
    inputs, _, positions = _batch(9)
    ref = native(inputs, positions + 1000)
    hf_logits = hf(input_ids=inputs, position_ids=positions + 1000, use_cache=False).logits
    torch.testing.assert_close(hf_logits, ref, rtol=0, atol=1e-4)  # stock HF: fp32 norms / RoPE
    hf_logits = force_fp64(hf)(input_ids=inputs, position_ids=positions + 1000, use_cache=False).logits
    torch.testing.assert_close(hf_logits, ref, rtol=0, atol=1e-10)
    loaded = force_fp64(load_hf_model(tmp_path, dtype=torch.float64))
    torch.testing.assert_close(loaded(input_ids=inputs, position_ids=positions + 1000).logits, ref, rtol=0, atol=1e-10)


def test_hf_llama_maps_onto_native(tmp_path):
    hf = force_fp64(tiny_hf("LlamaForCausalLM", rms_norm_eps=1e-5))
    config = model_config_from_hf(hf.config)
    native = Transformer(config, seed=None).double()
    native.load_state_dict(hf_to_native_state_dict(hf.state_dict(), config))
    inputs, _, positions = _batch(2)
    ref = hf(input_ids=inputs, position_ids=positions, use_cache=False).logits
    torch.testing.assert_close(native(inputs, positions), ref, rtol=0, atol=1e-10)
    assert hf_config_from_model_config(config).rms_norm_eps == 1e-5


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_export_and_load_round_trip(tmp_path, family):
    model = tiny_hf(family)
    export_hf(model, None, tmp_path)
    loaded = load_hf_model(tmp_path, dtype=torch.float64)
    assert type(loaded).__name__ == family
    inputs, _, positions = _batch(4)
    ref = model(input_ids=inputs, position_ids=positions, use_cache=False).logits
    torch.testing.assert_close(loaded(input_ids=inputs, position_ids=positions).logits, ref, rtol=0, atol=1e-10)
    with pytest.raises(ValueError, match="no architectures entry"):
        export_hf(model.state_dict(), tiny_hf(family).config, tmp_path / "state")
    model.config.architectures = [family]
    export_hf(model.state_dict(), model.config, tmp_path / "state")
    loaded = load_hf_model(tmp_path / "state", dtype=torch.float64)
    torch.testing.assert_close(loaded(input_ids=inputs, position_ids=positions).logits, ref, rtol=0, atol=1e-10)


def test_config_only_directory_initialises_from_seed(tmp_path):
    tiny_hf("Qwen3ForCausalLM").config.save_pretrained(tmp_path)
    before = torch.random.get_rng_state()
    a, b = (load_hf_model(tmp_path, seed=s) for s in (1, 1))
    c = load_hf_model(tmp_path, seed=2, dtype=torch.float64)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert c.dtype == torch.float64
    assert not torch.equal(a.model.embed_tokens.weight.double(), c.model.embed_tokens.weight)


def test_bad_directories_raise(tmp_path):
    from transformers import GPT2Config

    with pytest.raises(ValueError, match="no config.json"):
        load_hf_model(tmp_path)
    GPT2Config(n_layer=1, n_embd=16, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ValueError, match=r"'GPT2LMHeadModel'.*\['LlamaForCausalLM', 'MistralForCausalLM'"):
        load_hf_model(tmp_path / "gpt2")
    export_hf(tiny_hf("LlamaForCausalLM"), None, tmp_path / "llama")
    config = json.loads((tmp_path / "llama" / "config.json").read_text())
    (tmp_path / "llama" / "config.json").write_text(json.dumps({**config, "intermediate_size": 40}))
    shapes = r"mlp.down_proj.weight' has shape \(32, 48\) but config.json needs \(32, 40\)"
    with pytest.raises(ValueError, match=shapes):
        load_hf_model(tmp_path / "llama")
    (tmp_path / "llama" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(ValueError, match=r"missing.*model.layers.2"):
        load_hf_model(tmp_path / "llama")


def test_llama_with_its_own_head_dim_maps_onto_native(tmp_path):
    hf = force_fp64(tiny_hf("LlamaForCausalLM", head_dim=16))  # 4 heads x 16 != hidden 32
    config = model_config_from_hf(hf.config)
    assert (config.dim, config.num_heads, config.head_dim) == (32, 4, 16)
    native = Transformer(config, seed=None).double()
    native.load_state_dict(hf_to_native_state_dict(hf.state_dict(), config))
    inputs, _, positions = _batch(6)
    ref = hf(input_ids=inputs, position_ids=positions, use_cache=False).logits
    torch.testing.assert_close(native(inputs, positions), ref, rtol=0, atol=1e-10)
    export_hf(native, None, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["head_dim"] == 16
    assert ModelConfig(**NATIVE).head_dim == 8  # default: dim // num_heads
