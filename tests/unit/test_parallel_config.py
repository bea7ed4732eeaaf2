"""``ParallelConfig`` and ``validate_parallel``: every rule raises ValueError naming the value (no processes)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from loongtrain.parallel.config import (
    PLACEMENTS,
    RECOMPUTE_MODES,
    ZERO_MODES,
    ParallelConfig,
    effective_kv_heads,
    validate_parallel,
)
from loongtrain.parallel.layout import Layout


@pytest.mark.parametrize(
    ("opts", "words"),
    [
        ({"hp": 0}, ["hp=0", "positive"]),
        ({"cp": -2}, ["cp=-2", "positive"]),
        ({"inner_ring": 0}, ["inner_ring=0", "positive"]),
        ({"cp": 4, "inner_ring": 3}, ["inner_ring=3 must divide cp=4", "[1, 2, 4]"]),
        ({"placement": "ring_first"}, ["'ring_first'", *PLACEMENTS]),
        ({"cp": 4, "inner_ring": 1, "interleaved": True}, ["interleaved", "even inner ring", "inner_ring=1"]),
        ({"interleaved": "yes"}, ["interleaved='yes'"]),
        ({"zero": "zero3"}, ["'zero3'", *ZERO_MODES]),
        ({"zero_shard_size": -1, "zero": "hybrid"}, ["-1", ">= 0"]),
        ({"zero_shard_size": 2, "zero": "full"}, ["zero_shard_size=2", "hybrid"]),
        ({"reshard_after_forward": "yes"}, ["'yes'"]),
        ({"recompute": "partial"}, ["'partial'", *RECOMPUTE_MODES]),
        ({"recompute": "selective++"}, ["'selective++'", *RECOMPUTE_MODES]),  # no second names
        ({"recompute_fraction": 1.5}, ["1.5", "[0, 1]"]),
        ({"recompute_fraction": True}, ["True", "[0, 1]"]),
    ],
)
def test_world_independent_rules_raise_on_construction(opts: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        ParallelConfig(**opts)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_valid_config_defaults() -> None:
    cfg = ParallelConfig()
    assert (cfg.hp, cfg.cp, cfg.inner_ring, cfg.placement, cfg.zero, cfg.recompute) == (1, 1, 1, "head_first", "none",
                                                                                        "none")
    assert validate_parallel(ParallelConfig(hp=2, cp=4, inner_ring=2)) is None  # no world: nothing to return
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hp = 2  # type: ignore[misc]


def test_world_rules_and_returned_layout() -> None:
    cfg = ParallelConfig(hp=2, cp=4, inner_ring=2, placement="context_first", interleaved=True)
    layout = validate_parallel(cfg, 16)
    assert layout == Layout(16, 2, 4, 2, "context_first", True) == cfg.layout(16) and layout.dp == 2
    with pytest.raises(ValueError, match=r"world_size=12 is not divisible by hp\*cp=2\*4=8"):
        validate_parallel(cfg, 12)
    hybrid = ParallelConfig(zero="hybrid", zero_shard_size=3)
    assert hybrid.shard_size(6) == 3 and validate_parallel(hybrid, 6) is not None
    with pytest.raises(ValueError, match=r"zero_shard_size=3 must divide the world size 8 .*\[2, 4, 8\]"):
        validate_parallel(hybrid, 8)
    assert ParallelConfig(zero="full").shard_size(8) == 8
    assert ParallelConfig(zero="hybrid").shard_size(8) == 8  # 0: all ranks
    assert ParallelConfig().shard_size(8) == 1


def test_sequence_length_rule() -> None:
    cfg = ParallelConfig(hp=2, cp=2)
    validate_parallel(cfg, seq_len=16)
    with pytest.raises(ValueError, match=r"sequence length 12 must be divisible by 2\*cp\*hp = 2\*2\*2 = 8"):
        validate_parallel(cfg, seq_len=12)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "hp", "expected"),
    [(8, 8, 4, 8), (8, 2, 2, 2), (8, 2, 4, 4), (8, 1, 8, 8), (8, 4, 1, 4)],
)
def test_gqa_rule_effective_kv_heads(num_heads: int, num_kv_heads: int, hp: int, expected: int) -> None:
    assert effective_kv_heads(num_heads, num_kv_heads, hp) == expected
    validate_parallel(ParallelConfig(hp=hp), num_heads=num_heads, num_kv_heads=num_kv_heads)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "hp", "message"),
    [
        (8, 2, 3, "num_heads=8 must be divisible by hp=3"),
        (8, 6, 4, "num_heads=8 must be a multiple of num_kv_heads=6"),
        (12, 6, 4, "num_kv_heads=6 >= hp=4 must be divisible by hp"),
        (12, 4, 6, "hp=6 > num_kv_heads=4 must be a multiple of num_kv_heads"),
        (0, 1, 1, "num_heads=0"),
    ],
)
def test_gqa_rule_raises(num_heads: int, num_kv_heads: int, hp: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        effective_kv_heads(num_heads, num_kv_heads, hp)
    with pytest.raises(ValueError, match=message):
        validate_parallel(ParallelConfig(hp=hp), num_heads=num_heads, num_kv_heads=num_kv_heads)


def test_num_kv_heads_defaults_to_num_heads() -> None:
    validate_parallel(ParallelConfig(hp=4), num_heads=8)
    with pytest.raises(ValueError, match="num_heads=6 must be divisible by hp=4"):
        validate_parallel(ParallelConfig(hp=4), num_heads=6)
