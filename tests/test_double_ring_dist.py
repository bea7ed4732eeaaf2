"""Double-Ring-Attention and placements: exact for every valid (hp, cp, window, placement, interleaved)."""

from __future__ import annotations

import pytest

from loongtrain.parallel.layout import PLACEMENTS
from tests.attention_cases import check_exact, factorisations
from tests.dist_utils import run_distributed


def valid_configs(world_size: int) -> list[dict]:
    configs = []
    for hp, cp in factorisations(world_size):
        for window in (w for w in range(1, cp + 1) if cp % w == 0):
            for placement in PLACEMENTS:
                for interleaved in (False, True) if window % 2 == 0 else (False,):
                    configs.append(dict(hp=hp, cp=cp, window=window, placement=placement,
                                        interleaved=interleaved))
    return configs


@pytest.mark.parametrize("world_size", [4, 8])
def test_every_valid_layout_is_exact(world_size):
    configs = valid_configs(world_size)
    counts = run_distributed(check_exact, world_size, configs, [(8, 2), (4, 4)], [64], "float64", 1e-10)
    assert min(counts) >= len(configs)
