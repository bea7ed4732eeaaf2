"""Tiny random Hugging Face models of each supported family, their directories, fp64 patches of norms and RoPE."""

from __future__ import annotations

import types
from pathlib import Path

import torch

SEQ, VOCAB = 32, 64

# 4 query heads, 2 KV heads: hp=4 replicates KV heads (hp > num_kv_heads)
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2)


FAMILIES = {
    "LlamaForCausalLM": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "MistralForCausalLM": ("MistralConfig", dict(sliding_window=SEQ)),  # window == S: a no-op
    "Qwen2ForCausalLM": ("Qwen2Config", dict(tie_word_embeddings=True)),  # qkv bias
    "Qwen3ForCausalLM": ("Qwen3Config", dict(head_dim=16)),  # q/k norms, head_dim != hidden/heads
}

#: the model directories of :func:`make_hf_dir` train with the byte tokenizer (vocab 256), Mistral unwindowed
DIR_VOCAB = 256
DIR_COMMON = {**COMMON, "vocab_size": DIR_VOCAB}
DIR_FAMILIES = {**FAMILIES, "MistralForCausalLM": ("MistralConfig", dict(sliding_window=None))}


def fp64_rmsnorm(self, x):
    """RMSNorm's forward in the input's dtype (HF computes it in float32)."""
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def fp64_rope(self, x, position_ids):
    """RoPE's ``(cos, sin)`` from float64 angles (HF computes them in float32)."""
    head_dim = self.inv_freq.numel() * 2
    inv_freq = self.config.rope_parameters["rope_theta"] ** (
        -(torch.arange(head_dim // 2, dtype=torch.float64) * 2.0 / head_dim))
    angles = torch.cat([position_ids[..., None].double() * inv_freq] * 2, dim=-1)
    return angles.cos().to(x.dtype), angles.sin().to(x.dtype)


def make_hf_dir(path: Path, family: str = "LlamaForCausalLM", *, weights: bool = True, seed: int = 3,
                **overrides) -> Path:
    """A tiny model directory of ``family`` written with ``save_pretrained`` (config only without weights)."""
    import transformers

    config_name, extra = DIR_FAMILIES[family]
    config = getattr(transformers, config_name)(**{**DIR_COMMON, **extra, **overrides})
    config.architectures = [family]
    if not weights:
        config.save_pretrained(path)
        return path
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, family)(config)
        for param in model.parameters():  # HF zero-inits biases and ones-inits norms: make them matter
            if param.dim() == 1:
                param.data.add_(0.1 * torch.randn(param.shape))
    model.save_pretrained(path)
    return path


def tiny_hf(family: str, seed: int = 3, **overrides) -> torch.nn.Module:
    """A tiny fp64 model of ``family``, built locally; the same weights for the same seed."""
    import transformers

    config_name, extra = FAMILIES[family]
    config = getattr(transformers, config_name)(**{**COMMON, **extra, **overrides})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, family)(config)
    for param in model.parameters():  # HF zero-inits biases and ones-inits norms: make them matter
        if param.dim() == 1:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed + param.numel())
                param.data.add_(0.1 * torch.randn(param.shape))
    return model.double()


def force_fp64(model):
    """HF computes RMSNorm and RoPE angles in fp32 by design; compute them in fp64 to compare at 1e-10."""
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = types.MethodType(fp64_rmsnorm, module)
        elif type(module).__name__.endswith("RotaryEmbedding"):
            module.forward = types.MethodType(fp64_rope, module)
    return model
