"""The harness of the distributed tests that hold an objective's sharded training step to an unsharded reference
(tests/dist/test_grpo_dist.py, tests/dist/test_post_training_dist.py): the world-4 layouts, one step of a trainer
with its gradients by parameter name, and the check of every rank's loss and metrics and rank 0's gradients
against the reference (float64, within :data:`ATOL`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

#: ``(hp, cp)`` at world 4: heads x context, context alone, and dp2 x cp2 (two replicas, each its micro-steps)
WORLD4_LAYOUTS = ((2, 2), (1, 4), (1, 2))
ATOL = 1e-10

Reference = tuple[float, Mapping[str, torch.Tensor], Mapping[str, float]]


def param_name(name: str) -> str:
    """A parameter's name without the wrappers parallelization adds (checkpointing, compile)."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def step_with_grads(trainer: Any, micro_batches: list, rank: int) -> tuple[dict[str, Any], dict | None]:
    """``(trainer.step's result, {name: gradient} on rank 0, else None)`` of one step on ``micro_batches``."""
    result = trainer.step(micro_batches)
    grads = {param_name(n): p.grad.clone() for n, p in trainer.model.named_parameters()} if rank == 0 else None
    return result, grads


def assert_steps_equal(per_rank: Sequence[Mapping[tuple, tuple[dict, dict | None]]],
                       references: Mapping[str, Reference]) -> None:
    """Every rank's ``{(*layout, case): (result, grads)}`` (grads from rank 0) equals ``references[case] = (loss,
    {name: gradient}, {metric: value})``: the loss and each metric, and every gradient element, within
    :data:`ATOL`."""
    for rank, rank_out in enumerate(per_rank):
        for key, (result, _) in rank_out.items():
            loss, _, metrics = references[key[-1]]
            assert abs(result["loss"] - loss) < ATOL, (rank, key, result["loss"], loss)
            for name, value in metrics.items():
                assert abs(result[name] - value) < ATOL, (rank, key, name, result[name], value)
    for key, (_, grads) in per_rank[0].items():
        ref_grads = references[key[-1]][1]
        assert grads is not None and grads.keys() == ref_grads.keys(), (key, sorted(grads or ()), sorted(ref_grads))
        for name, grad in grads.items():
            err = (grad - ref_grads[name]).abs().max().item()
            assert err < ATOL, (key, name, err)
