"""Attention sinks through 2D-Attention (docs/attention.md#attention-sinks): sharded equals HF gpt-oss's eager
formula on the whole sequence in fp64, forward and the gradients of q, k, v and the sinks, at hp2 x cp2,
hp1 x cp4, hp4 x cp1 and the double ring (inner ring 2), with GQA and replicated KV heads, packed documents, sliding
windows, causal and not."""

from __future__ import annotations

import pytest

from tests.helpers.dist_utils import run_distributed
from tests.helpers.sinks import check_sinks

pytestmark = pytest.mark.distributed

CONFIGS = [
    dict(hp=2, cp=2),
    dict(hp=1, cp=4),
    dict(hp=1, cp=4, inner_ring=2, placement="context_first", interleaved=True),
    dict(hp=2, cp=2, inner_ring=2),
    dict(hp=4, cp=1),  # one head (and its sink) per rank, KV heads replicated
]


def test_sinks_exact_at_world4():
    counts = run_distributed(check_sinks, 4, CONFIGS, [(4, 2), (4, 1)], [None, 5], 1e-10)
    assert min(counts) == len(CONFIGS) * 2 * 2 * 2 * 2, counts  # every case ran on every rank


def test_sinks_bfloat16_world4():
    # bf16 inputs and sinks, fp32 merge and fold; compared with fp64 math on the same (bf16-rounded) inputs
    counts = run_distributed(check_sinks, 4, CONFIGS[:2], [(4, 2)], [None, 5], 5e-2, "bfloat16")
    assert min(counts) == 2 * 2 * 2 * 2, counts
