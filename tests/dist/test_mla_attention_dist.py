"""MLA's head dims through 2D-Attention (docs/attention.md#mla): a V head dim different from Q/K's, sharded equal to
unsharded in fp64 (1e-10, forward and dq/dk/dv) on 4 gloo ranks at hp2 x cp2, hp1 x cp4, the double ring and
pure Ulysses; with GQA, packed documents and a short sliding window too."""

from __future__ import annotations

import pytest

from tests.helpers.attention_cases import check_documents, check_exact
from tests.helpers.dist_utils import run_distributed

pytestmark = pytest.mark.distributed

CONFIGS = [dict(hp=2, cp=2), dict(hp=1, cp=4), dict(hp=1, cp=4, inner_ring=2), dict(hp=4, cp=1)]


def _short(seq: int, cp: int) -> int:
    return max(1, seq // (2 * cp) - 1)  # less than a chunk: the short pass at cp 4


def test_v_head_dim_unlike_qk_world4():
    counts = run_distributed(check_exact, 4, CONFIGS, [(4, 4), (4, 1)], [(24, 16), (16, 24)], "float64", 1e-10)
    assert min(counts) == len(CONFIGS) * 2 * 2 * 2, counts  # every layout, heads, dims, causal and not


def test_v_head_dim_unlike_qk_with_documents_world4():
    counts = run_distributed(check_documents, 4, CONFIGS, [(4, 2)], [None, _short], 1e-10, False, (24, 16))
    assert min(counts) == len(CONFIGS) * 2 * 2, counts
