"""Double-Ring-Attention across processes: a smoke of a few layouts at world 4 and 8, at least one per
placement and interleaving. Exactness for every (cp, inner_ring) runs in process, through the same ring
executor (tests/unit/test_schedule.py); placements only change which rank sits where, not the math."""

from __future__ import annotations

import pytest

from tests.helpers.attention_cases import check_exact
from tests.helpers.dist_utils import run_distributed

pytestmark = pytest.mark.distributed

CONFIGS = {
    4: [
        dict(hp=1, cp=4, inner_ring=2, placement="context_first", interleaved=True),
        dict(hp=2, cp=2, inner_ring=1, placement="head_first"),
    ],
    8: [
        dict(hp=1, cp=8, inner_ring=4, placement="head_first", interleaved=True),
        dict(hp=2, cp=4, inner_ring=2, placement="context_first"),
        dict(hp=1, cp=4, inner_ring=4, placement="head_first"),  # dp = 2
    ],
}


@pytest.mark.parametrize("world_size", sorted(CONFIGS))
def test_double_ring_layouts_are_exact(world_size):
    configs = CONFIGS[world_size]
    counts = run_distributed(check_exact, world_size, configs, [(8, 2), (4, 4)], [64], "float64", 1e-10)
    assert min(counts) >= len(configs)
