"""``plan --max-seq-len`` bounded at any device count: one check per memory-distinct configuration, the
configurations enumerated once per grid of sequence-parallel sizes, and the answer ``plan``'s own first
candidate (loongtrain/plan/max_seq.py, docs/planner.md#search)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

import loongtrain.plan.max_seq as max_seq
from loongtrain.plan.max_seq import max_seq_len
from loongtrain.plan.memory_model import MEMORY_FREE_FIELDS, memory_key, memory_per_rank
from loongtrain.plan.search import enumerate_configs, plan
from tests.helpers.plan_cases import SMALL, toy_cluster

SMALL4 = dataclasses.replace(SMALL, num_layers=4)


def test_memory_does_not_depend_on_the_fields_the_key_leaves_out():
    """Every configuration of one key holds the same bytes, part by part (else the search would skip one)."""
    world, seq_len = 16, 4096
    configs = enumerate_configs(SMALL4, world, 4, seq_len, modes=True)
    groups: dict[tuple, list] = {}
    for c in configs:
        groups.setdefault(memory_key(c), []).append(c)
    varied = {f for g in groups.values() for c, d in itertools.combinations(g[:8], 2) for f in MEMORY_FREE_FIELDS
              if getattr(c, f) != getattr(d, f)}
    assert varied == set(MEMORY_FREE_FIELDS)  # placements and inner rings do share keys here
    for group in groups.values():
        parts = [memory_per_rank(SMALL4, c.layout(world), c, seq_len=seq_len, batch=1, dtype_bytes=2,
                                 zero_size=c.shard_size(world)) for c in group]
        assert all(p == parts[0] for p in parts), group


@pytest.mark.parametrize("kw", [dict(nodes=4, modes="off"), dict(nodes=4, modes="auto"), dict(nodes=2, modes="on"),
                                dict(gpus=2, modes="auto"), dict(nodes=4, hp=2, modes="auto"),
                                dict(nodes=4, zero="none", modes="auto")])
def test_the_answer_is_plans_first_candidate_at_that_length(kw):
    cluster = toy_cluster(memory_gib=2.0**-6)
    length, best = max_seq_len(SMALL4, cluster, **kw)
    first = plan(SMALL4, cluster, seq_len=length, **kw)[0]
    assert best.fits and best.config == first.config and best.memory == first.memory
    assert best.step_time == first.step_time


def test_configurations_are_enumerated_once_per_grid_not_once_per_length(monkeypatch):
    calls = []
    real = max_seq.enumerate_configs
    monkeypatch.setattr(max_seq, "enumerate_configs", lambda *a, **k: calls.append(a[3]) or real(*a, **k))
    checks = []
    fits = max_seq.fits_memory
    monkeypatch.setattr(max_seq, "fits_memory", lambda *a, **k: checks.append(a[1]) or fits(*a, **k))
    length, _ = max_seq_len(SMALL4, toy_cluster(memory_gib=1.0), nodes=16, modes="auto")
    steps = 2 * length.bit_length()  # the doubling and the bisection
    assert length > 64 * 16 * 64  # past the grid's last change (max_sp = the world)
    kinds = {memory_key(c) for c in real(SMALL4, 64, 4, length, modes=True)}
    configs = real(SMALL4, 64, 4, length, modes=True)
    assert len(kinds) < len(configs) / 2
    # a handful of enumerations (one per sp grid while the length is short, and the final ranking's), not one
    # per bisection step; each length checks each kind at most once
    assert len(calls) <= 2 + len({min(max_seq.max_sp(n), 64) for n in calls}), calls
    assert len(checks) <= steps * len(kinds) + 2 * len(configs)
