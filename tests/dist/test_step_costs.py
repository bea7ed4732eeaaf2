"""What one training step costs the host (docs/launching.md), counted on two gloo ranks (cp = 2, documents on,
selective recompute, two micro-batches):

- the host-side exchanges of a steady-state step (every torch.distributed collective but attention's own
  all-to-all and P2P) are as many for a 12-layer model as for a 2-layer one, while the per-call agreement
  (``per_call_checks``) makes one per attention call;
- one device-to-host read per step (``.item()``/``float()`` through ``aten._local_scalar_dense``, and
  ``.tolist()``/``.numpy()`` of floating tensors), whether or not the step's values are read for a log line;
- ranks whose attention arguments differ still fail on every rank with a ValueError naming the field, before
  the optimizer step (a digest checked at the step's end; documents that differ: before any attention call),
  and the next agreed step runs.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.helpers.counting import counted_reads
from tests.helpers.dist_utils import run_distributed
from tests.helpers.fixtures import tiny_model

pytestmark = pytest.mark.distributed

SEQ, ROWS = 32, 2
ATTENTION_OWN = {"all_to_all_single", "batch_isend_irecv"}  # (the ring posts isend/irecv through the latter)
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list", "barrier",
               "reduce_scatter_tensor", "all_gather_into_tensor", "gather_object", *sorted(ATTENTION_OWN))


def packed_batch(step: int, starts: tuple[int, ...] = (3, 4, 13, 29)) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(1, 64, (ROWS, SEQ + 1), generator=gen)
    doc_starts = torch.zeros(ROWS, SEQ, dtype=torch.bool)
    doc_starts[:, 0] = True
    doc_starts[0, list(starts)] = True
    doc_starts[1, [17]] = True
    return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:],
            "position_ids": torch.arange(SEQ).expand(ROWS, SEQ).contiguous(), "doc_starts": doc_starts}


@contextmanager
def counted_collectives() -> Iterator[Counter]:
    """Count the outermost torch.distributed collective calls by name (all_gather_object's inner
    all_gather is not counted again)."""
    calls: Counter = Counter()
    originals = {name: getattr(dist, name) for name in COLLECTIVES}
    depth = [0]

    def wrap(name, fn):
        def counted(*args, **kwargs):
            if depth[0] == 0:
                calls[name] += 1
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
        return counted

    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def make_trainer(mesh: Any, layers: int, grad_accum: int = 2, **options: Any) -> Any:
    from loongtrain.parallel.config import ParallelConfig
    from loongtrain.launch.config import TrainConfig, run_of
    from loongtrain.train.trainer import Trainer

    cfg = TrainConfig.from_dict(dict(seq_len=SEQ, batch_size=ROWS, grad_accum=grad_accum, steps=4, warmup=1, dtype="fp64",
                      doc_mask="on", parallel=ParallelConfig(hp=mesh.hp, cp=mesh.cp, recompute="selective")))
    return Trainer(run_of(cfg, tiny_model(num_layers=layers)), mesh, torch.device("cpu"), **options)


def _params(trainer: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def _costs(rank: int, world: int) -> dict[str, Any]:
    from loongtrain.parallel import agreement
    from loongtrain.parallel.mesh import init_mesh

    mesh = init_mesh(1, 2)
    out: dict[str, Any] = {}
    calls = Counter()
    original = agreement.agree_on_attention

    def counting(*args, **kwargs):
        calls["attention"] += 1
        return original(*args, **kwargs)

    agreement.agree_on_attention = counting  # what loongtrain.attention calls (imported by name there too)
    from loongtrain.attn import api
    api.agree_on_attention = counting
    def counted_step(trainer: Any, step: int, read: bool, reads: bool) -> dict[str, int]:
        calls.clear()
        steps = {id(state["step"]) for state in trainer.optimizer.state.values()}
        batches = [packed_batch(step + i) for i in range(trainer.cfg.data.grad_accum)]
        with counted_collectives() as comm, counted_reads(steps) if reads else contextlib.nullcontext() as seen:
            trainer.step(batches, read=read)
        return {"host": sum(n for name, n in comm.items() if name not in ATTENTION_OWN),
                "attention_own": sum(n for name, n in comm.items() if name in ATTENTION_OWN),
                "reads": seen.count if seen is not None else None, "attention_calls": calls["attention"]}

    try:
        for layers in (2, 12):  # each model's first step, one micro-batch (12 layers are slow on a shared CPU)
            for step in (0, 1):
                out[(step, layers)] = counted_step(make_trainer(mesh, layers, grad_accum=1), step, False, False)
        trainer = make_trainer(mesh, 2)
        trainer.step([packed_batch(0), packed_batch(1)])
        for read in (False, True):  # steady state, with and without the values read for a log line
            out[("steady", read)] = counted_step(trainer, 2, read, True)
        trainer.per_call_checks = True  # the agreement direct library use has
        out["per_call"] = counted_step(trainer, 2, False, False)
        trainer.per_call_checks = False
    finally:
        agreement.agree_on_attention = original
        api.agree_on_attention = original
    out["disagreement"] = _disagreements(rank, trainer)
    return out


def _disagreements(rank: int, trainer: Any) -> dict[str, Any]:
    """One rank's model passes another softmax scale to every attention call; then one rank's batch has other
    documents; then an agreed step. Errors by case, and whether the parameters moved."""
    from loongtrain.attn.apply import MeshAttention
    from tests.helpers.counting import count_ring_forward

    before = _params(trainer)
    result: dict[str, Any] = {}
    call = MeshAttention.__call__

    def other_scale(self, q, k, v, **kwargs):
        return call(self, q, k, v, **{**kwargs, "softmax_scale": 0.25})

    if rank == 1:
        MeshAttention.__call__ = other_scale
    try:
        trainer.step([packed_batch(2), packed_batch(3)])
    except ValueError as exc:
        result["scale"] = str(exc)
    finally:
        MeshAttention.__call__ = call
    result["scale_moved"] = any(not torch.equal(p, before[n]) for n, p in _params(trainer).items())
    other = (3, 5, 13, 29) if rank == 1 else (3, 4, 13, 29)
    with count_ring_forward() as ring:
        try:
            trainer.step([packed_batch(2), packed_batch(3, starts=other)])
        except ValueError as exc:
            result["documents"] = str(exc)
    result["documents_ring_calls"] = ring["ring_forward"]
    result["documents_moved"] = any(not torch.equal(p, before[n]) for n, p in _params(trainer).items())
    result["agreed_loss"] = trainer.step([packed_batch(4), packed_batch(5)])["loss"]
    return result


@pytest.fixture(scope="module")
def costs() -> list[dict[str, Any]]:
    return run_distributed(_costs, 2, timeout=300)


def test_host_exchanges_per_step_do_not_grow_with_depth(costs):
    keys = ("host", "attention_own", "attention_calls")
    for rank_out in costs:
        shallow, deep = rank_out[(0, 2)], rank_out[(0, 12)]
        assert deep["attention_calls"] == 6 * shallow["attention_calls"] > 0  # 12 vs 2 layers
        assert deep["attention_own"] > shallow["attention_own"]  # the ring's P2P grows with depth
        assert shallow["host"] == deep["host"], (shallow, deep)
        for layers in (2, 12):  # a later step costs what the first did (the steady state)
            assert all(rank_out[(1, layers)][key] == rank_out[(0, layers)][key] for key in keys)
        # two micro-batches: the per-call agreement makes one exchange per call instead of the sharding's and
        # the digest's
        steady, old = rank_out[("steady", False)], rank_out["per_call"]
        assert all(rank_out[("steady", True)][key] == steady[key] for key in keys)
        assert old["attention_calls"] == steady["attention_calls"] == 2 * shallow["attention_calls"]
        assert old["host"] - steady["host"] == steady["attention_calls"] - 2, (old, steady)


def test_one_device_read_per_step(costs):
    for rank_out in costs:
        for read in (False, True):
            assert rank_out[("steady", read)]["reads"] == 1, rank_out[("steady", read)]


def test_differing_attention_arguments_fail_every_rank_before_the_optimizer(costs):
    for rank, rank_out in enumerate(costs):
        got = rank_out["disagreement"]
        assert "softmax_scale: None on ranks [0], 0.25 on ranks [1]" in got["scale"], got
        assert "attention (call 1 of" in got["scale"], got
        assert "training step" in got["documents"] and "documents:" in got["documents"], got
        assert "on ranks [0]" in got["documents"] and "on ranks [1]" in got["documents"], got
        assert got["documents_ring_calls"] == 0  # refused before any attention ran
        assert not got["scale_moved"] and not got["documents_moved"]  # no optimizer step applied
        assert got["agreed_loss"] == costs[0]["disagreement"]["agreed_loss"], rank
