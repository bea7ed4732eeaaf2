"""A DeepSeek-V3 model directory (MLA projections, routed and shared experts, the score-correction biases, a dense
first layer) is checked by structure, loaded and exported with every tensor unchanged (buffers included), built on
the meta device and filled from the files as under ZeRO; its MoE layout is read from config.json; quantized
checkpoints are refused and the tensors the model class declares not its own are dropped with a warning."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from loongtrain.hf.build import build_hf_model_on_meta, hf_initial_weights, restore_hf_buffers
from loongtrain.hf.convert import export_hf, shape_config_from_hf
from loongtrain.hf.expert_files import fuse_tensors
from loongtrain.hf.load import check_hf_dir, load_hf_model
from loongtrain.hf.moe import moe_layout
from tests.helpers.deepseek import write_deepseek_dir


def test_deepseek_v3_dir_loads_exports_and_fills_its_buffers_unchanged(tmp_path):
    src = write_deepseek_dir(tmp_path / "src")
    config = check_hf_dir(src)
    layout = moe_layout(config)
    assert (layout.layers, layout.num_experts, layout.top_k, layout.ffn_dim, layout.shared_ffn_dim) == ((1, 2), 8, 2,
                                                                                                       16, 16)
    assert not layout.load_balancing and not layout.output_router_logits  # HF trains DeepSeek-V3 without one
    want = fuse_tensors(load_file(str(src / "model.safetensors")))  # save_pretrained writes experts apart
    biases = [name for name in want if name.endswith("e_score_correction_bias")]
    assert len(biases) == 2 and all(want[name].abs().max() > 0 for name in biases)
    loaded = load_hf_model(src, dtype=torch.float32)
    got = loaded.state_dict()
    assert set(got) == set(want) and all(torch.equal(got[name], want[name]) for name in want)
    export_hf(loaded, None, tmp_path / "out")
    again = load_hf_model(tmp_path / "out", dtype=torch.float32).state_dict()
    assert all(torch.equal(again[name], want[name]) for name in want)

    meta = build_hf_model_on_meta(src, torch.float32)
    meta.to_empty(device="cpu")
    restore_hf_buffers(meta, hf_initial_weights(src))
    for name, buffer in meta.named_buffers():
        reference = dict(loaded.named_buffers())[name]
        assert torch.equal(buffer, reference), name


def test_deepseek_v3_shape_for_planning(tmp_path):
    config = check_hf_dir(write_deepseek_dir(tmp_path / "src"))
    shape = shape_config_from_hf(config)
    assert (shape.num_experts, shape.top_k, shape.moe_ffn_dim, shape.moe_layers, shape.shared_ffn_dim) == (
        8, 2, 16, (1, 2), 16)
    assert (shape.head_dim, shape.v_head_dim, shape.qk_rope_head_dim, shape.kv_lora_rank, shape.q_lora_rank) == (
        24, 12, 8, 16, 24)
    from loongtrain.model.config import num_params
    from tests.helpers.deepseek import tiny_deepseek

    hf = tiny_deepseek(vocab_size=256)  # the same shape in loongtrain's decoder: the same parameter count
    assert num_params(shape) == sum(p.numel() for p in hf.parameters())


def test_quantized_checkpoints_are_refused(tmp_path):
    src = write_deepseek_dir(tmp_path / "src")
    values = json.loads((src / "config.json").read_text())
    values["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (src / "config.json").write_text(json.dumps(values))
    with pytest.raises(ValueError, match="quantization_config \\(quant_method='fp8'\\).*unquantized"):
        check_hf_dir(src)


def test_a_multi_token_prediction_layer_is_dropped_with_a_warning(tmp_path, caplog):
    """DeepSeek-V3's Hub checkpoints hold layer ``num_hidden_layers`` (its MTP module), which HF's model does not
    build (``_keys_to_ignore_on_load_unexpected``): dropped with a warning naming it; any other extra tensor fails."""
    src = write_deepseek_dir(tmp_path / "src", num_hidden_layers=3)
    state = load_file(str(src / "model.safetensors"))
    extra = {name.replace("layers.2.", "layers.61."): t.clone() for name, t in state.items() if ".layers.2." in name}
    save_file({**state, **extra}, str(src / "model.safetensors"), metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="loongtrain.hf.load"):
        loaded = load_hf_model(src, dtype=torch.float32)
    dropped = len(fuse_tensors(extra))
    assert f"{dropped} tensors of the weight files (experts fused) are not part of DeepseekV3ForCausalLM" in caplog.text
    assert set(loaded.state_dict()) == set(fuse_tensors(state))
    save_file({**state, "model.layers.2.mlp.extra.weight": torch.zeros(2)}, str(src / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match="'model.layers.2.mlp.extra.weight' .* is not a tensor"):
        check_hf_dir(src)
