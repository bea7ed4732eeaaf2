"""gpt-oss's YaRN RoPE (factor 32, beta 32/1, ``truncate: false``, original 4096, theta 150000): loongtrain's
``rope_scaling`` gives HF's ``GptOssRotaryEmbedding`` frequencies (HF computes them in fp32: agreement to fp32
rounding) and attention factor, and ``truncate`` matters."""

from __future__ import annotations

import dataclasses

from loongtrain.hf.convert import rope_from_hf
from loongtrain.model.rope_scaling import attention_factor, inv_freq


def test_yarn_matches_hf_gpt_oss_rope():
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    config = GptOssConfig(num_hidden_layers=2)
    hf = GptOssRotaryEmbedding(config)
    theta, scaling = rope_from_hf(config)
    assert scaling.rope_type == "yarn" and scaling.truncate is False
    ours = inv_freq(config.head_dim, theta, scaling).double()
    assert ((ours - hf.inv_freq.double()) / hf.inv_freq.double()).abs().max() < 1e-6
    assert attention_factor(scaling) == hf.attention_scaling
    truncated = inv_freq(config.head_dim, theta, dataclasses.replace(scaling, truncate=True)).double()
    assert ((truncated - ours) / ours).abs().max() > 1e-3  # the flag is read
