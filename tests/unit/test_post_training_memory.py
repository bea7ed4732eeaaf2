"""DPO's reference pass in the planner and the simulation (docs/post-training.md#memory): the simulated pass
(launch/simulate/, phase ``reference``) counts what real tensors hold at a small size, the planner's
``reference`` part is within [0.95, 1.2] of it, and the planner's peak includes it."""

from __future__ import annotations

import pytest

from loongtrain.launch.simulate import simulate_step
from loongtrain.model.config import get_preset
from loongtrain.objectives.registry import objective_memory
from loongtrain.parallel.config import ParallelConfig
from loongtrain.plan.memory_model import memory_per_rank

MODEL = get_preset("tiny")


def test_simulated_reference_pass_equals_real_tensors():
    kw = dict(seq_len=512, batch=1, dtype="fp32", objective="dpo")
    fake = simulate_step(MODEL, ParallelConfig(hp=1, cp=1), 1, fake=True, **kw)
    real = simulate_step(MODEL, ParallelConfig(hp=1, cp=1), 1, fake=False, **kw)
    assert fake.phases[("reference", False)][0] == real.phases[("reference", False)][0] > 0
    assert abs(fake.peak_bytes - real.peak_bytes) <= 0.01 * real.peak_bytes


@pytest.mark.parametrize("seq_len, parallel, world, dtype", [
    (256, ParallelConfig(hp=1, cp=1), 1, "bf16"),
    (2048, ParallelConfig(hp=1, cp=1), 1, "fp32"),
    (2048, ParallelConfig(hp=2, cp=2, zero="full"), 4, "bf16"),
])
def test_planner_reference_part_is_close_to_the_simulation(seq_len, parallel, world, dtype):
    simulated = simulate_step(MODEL, parallel, world, seq_len=seq_len, batch=1, dtype=dtype, objective="dpo")
    zero = parallel.shard_size(world) if parallel.zero != "none" else 1
    kw = dict(seq_len=seq_len, batch=1, dtype_bytes=2 if dtype == "bf16" else 4, zero_size=zero)
    with_reference = memory_per_rank(MODEL, parallel.layout(world), parallel, features=objective_memory("dpo"), **kw)
    without = memory_per_rank(MODEL, parallel.layout(world), parallel, **kw)
    ratio = with_reference["reference"] / simulated.phases[("reference", False)][0]
    assert 0.95 <= ratio <= 1.2, ratio
    assert with_reference["total"] == max(without["total"], with_reference["reference"])
    assert "reference" not in without
