"""Hybrid ZeRO (FSDP2): every sharding setting trains exactly like replicated weights, and resumes exactly.

One gloo spawn of 4 ranks runs all cases (start-up dominates): on ``(hp=2, cp=1, dp=2)`` ``zero`` full and
hybrid(shard 2), each with ``reshard_after_forward`` True and False; on ``(hp=1, cp=2, dp=2)`` full/True
and hybrid/False. Each trains 3 AdamW steps in float64 and must match the replicated run of the same
layout (losses and parameters to 1e-10).
Then DCP: a checkpoint saved by a fully sharded run after step 2 is loaded by a fully sharded, a
hybrid and a replicated trainer, whose third step must equal the uninterrupted run's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.helpers.dist_utils import run_distributed
from tests.helpers.zero_cases import SEQ, STEPS, TOL, VOCAB, compare, full_params, make_trainer, replica_batch, train

pytestmark = pytest.mark.distributed


ZERO_CASES: dict[str, dict[str, Any]] = {
    "full": {"zero": "full"},
    "full_keep": {"zero": "full", "reshard_after_forward": False},
    "hybrid2": {"zero": "hybrid", "zero_shard_size": 2},
    "hybrid2_keep": {"zero": "hybrid", "zero_shard_size": 2, "reshard_after_forward": False},
}
# every setting on the head-parallel layout; one of each reshard choice on the ring layout (time budget),
# which also ties the embeddings (as the tiny preset does: the weight is used twice in the root group)
LAYOUT_CASES: dict[tuple[int, int], tuple[str, ...]] = {
    (2, 1): tuple(ZERO_CASES),
    (1, 2): ("full", "hybrid2_keep"),
}
TIED = {(2, 1): False, (1, 2): True}


def _zero_worker(rank: int, world: int, ckpt_dir: str) -> dict[str, Any]:
    from loongtrain.parallel.mesh import init_mesh
    from loongtrain.train.checkpoint import load_checkpoint, save_checkpoint
    from loongtrain.train.memory_report import memory_report
    out: dict[str, Any] = {"diff": {}, "memory": {}, "ref": {}}
    for (hp, cp), names in LAYOUT_CASES.items():
        mesh = init_mesh(hp, cp)
        plain = make_trainer(mesh, tied=TIED[(hp, cp)])
        ref = (train(plain, mesh, range(STEPS)), full_params(plain.model))
        out["ref"][(hp, cp)] = (ref[0], {n: t.numpy() for n, t in ref[1].items()})  # tensors can't cross
        out["memory"][(hp, cp, "none")] = memory_report(plain.model, plain.optimizer)
        for name in names:
            opts = ZERO_CASES[name]
            trainer = make_trainer(mesh, tied=TIED[(hp, cp)], **opts)
            sharded = all(type(p).__name__ == "DTensor" for p in trainer.model.parameters())
            assert sharded and not trainer.grad_sync, name
            got = (train(trainer, mesh, range(STEPS)), full_params(trainer.model))
            out["diff"][(hp, cp, name)] = compare(got, ref)
            out["memory"][(hp, cp, name)] = memory_report(trainer.model, trainer.optimizer)

    # the trainer's start-up report: measured on a micro-batch, gathered from every rank
    trainer = make_trainer(init_mesh(2, 1), zero="full", recompute="selective")
    out["startup"] = trainer.startup_memory_report(replica_batch(trainer.mesh, 0))
    out["startup_grads"] = [p.grad for p in trainer.model.parameters()]

    # DCP resume: save after step 2 from a fully sharded run, resume into several layouts
    mesh = init_mesh(1, 2)
    root = Path(ckpt_dir)
    first = make_trainer(mesh, zero="full")
    train(first, mesh, range(2))
    save_checkpoint(root, 2, first.model, first.optimizer, first.scheduler, {"micro_step": 2})
    final = (train(first, mesh, range(2, STEPS)), full_params(first.model))
    for name, opts in {"full": {"zero": "full"}, "hybrid2_keep": ZERO_CASES["hybrid2_keep"],
                       "none": {}}.items():
        resumed = make_trainer(mesh, **opts)
        state = load_checkpoint(root / "step_00000002", resumed.model, resumed.optimizer, resumed.scheduler)
        assert state["step"] == 2
        got = (train(resumed, mesh, range(2, STEPS)), full_params(resumed.model))
        out["diff"][("resume", name)] = compare(got, final)
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def zero_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(_zero_worker, 4, str(tmp_path_factory.mktemp("zero_ckpt")))


def test_replicated_reference_matches_single_process(zero_results: list[dict[str, Any]]) -> None:
    """The plain parallel run (the reference below) equals one process training the dp replicas' rows
    as one batch: gradients summed over sp ranks and averaged over dp replicas."""
    from loongtrain.data.synthetic import global_batch
    from loongtrain.parallel.mesh import single_process_mesh

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for (hp, cp), (losses, arrays) in zero_results[0]["ref"].items():
            params = {n: torch.from_numpy(a) for n, a in arrays.items()}
            mesh = single_process_mesh()
            single = make_trainer(mesh, tied=TIED[(hp, cp)], batch_size=2)
            ref_losses = [single.step([global_batch(s, 2, SEQ, VOCAB, seed=0)])["loss"] for s in range(STEPS)]
            diff = compare((ref_losses, full_params(single.model)), (losses, params))
            assert diff["loss"] < TOL and diff["param"] < TOL, ((hp, cp), diff)
    finally:
        torch.set_num_threads(before)


def test_zero_settings_match_replicated_training(zero_results: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(zero_results):
        cases = [k for k in result["diff"] if k[0] != "resume"]
        assert len(cases) == sum(len(v) for v in LAYOUT_CASES.values())
        for case in cases:
            diff = result["diff"][case]
            assert diff["loss"] < TOL and diff["param"] < TOL, (rank, case, diff)


def test_zero_checkpoint_resumes_exactly_in_any_layout(zero_results: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(zero_results):
        for case in (("resume", "full"), ("resume", "hybrid2_keep"), ("resume", "none")):
            diff = result["diff"][case]
            assert diff["loss"] < TOL and diff["param"] < TOL, (rank, case, diff)


def test_zero_shards_params_grads_and_optimizer_state(zero_results: list[dict[str, Any]]) -> None:
    """Summed over the 4 ranks, full sharding holds one copy of each, hybrid(2) two, replicated four."""
    for hp, cp in LAYOUT_CASES:
        per_rank = {name: [r["memory"][(hp, cp, name)] for r in zero_results]
                    for name in ("none", "full", "hybrid2_keep")}
        one_copy = per_rank["none"][0]["params"]
        for name, copies in (("none", 4), ("full", 1), ("hybrid2_keep", 2)):
            reports = per_rank[name]
            assert sum(r["params"] for r in reports) == copies * one_copy, name
            assert sum(r["grads"] for r in reports) == copies * one_copy, name
            optim = sum(r["optimizer_state"] for r in reports)
            assert not any(r["optimizer_state_estimated"] for r in reports)
            # exp_avg + exp_avg_sq per element, plus a scalar ``step`` per parameter tensor
            assert 2 * copies * one_copy <= optim <= 2 * copies * one_copy + 4 * 64 * 8, (name, optim)


def test_startup_memory_report(zero_results: list[dict[str, Any]]) -> None:
    for result in zero_results:
        report = result["startup"]
        assert report["activations"] > 0 and report["activation_tensors"] > 0
        assert report["optimizer_state_estimated"] == 1
        assert report["params"] == result["memory"][(2, 1, "full")]["params"]
        assert all(g is None for g in result["startup_grads"])  # measuring left no gradients behind
