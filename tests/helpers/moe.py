"""Shared pieces of the MoE tests: tiny random Hugging Face MoE models (fp64, HF's eager experts) of each family,
and an independent float64 reference of the router's load-balancing loss from HF's own router logits."""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 64
#: config class, causal-LM class and the family's own settings (Qwen3-MoE: one dense layer, renormalized top-k off)
MOE_FAMILIES = {
    "Qwen3MoeForCausalLM": ("Qwen3MoeConfig", dict(
        head_dim=16, intermediate_size=40, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2,
        decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=False, num_hidden_layers=3)),
    "MixtralForCausalLM": ("MixtralConfig", dict(
        intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2)),
}
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
              output_router_logits=True, router_aux_loss_coef=0.02, tie_word_embeddings=False)


def hf_moe_config(family: str, **overrides):
    import transformers

    config_name, extra = MOE_FAMILIES[family]
    config = getattr(transformers, config_name)(**{**COMMON, **extra, **overrides})
    config.architectures = [family]
    config._attn_implementation = "sdpa"  # exact in float64 (HF's "eager" attention rounds its softmax to float32)
    config._experts_implementation = "eager"  # HF's default here is its grouped GEMMs, which refuse float64
    return config


def tiny_moe(family: str, seed: int = 3, dtype: torch.dtype = torch.float64, **overrides) -> torch.nn.Module:
    """A tiny random model of ``family``; the same weights for the same seed; router weights scaled up so that
    routing is far from uniform, 1-D weights perturbed from HF's ones/zeros."""
    import transformers

    config = hf_moe_config(family, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, family)(config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if param.dim() == 1:
                    param.add_(0.1 * torch.randn(param.shape))
                elif name.endswith("gate.weight"):
                    param.normal_(0.0, 0.5)
    return model.to(dtype)


def write_moe_dir(path: Path, family: str, seed: int = 3, **overrides) -> Path:
    """A tiny MoE model directory: config.json (the implementations chosen here not recorded), fp32 weights."""
    model = tiny_moe(family, seed, torch.float32, **overrides)
    model.save_pretrained(path)
    values = json.loads((path / "config.json").read_text())
    values.pop("_attn_implementation", None)
    values.pop("_experts_implementation", None)
    (path / "config.json").write_text(json.dumps(values, indent=2))
    return path


def reference_aux_loss(router_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int) -> torch.Tensor:
    """HF's ``load_balancing_loss_func`` formula in float64 (HF itself sums in float32): the top-k fractions and
    mean probabilities over every token of every layer, multiplied, summed, times the number of experts."""
    counts = torch.zeros(num_experts, dtype=torch.float64)
    probs = torch.zeros(num_experts, dtype=torch.float64)
    rows = 0
    for logits in router_logits:
        p = torch.softmax(logits.double(), dim=-1)
        chosen = torch.topk(p, top_k, dim=-1).indices.reshape(-1)
        counts += torch.bincount(chosen, minlength=num_experts).double()
        probs += p.sum(dim=0)
        rows += logits.shape[0]
    return num_experts * torch.sum((counts / rows) * (probs / rows))
