"""Tiny random DeepSeek-V3 models (MLA, group-limited sigmoid routing with the score-correction bias, shared experts,
a dense first layer, YaRN with its softmax-scale factor) and HF's own fp32 steps made dtype-preserving for fp64
comparisons: its RMSNorms, its rotary angles and its router compute in the input dtype (tests only)."""

from __future__ import annotations

import json
import types
from pathlib import Path

import torch
from torch import nn

VOCAB = 64
CONFIG = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
              routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12,
              qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1,
              rope_interleave=True, max_position_embeddings=256, tie_word_embeddings=False,
              rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                               "mscale": 1.0, "mscale_all_dim": 0.8, "original_max_position_embeddings": 64,
                               "rope_theta": 10000.0})


def native_mla_config():
    """loongtrain's decoder with MLA (q/k 24 = 16 + 8 RoPE, values 12, latents 20 and 16) and an MoE layer of 8
    experts, top 2, with a shared expert, after a dense one."""
    from loongtrain.model.config import ModelConfig

    return ModelConfig(vocab_size=64, dim=32, num_layers=3, num_heads=4, num_kv_heads=4, ffn_dim=48, head_dim=24,
                       kv_lora_rank=16, q_lora_rank=20, qk_rope_head_dim=8, v_head_dim=12, num_experts=8, top_k=2,
                       moe_ffn_dim=16, moe_layers=(1, 2), shared_ffn_dim=16)


def deepseek_config(**overrides):
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(**{**CONFIG, **overrides})
    config.architectures = ["DeepseekV3ForCausalLM"]
    return config


def tiny_deepseek(seed: int = 3, dtype: torch.dtype = torch.float64, **overrides) -> nn.Module:
    """A tiny random ``DeepseekV3ForCausalLM``, the same for the same seed: router weights scaled up and the
    score-correction biases set so that routing is far from uniform and the biases change it, 1-D weights moved
    off HF's ones/zeros; HF's ``sdpa`` attention (its ``eager`` rounds the softmax to fp32) and eager experts."""
    from transformers import DeepseekV3ForCausalLM

    config = deepseek_config(**overrides)
    config._attn_implementation = "sdpa"
    config._experts_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DeepseekV3ForCausalLM(config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if param.dim() == 1:
                    param.add_(0.1 * torch.randn(param.shape))
                elif name.endswith("gate.weight"):
                    param.normal_(0.0, 0.5)
            for name, buffer in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buffer.copy_(0.2 * torch.randn(buffer.shape))
    return model.to(dtype)


def write_deepseek_dir(path: Path, seed: int = 3, **overrides) -> Path:
    """A tiny DeepSeek-V3 directory (fp32 weights, the score-correction biases included); config.json without the
    implementations chosen here."""
    tiny_deepseek(seed, torch.float32, vocab_size=256, **overrides).save_pretrained(path)
    values = json.loads((path / "config.json").read_text())
    values.pop("_attn_implementation", None)
    values.pop("_experts_implementation", None)
    (path / "config.json").write_text(json.dumps(values, indent=2))
    return path


def _rmsnorm(self, x):
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _rope(self, x, position_ids):
    """HF's rotary angles in the buffer's dtype; the default RoPE's inverse frequencies recomputed in float64 (HF
    computes them in float32; YaRN's stay HF's own: the same on both sides of a sharded-vs-whole comparison)."""
    inv_freq = self.inv_freq
    if self.rope_type == "default":
        dim = 2 * inv_freq.numel()
        inv_freq = 1.0 / self.config.rope_parameters["rope_theta"] ** (
            torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = position_ids[..., None].to(inv_freq.dtype) * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    return (angles.cos() * self.attention_scaling).to(x.dtype), (angles.sin() * self.attention_scaling).to(x.dtype)


def _router(self, hidden_states):
    """HF's ``DeepseekV3TopkRouter.forward`` without its float32 casts."""
    hidden_states = hidden_states.view(-1, self.hidden_dim)
    logits = nn.functional.linear(hidden_states, self.weight.to(hidden_states.dtype))
    scores = logits.sigmoid()
    choice = scores + self.e_score_correction_bias
    groups = choice.view(-1, self.num_group, self.num_experts // self.num_group).topk(2, dim=-1)[0].sum(dim=-1)
    kept = torch.zeros_like(groups).scatter_(1, torch.topk(groups, k=self.topk_group, dim=-1, sorted=False)[1], 1)
    mask = kept.unsqueeze(-1).expand(-1, self.num_group, self.num_experts // self.num_group).reshape(-1,
                                                                                                     self.num_experts)
    choice = choice.masked_fill(~mask.bool(), float("-inf"))
    indices = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, indices)
    if self.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return logits, weights * self.routed_scaling_factor, indices


def dtype_preserving_routers(model: nn.Module) -> nn.Module:
    """DeepSeek-V3's (and Kimi-Linear's) routers computed in their input's dtype (HF casts them to float32)."""
    for module in model.modules():
        if type(module).__name__.endswith("TopkRouter"):
            module.forward = types.MethodType(_router, module)
    return model


def dtype_preserving(model: nn.Module) -> nn.Module:
    """HF rounds RMSNorm statistics, rotary angles and DeepSeek-V3's router through float32 by design; in fp64 they
    are computed in fp64 here, so that a comparison at 1e-10 compares the parallelism, not that rounding."""
    for module in model.modules():
        kind = type(module).__name__
        if kind.endswith("RMSNorm"):
            module.forward = types.MethodType(_rmsnorm, module)
        elif kind.endswith("RotaryEmbedding"):
            module.forward = types.MethodType(_rope, module)
        elif kind.endswith("TopkRouter"):
            module.forward = types.MethodType(_router, module)
    return model
