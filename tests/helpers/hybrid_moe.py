"""Tiny Qwen3-Next and Kimi-Linear models (linear-attention layers between softmax-attention ones, and experts with
shared experts) and their check through 2D-Attention against transformers' own unsharded model in fp64
(docs/moe-and-gpt-oss.md#deepseek-v3-and-mla, docs/linear-attention.md)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=4, layer_types=LAYER_TYPES, intermediate_size=48,
              moe_intermediate_size=16, num_experts_per_tok=2, tie_word_embeddings=False)
#: Qwen3-Next: Gated DeltaNet (2 key, 4 value heads of 8), gated softmax attention with GQA and partial RoPE, a
#: dense first layer, then 8 experts (softmax top-2, renormalised) and a sigmoid-gated shared expert
QWEN3_NEXT = dict(COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2,
                  linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                  num_experts=8, shared_expert_intermediate_size=24, decoder_sparse_step=1, mlp_only_layers=[0],
                  norm_topk_prob=True, output_router_logits=True, router_aux_loss_coef=0.02,
                  max_position_embeddings=256)
#: Kimi-Linear: KDA (4 heads of 8), MLA without RoPE (q/k 16 + 8, values 12, a key/value latent of 16), a dense first
#: layer, then 8 experts in 2 groups (1 kept), top-2, sigmoid scores with the correction bias, a shared expert
KIMI_LINEAR = dict(COMMON, num_attention_heads=4, num_key_value_heads=4, linear_num_heads=4, linear_head_dim=8,
                   linear_conv_kernel_dim=4, num_local_experts=8, n_group=2, topk_group=1, routed_scaling_factor=2.0,
                   kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
                   first_k_dense_replace=1, pad_token_id=None, bos_token_id=None, eos_token_id=None)
FAMILIES = {"Qwen3NextForCausalLM": ("Qwen3NextConfig", QWEN3_NEXT),
            "KimiLinearForCausalLM": ("KimiLinearConfig", KIMI_LINEAR)}


def tiny_hybrid(family: str, seed: int = 3, **overrides: Any) -> nn.Module:
    """A tiny random ``family`` model in fp64 (sdpa attention, eager experts: exact in fp64), the same for the same
    seed: 1-D weights off HF's ones/zeros, routers scaled up, the score-correction biases set, KDA's gates as
    Kimi-Linear initialises them."""
    import transformers

    config_name, values = FAMILIES[family]
    config = getattr(transformers, config_name)(**{**values, **overrides})
    config.architectures = [family]
    config._attn_implementation = "sdpa"
    config._experts_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, family)(config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if param.dim() == 1:
                    param.add_(0.1 * torch.randn(param.shape))
                elif name.endswith("gate.weight"):
                    param.normal_(0.0, 0.5)
            for name, buffer in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buffer.copy_(0.2 * torch.randn(buffer.shape))
            for module in model.modules():
                if type(module).__name__ == "KimiLinearForgetGate":  # A_log = log U(1, 16), dt the softplus of U
                    module.A_log.copy_(torch.empty(module.A_log.shape).uniform_(1.0, 16.0).log())
                    dt = torch.empty(module.dt_bias.shape).uniform_(1e-3, 1e-1)
                    module.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
    return model.double()


def write_hybrid_dir(path: Any, family: str, seed: int = 3) -> Any:
    """A tiny ``family`` directory for the byte tokenizer (vocab 256), as ``save_pretrained`` writes it (Kimi-Linear:
    its checkpoint names, ``block_sparse_moe``, the three convolutions, the forget gate on the attention)."""
    import json
    from pathlib import Path

    path = Path(path)
    tiny_hybrid(family, seed, vocab_size=256).float().save_pretrained(path)
    values = json.loads((path / "config.json").read_text())
    values.pop("_attn_implementation", None)
    values.pop("_experts_implementation", None)
    (path / "config.json").write_text(json.dumps(values, indent=2))
    return path


def reference(family: str) -> nn.Module:
    """:func:`tiny_hybrid` with transformers' float32 steps made dtype-preserving: its norms, linear-attention
    layers and their torch fallbacks (tests/helpers/linear_models.py) and its sigmoid routers
    (tests/helpers/deepseek.py)."""
    from tests.helpers.deepseek import dtype_preserving_routers
    from tests.helpers.linear_models import fp64_reference

    return dtype_preserving_routers(fp64_reference(tiny_hybrid(family)))


def check_hybrid(rank: int, world_size: int, family: str, configs: list[dict], tol: float) -> list[list[float]]:
    """``family`` through ``bind_moe`` and ``apply_2d_attention`` == transformers' own unsharded model
    (dtype-preserving, each packed document alone): logits and every parameter's gradient, with and without packed
    documents, on each mesh of ``configs``."""
    import loongtrain
    from loongtrain.hf.moe import bind_moe
    from tests.helpers.gpt_oss import compare_sharded, hf_reference_forward

    def sharded_forward(model: nn.Module, ids: torch.Tensor, pos: torch.Tensor, docs: Any) -> torch.Tensor:
        bind_moe(model)  # the copy runs loongtrain's experts; the reference keeps transformers' eager ones
        extra = {"cu_seqlens": docs} if docs is not None else {}  # the router's statistics are loongtrain's
        return model(input_ids=ids, position_ids=pos, output_router_logits=False, **extra).logits

    results = []
    for cfg in configs:
        mesh = loongtrain.init_mesh(**cfg)
        for with_documents in (False, True):
            results.append(compare_sharded(reference(family), hf_reference_forward, mesh, 32, with_documents, tol,
                                           sharded_forward=sharded_forward))
    return results
