"""Recompute: every mode trains exactly like no checkpointing, and selective recompute
recomputes neither attention nor any of its communication.

One gloo spawn of 4 ranks:

* equivalence on ``(hp=1, cp=2, dp=2)``: full, selective, selective on half the layers, selective and
  full with full ZeRO, full with hybrid ZeRO (gathered weights kept) — 3 float64 AdamW steps each against the
  plain run (losses and parameters to 1e-10);
* proof on ``(hp=2, cp=2, dp=1)`` (all-to-all and ring both active): ring-attention forward executions
  are counted by wrapping ``loongtrain.attn.ops.ring_forward`` (test-local patch), and attention
  traffic during backward by a ``CommCounter`` entered around ``backward()`` only. Selective++ must
  run attention forward once per layer and send exactly the no-checkpoint backward's traffic; full
  checkpointing runs it twice and sends more. Saved activations: none > selective recompute > full.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers.counting import count_ring_forward
from tests.helpers.dist_utils import run_distributed
from tests.helpers.zero_cases import (
    STEPS,
    TOL,
    compare,
    full_params,
    make_trainer,
    model_config,
    replica_batch,
    train,
)

pytestmark = pytest.mark.distributed

EQUIV_CASES: dict[str, dict[str, Any]] = {
    "full": {"recompute": "full"},
    "selective": {"recompute": "selective"},
    "selective_half": {"recompute": "selective", "recompute_fraction": 0.5},
    "selective_zero": {"recompute": "selective", "zero": "full"},
    "full_zero": {"recompute": "full", "zero": "full"},
    "full_hybrid_keep": {"recompute": "full", "zero": "hybrid", "zero_shard_size": 2,
                         "reshard_after_forward": False},
}
PROOF_CASES: dict[str, dict[str, Any]] = {
    "none": {},
    "selective": {"recompute": "selective"},
    "full": {"recompute": "full"},
    "selective_zero": {"recompute": "selective", "zero": "full"},
}


def _proof(mesh: Any, opts: dict[str, Any]) -> dict[str, Any]:
    from loongtrain.parallel.comm import CommCounter
    from loongtrain.train.memory_report import memory_report

    trainer = make_trainer(mesh, **opts)
    loss_fn = (lambda: trainer.loss(replica_batch(mesh, 0))[0])
    with count_ring_forward() as calls:
        with CommCounter() as fwd_comm:
            loss = loss_fn()
        forward_calls = calls["ring_forward"]
        with CommCounter() as bwd_comm:
            loss.backward()
        backward_calls = calls["ring_forward"] - forward_calls
    if trainer.grad_sync:  # replicated weights: the trainer's own all-reduce (FSDP reduced already)
        trainer.grad_sync.reduce()
    grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
             for n, p in trainer.model.named_parameters()}
    trainer.optimizer.zero_grad(set_to_none=True)
    report = memory_report(trainer.model, trainer.optimizer, loss_fn)
    return {
        "forward_calls": forward_calls,
        "backward_calls": backward_calls,
        "forward_ops": dict(fwd_comm.ops),
        "backward_ops": dict(bwd_comm.ops),
        "backward_bytes": dict(bwd_comm.bytes),
        "activations": report["activations"],
        "grads": grads,
    }


def _ckpt_worker(rank: int, world: int) -> dict[str, Any]:
    from loongtrain.parallel.mesh import init_mesh

    out: dict[str, Any] = {"diff": {}, "proof": {}}
    mesh = init_mesh(1, 2)
    plain = make_trainer(mesh)
    ref = (train(plain, mesh, range(STEPS)), full_params(plain.model))
    for name, opts in EQUIV_CASES.items():
        trainer = make_trainer(mesh, **opts)
        got = (train(trainer, mesh, range(STEPS)), full_params(trainer.model))
        out["diff"][name] = compare(got, ref)
    mesh = init_mesh(2, 2)
    for name, opts in PROOF_CASES.items():
        out["proof"][name] = _proof(mesh, opts)
    base = out["proof"]["none"]["grads"]
    for proof in out["proof"].values():
        grads = proof.pop("grads")
        proof["grad_diff"] = max((grads[n] - base[n]).abs().max().item() for n in base)
    return out


@pytest.fixture(scope="module")
def ckpt_results() -> list[dict[str, Any]]:
    return run_distributed(_ckpt_worker, 4)


def test_checkpoint_modes_match_plain_training(ckpt_results: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(ckpt_results):
        assert result["diff"].keys() == EQUIV_CASES.keys()
        for name, diff in result["diff"].items():
            assert diff["loss"] < TOL and diff["param"] < TOL, (rank, name, diff)


def test_selective_checkpoint_skips_attention_and_its_traffic_in_recompute(
    ckpt_results: list[dict[str, Any]],
) -> None:
    layers = model_config().num_layers
    for rank, result in enumerate(ckpt_results):
        proof = result["proof"]
        none, sel, full, sel_zero = proof["none"], proof["selective"], proof["full"], proof["selective_zero"]
        for name, p in proof.items():
            assert p["grad_diff"] < TOL, (rank, name, p["grad_diff"])
            assert p["forward_calls"] == layers, (rank, name, p)
            assert p["forward_ops"] == none["forward_ops"], (rank, name, p)
        assert none["forward_ops"]["a2a"] == 2 * layers and none["forward_ops"]["kv"] > 0
        # no attention forward and no attention traffic beyond the pure backward's
        for p in (none, sel, sel_zero):
            assert p["backward_calls"] == 0, (rank, p)
            assert p["backward_ops"] == none["backward_ops"], (rank, p)
            assert p["backward_bytes"] == none["backward_bytes"], (rank, p)
        # full checkpointing re-runs attention forward (and its all-to-alls and K/V ring) in backward
        assert full["backward_calls"] == layers
        assert full["backward_ops"]["a2a"] == none["backward_ops"]["a2a"] + 2 * layers
        assert full["backward_ops"]["kv"] == none["backward_ops"]["kv"] + none["forward_ops"]["kv"]
        assert full["backward_bytes"]["a2a"] > none["backward_bytes"]["a2a"]


def test_saved_activations_ordered_none_selective_full(ckpt_results: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(ckpt_results):
        act = {name: p["activations"] for name, p in result["proof"].items()}
        assert act["none"] > act["selective"] > act["full"] > 0, (rank, act)
        assert act["selective_zero"] == act["selective"], (rank, act)
