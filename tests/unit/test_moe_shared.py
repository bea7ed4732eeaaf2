"""The MoE blocks with shared experts run by loongtrain's MoE code (docs/moe-and-gpt-oss.md#deepseek-v3-and-mla):
DeepSeek-V3's and Kimi-Linear's (sigmoid scores, expert groups, the score-correction bias, routed scaling, a shared
MLP) and Qwen3-Next's (softmax top-k, a shared expert scaled by a sigmoid gate), bound with ``bind_moe``, equal HF's
own blocks in fp64, outputs and every gradient; the routing's group rules and the layouts read from config.json."""

from __future__ import annotations

import copy

import pytest
import torch

from loongtrain.hf.moe import SPARSE_BLOCKS, bind_moe, moe_layout
from loongtrain.model.moe import SIGMOID_GROUP_TOPK, MoESpec
from tests.helpers.deepseek import dtype_preserving

SMALL = dict(hidden_size=32, moe_intermediate_size=16, num_experts_per_tok=2, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4, vocab_size=64)
#: block class -> (config class, its settings)
BLOCKS = {
    "DeepseekV3MoE": ("DeepseekV3Config", dict(n_routed_experts=8, n_group=4, topk_group=2, n_shared_experts=2,
                                               routed_scaling_factor=2.5, first_k_dense_replace=1)),
    "KimiLinearMoE": ("KimiLinearConfig", dict(num_local_experts=8, n_group=2, topk_group=1, n_shared_experts=1,
                                               routed_scaling_factor=1.5, norm_topk_prob=False)),
    "Qwen3NextSparseMoeBlock": ("Qwen3NextConfig", dict(num_experts=8, shared_expert_intermediate_size=24,
                                                        norm_topk_prob=True)),
}


def _block(kind: str):
    import transformers

    config_name, extra = BLOCKS[kind]
    config = getattr(transformers, config_name)(**{**SMALL, **extra})
    config._experts_implementation = "eager"
    cls = getattr(_modeling(config), kind)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        block = cls(config).double()
        with torch.no_grad():
            for param in block.parameters():
                param.normal_(0.0, 0.4)
            for buffer in block.buffers():
                buffer.normal_(0.0, 0.2)  # the score-correction bias
    return block, config


def _modeling(config):
    import importlib

    return importlib.import_module(f"transformers.models.{config.model_type}.modeling_{config.model_type}")


@pytest.mark.parametrize("kind", list(BLOCKS))
def test_shared_expert_blocks_equal_hf(kind):
    ref, config = _block(kind)
    dtype_preserving(ref)  # DeepSeek-V3's and Kimi's routers compute in float32 by design: here in fp64
    block = copy.deepcopy(ref)

    class Holder(torch.nn.Module):  # bind_moe reads the model's config
        def __init__(self):
            super().__init__()
            self.mlp, self.config = block, config

    bind_moe(Holder())
    x = torch.randn(2, 9, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, y = ref(x_ref), block(x_ours)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-12)
    grad = torch.randn(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    y_ref.backward(grad)
    y.backward(grad)
    torch.testing.assert_close(x_ours.grad, x_ref.grad, rtol=0, atol=1e-12)
    ref_params = dict(ref.named_parameters())
    for name, param in block.named_parameters():
        assert ref_params[name].grad.abs().max() > 0, name  # the shared expert (and its gate) take part
        torch.testing.assert_close(param.grad, ref_params[name].grad, rtol=0, atol=1e-12, msg=name)
    if kind != "Qwen3NextSparseMoeBlock":  # the bias changes which experts run
        for buffer in block.buffers():
            buffer.zero_()
        assert (block(x) - y_ref).abs().max() > 1e-3


def test_layouts_from_config():
    import transformers

    deepseek = transformers.DeepseekV3Config(**{**SMALL, **BLOCKS["DeepseekV3MoE"][1]})
    kimi = transformers.KimiLinearConfig(**{**SMALL, **BLOCKS["KimiLinearMoE"][1], "num_hidden_layers": 3},
                                         first_k_dense_replace=2)
    qwen = transformers.Qwen3NextConfig(**{**SMALL, **BLOCKS["Qwen3NextSparseMoeBlock"][1]}, mlp_only_layers=[0])
    got = {name: moe_layout(c) for name, c in (("deepseek", deepseek), ("kimi", kimi), ("qwen", qwen))}
    assert (got["deepseek"].layers, got["deepseek"].shared_ffn_dim, got["deepseek"].load_balancing) == ((1,), 32, False)
    assert (got["kimi"].layers, got["kimi"].shared_ffn_dim, got["kimi"].load_balancing) == ((2,), 16, False)
    assert (got["qwen"].layers, got["qwen"].shared_ffn_dim, got["qwen"].load_balancing) == ((1,), 24, True)
    assert set(BLOCKS) <= set(SPARSE_BLOCKS)
    bad = transformers.DeepseekV3Config(**{**SMALL, **BLOCKS["DeepseekV3MoE"][1], "n_group": 3})
    with pytest.raises(ValueError, match="n_group=3, topk_group=2.*num_groups=3 must divide num_experts=8"):
        moe_layout(bad)


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_groups=3), "num_groups=3 must divide num_experts=8"),
    (dict(num_groups=4, top_groups=5), "top_groups=5 be at most num_groups"),
    (dict(num_groups=8), "each group needs 2 experts"),
    (dict(num_groups=4, top_groups=1, top_k=3), "the kept groups top_k=3"),
    (dict(num_groups=0), "num_groups=0 must be a positive integer"),
])
def test_bad_groups_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MoESpec(**{"num_experts": 8, "top_k": 2, "routing": SIGMOID_GROUP_TOPK, **kwargs})
