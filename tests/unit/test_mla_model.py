"""MLA and shared experts in loongtrain's own decoder (docs/attention.md#mla): its ``LatentAttention`` equals
transformers' ``DeepseekV3Attention`` (split-halves RoPE: ``rope_interleave=False``) in fp64, outputs and
gradients, with and without the queries' latent; parameter counts and FLOPs count MLA's projections, its two head
dims and the shared experts; MLA's settings are checked."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from loongtrain.model.config import active_params, flops_per_token, num_params
from loongtrain.model.llama import Transformer
from loongtrain.model.mla import LatentAttention
from loongtrain.model.rope import rope_cos_sin
from tests.helpers.deepseek import dtype_preserving, native_mla_config

MLA = native_mla_config()
#: native name -> HF DeepseekV3Attention's
NAMES = {"wq": "q_proj", "wq_a": "q_a_proj", "q_norm": "q_a_layernorm", "wq_b": "q_b_proj",
         "wkv_a": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj", "wo": "o_proj"}


@pytest.mark.parametrize("q_lora_rank", [20, 0])
def test_latent_attention_equals_hf_deepseek_v3_attention(q_lora_rank):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    config = dataclasses.replace(MLA, q_lora_rank=q_lora_rank)
    hf_config = DeepseekV3Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
                                 q_lora_rank=q_lora_rank or None, qk_rope_head_dim=8, qk_nope_head_dim=16,
                                 v_head_dim=12, rope_interleave=False, rms_norm_eps=config.norm_eps,
                                 rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta})
    hf_config._attn_implementation = "sdpa"
    ref = DeepseekV3Attention(hf_config, 0).double()
    rotary = dtype_preserving(DeepseekV3RotaryEmbedding(hf_config).double())
    ours = LatentAttention(config).double()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in ours.named_parameters():
            param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float64) * 0.3 + (name.endswith(
                "norm.weight")))
            module, leaf = name.rsplit(".", 1)
            getattr(ref, NAMES[module]).get_parameter(leaf).copy_(param)
    for module in ref.modules():  # HF's latent norms compute in float32: here in the input dtype
        if type(module).__name__.endswith("RMSNorm"):
            dtype_preserving(module)
    x = torch.randn(2, 11, 32, generator=gen, dtype=torch.float64)
    positions = torch.arange(11).expand(2, 11)
    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    want, _ = ref(x_ref, rotary(x, positions), None)
    got = ours(x_ours, *rope_cos_sin(positions, config.rope_dim, config.rope_theta, torch.float64))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    grad = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    want.backward(grad)
    got.backward(grad)
    torch.testing.assert_close(x_ours.grad, x_ref.grad, rtol=0, atol=1e-12)
    for name, param in ours.named_parameters():
        module, leaf = name.rsplit(".", 1)
        torch.testing.assert_close(param.grad, getattr(ref, NAMES[module]).get_parameter(leaf).grad, rtol=0,
                                   atol=1e-12, msg=name)


@pytest.mark.parametrize("config", [MLA, dataclasses.replace(MLA, q_lora_rank=0, shared_ffn_dim=0)],
                         ids=["latent-queries", "direct-queries"])
def test_parameter_counts_and_flops(config):
    model = Transformer(config, seed=0)
    assert num_params(config) == sum(p.numel() for p in model.parameters())
    routed = len(config.moe_layers) * (config.num_experts - config.top_k) * 3 * config.dim * config.moe_ffn_dim
    assert active_params(config) == num_params(config) - routed
    plain = dataclasses.replace(config, v_head_dim=config.head_dim)  # the attention term: H (D + Dv) per pair
    attention = flops_per_token(config, 64) - flops_per_token(plain, 64) - 6 * (active_params(config)
                                                                                 - active_params(plain))
    per_pair = 3 * 2 * config.num_layers * config.num_heads * (config.v_head_dim - config.head_dim)
    assert attention == pytest.approx(per_pair * 64 / 2)


@pytest.mark.parametrize("change, message", [
    (dict(kv_lora_rank=0), "need kv_lora_rank > 0"),
    (dict(qk_rope_head_dim=7), "qk_rope_head_dim=7 must be even"),
    (dict(qk_rope_head_dim=24), "qk_rope_head_dim=24 must be even and between 0 and head_dim=24"),
    (dict(num_kv_heads=2), "num_kv_heads=2 must equal num_heads=4 with MLA"),
    (dict(attention_bias=True), "no MLA form"),
    (dict(v_head_dim=-1), "v_head_dim=-1 must be a non-negative integer"),
    (dict(num_experts=0, top_k=0, moe_ffn_dim=0, moe_layers=()), "shared experts need an MoE model"),
])
def test_bad_latent_settings_raise(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(MLA, **change)


def test_the_deepseek_v3_like_preset_has_deepseek_v3s_shape():
    """671.0B parameters, 37.6B active (DeepSeek-V3: 671B, 37B); at 5 layers (3 dense) exactly the parameters of
    transformers' DeepseekV3ForCausalLM with its default (DeepSeek-V3's) config, built on the meta device."""
    import transformers

    from loongtrain.model.config import get_preset

    preset = get_preset("deepseek-v3-like")
    assert round(num_params(preset) / 1e9, 1) == 671.0 and round(active_params(preset) / 1e9, 1) == 37.6
    with torch.device("meta"):
        hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(num_hidden_layers=5))
    shallow = dataclasses.replace(preset, num_layers=5, moe_layers=(3, 4))
    assert num_params(shallow) == sum(p.numel() for p in hf.parameters())
