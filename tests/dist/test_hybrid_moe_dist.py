"""Qwen3-Next and Kimi-Linear whole through 2D-Attention on 4 gloo ranks (docs/moe-and-gpt-oss.md#deepseek-v3-and-mla,
docs/linear-attention.md): their linear-attention layers (Gated DeltaNet; KDA) with state passing over the context
ranks, their softmax attention (Qwen3-Next's gated, with partial RoPE; Kimi-Linear's MLA without RoPE) and their
experts with shared experts (Qwen3-Next's softmax router and sigmoid-gated shared expert; Kimi-Linear's group-limited
sigmoid router with the score-correction bias) at hp2 x cp2 and hp1 x cp4, with and without packed documents: logits
and every parameter's gradient equal transformers' own unsharded model in fp64 (1e-10). The double ring of these
layers: tests/dist/test_linear_dist.py (Gated DeltaNet in Qwen3.5 whole, KDA alone) and
tests/dist/test_deepseek_v3_dist.py (MLA and the shared experts)."""

from __future__ import annotations

import pytest

from tests.helpers.dist_utils import run_distributed
from tests.helpers.hybrid_moe import FAMILIES, check_hybrid

pytestmark = pytest.mark.distributed

LAYOUTS = [dict(hp=2, cp=2), dict(hp=1, cp=4)]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hybrid_moe_equals_hf_unsharded_world4(family):
    results = run_distributed(check_hybrid, 4, family, LAYOUTS, 1e-10)
    assert all(len(r) == 2 * len(LAYOUTS) and max(max(e) for e in r) < 1e-10 for r in results), results
