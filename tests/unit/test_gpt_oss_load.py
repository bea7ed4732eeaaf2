"""A gpt-oss model directory (config.json + safetensors: sinks, attention biases, experts, router) is checked,
loaded and exported by loongtrain's HF loader with every tensor unchanged, and its meta-device build restores
the YaRN rotary buffers."""

from __future__ import annotations

import torch

from loongtrain.hf.build import build_hf_model_on_meta, hf_initial_weights, restore_hf_buffers
from loongtrain.hf.convert import export_hf
from loongtrain.hf.load import check_hf_dir, load_hf_model
from tests.helpers.gpt_oss import hf_gpt_oss


def test_gpt_oss_dir_loads_and_exports_unchanged(tmp_path):
    model = hf_gpt_oss().float()
    model.save_pretrained(tmp_path / "src")
    config = check_hf_dir(tmp_path / "src")
    assert config.layer_types == ["sliding_attention", "full_attention"] * 2
    loaded = load_hf_model(tmp_path / "src", dtype=torch.float32)
    want = model.state_dict()
    got = loaded.state_dict()
    assert set(got) == set(want) and any(name.endswith("self_attn.sinks") for name in got)
    assert all(torch.equal(got[name], want[name]) for name in want)
    export_hf(loaded, None, tmp_path / "out")
    again = load_hf_model(tmp_path / "out", dtype=torch.float32).state_dict()
    assert all(torch.equal(again[name], want[name]) for name in want)

    meta = build_hf_model_on_meta(tmp_path / "src", torch.float32)
    meta.to_empty(device="cpu")
    restore_hf_buffers(meta, hf_initial_weights(tmp_path / "src"))
    assert torch.equal(meta.model.rotary_emb.inv_freq, model.model.rotary_emb.inv_freq)
