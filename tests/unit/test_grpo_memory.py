"""GRPO's memory terms against real tensors at a small size (loongtrain/objectives/grpo_memory.py): the resident
reference's weights are the bytes the run's reference model holds; the engine's weights and its KV cache are the
bytes transformers' ``generate`` holds (the cache within one token a sequence: the last token's keys are never
computed); ``loongtrain plan --objective grpo`` counts both; the simulation (launch/simulate/) holds both as the
objective's phases, and the planner's parts are close to it."""

from __future__ import annotations

import pytest
import torch

from loongtrain.launch.config import TrainConfig, run_of
from loongtrain.launch.simulate import simulate_step
from loongtrain.model.config import get_preset, num_params
from loongtrain.model.memory import States
from loongtrain.objectives.grpo_engine import TransformersEngine
from loongtrain.objectives.grpo_memory import ENGINE_BYTES, ResidentReference, RolloutEngine
from loongtrain.objectives.registry import objective_memory, objective_spec
from loongtrain.parallel.config import ParallelConfig
from loongtrain.parallel.layout import Layout
from loongtrain.parallel.mesh import single_process_mesh
from loongtrain.plan.memory_model import memory_per_rank
from tests.helpers.fixtures import tiny_model

MODEL = tiny_model()
PRESET = get_preset("tiny")


def _bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def test_the_resident_reference_is_the_reference_models_bytes():
    from loongtrain.train.trainer import Trainer

    cfg = TrainConfig.from_dict(dict(seq_len=32, batch_size=1, steps=1, dtype="fp32", parallel=ParallelConfig(),
                                     objective="grpo", doc_mask="on", position_reset=True, grpo_beta=0.04))
    trainer = Trainer(run_of(cfg, MODEL), single_process_mesh(), torch.device("cpu"))
    reference = trainer.objective.reference.model
    p = num_params(MODEL)
    assert _bytes(reference) == 4 * p and not any(q.requires_grad for q in reference.parameters())
    shape = type("S", (), {"model": MODEL})()
    states = ResidentReference().states(shape, States(p, 16.0 * p, 4.0 * p, 1))
    assert states.states - 16 * p == _bytes(reference)
    assert [type(t).__name__ for t in trainer.run.objective.memory()] == ["ResidentReference"]


def test_the_rollout_engine_is_the_bytes_generate_holds():
    engine = TransformersEngine.for_model(None, MODEL, torch.float32, 0, torch.device("cpu"))
    engine.load_weights((k, torch.zeros_like(v)) for k, v in engine.model.state_dict().items())
    assert _bytes(engine.model) == ENGINE_BYTES * num_params(MODEL)
    batch, prompt, new = 6, 5, 7
    ids = torch.randint(1, MODEL.vocab_size, (batch, prompt))
    with torch.no_grad():
        out = engine.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=new, min_new_tokens=new, return_dict_in_generate=True,
                                    pad_token_id=0)
    cache = out.past_key_values
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    term = RolloutEngine(batch, new, prompt_tokens=prompt)
    parts = {"states": 0.0}
    counted = term.phases(type("S", (), {"model": MODEL})(), parts, 0.0)["rollout"]
    per_token = 2 * MODEL.num_layers * MODEL.num_kv_heads * MODEL.head_dim * ENGINE_BYTES
    kv = (counted - batch * MODEL.vocab_size * 4) / (1 + 1 / (2 * MODEL.num_layers))  # less the concatenation's copy
    assert held <= kv <= held + batch * per_token, (held, kv)


def test_plan_counts_the_reference_and_the_engine():
    layout = Layout(world_size=1, hp=1, cp=1)
    common = dict(seq_len=64, batch=1, dtype_bytes=4, zero_size=1)
    plain = memory_per_rank(MODEL, layout, ParallelConfig(), **common)
    grpo = memory_per_rank(MODEL, layout, ParallelConfig(), features=objective_memory("grpo"), **common)
    p = num_params(MODEL)
    assert grpo["states"] - plain["states"] == 4 * p + ENGINE_BYTES * p
    assert grpo["reference"] > grpo["states"] and grpo["rollout"] > grpo["states"]
    assert grpo["total"] >= max(grpo["reference"], grpo["rollout"])


#: an online run with the KL penalty: the reference resident and the engine (its sizes small for the real tensors)
ONLINE = dict(objective="grpo", grpo_beta=0.04, prompts="prompts.jsonl", reward=("reward.py:score",),
              generation_batch_size=16, max_completion_length=64)


def test_simulated_reference_and_rollout_equal_real_tensors():
    """The simulation's phases ``reference`` and ``rollout`` (the objective's, from its memory terms, run after the
    step with its gradients held) and its peak, under fake tensors, equal the same step on real tensors (within
    2 KB, 0.02%: what the step leaves alive differs by that much)."""
    kw = dict(seq_len=256, batch=1, dtype="fp32", **ONLINE)
    fake = simulate_step(PRESET, ParallelConfig(), 1, fake=True, **kw)
    real = simulate_step(PRESET, ParallelConfig(), 1, fake=False, **kw)
    for phase in ("reference", "rollout"):
        (simulated, parts), (measured, real_parts) = fake.phases[(phase, False)], real.phases[(phase, False)]
        assert abs(simulated - measured) <= 0.001 * measured and measured > 0, (phase, simulated, measured)
        assert parts["gradient"] == real_parts["gradient"] > 0  # the last step's gradients are held
    assert abs(fake.peak_bytes - real.peak_bytes) <= 0.01 * real.peak_bytes


@pytest.mark.parametrize("seq_len, parallel, world, dtype, options", [
    (256, ParallelConfig(), 1, "fp32", ONLINE),
    (2048, ParallelConfig(hp=2, cp=2, zero="full"), 4, "bf16", ONLINE),
    (256, ParallelConfig(), 1, "bf16", dict(objective="grpo", **objective_spec("grpo").planned_options())),  # plan's
])
def test_planner_reference_and_rollout_are_close_to_the_simulation(seq_len, parallel, world, dtype, options):
    """The planner's ``reference`` and ``rollout`` parts and its peak, from the run's own terms, are within [0.95,
    1.2] of the simulated phases and peak (the tolerance of DPO's reference pass: tests/unit/
    test_post_training_memory.py, and its sizes); the simulation holds the resident reference and rank 0's
    engine."""
    simulated = simulate_step(PRESET, parallel, world, seq_len=seq_len, batch=1, dtype=dtype, **options)
    cfg = TrainConfig.from_dict(dict(seq_len=seq_len, parallel=parallel, dtype=dtype, **options))
    zero = parallel.shard_size(world) if parallel.zero != "none" else 1
    predicted = memory_per_rank(PRESET, parallel.layout(world), parallel, features=cfg.spec().recipe(cfg).memory(),
                                seq_len=seq_len, batch=1, dtype_bytes=2 if dtype == "bf16" else 4, zero_size=zero)
    for phase in ("reference", "rollout"):
        ratio = predicted[phase] / simulated.phases[(phase, False)][0]
        assert 0.95 <= ratio <= 1.2, (phase, ratio)
    ratio = predicted["total"] / simulated.peak_bytes
    assert 0.95 <= ratio <= 1.2, ratio
