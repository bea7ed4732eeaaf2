"""``--compile on`` on 4 gloo ranks (docs/design.md §13), one spawn: on ``(hp=2, cp=2)`` with full ZeRO
(FSDP2), Selective Checkpoint++, packed documents and the balanced chunk layout, compiled training equals
eager training (fp64, 3 AdamW steps, losses and parameters to 1e-10), and under compile Selective++ still
runs ring attention once per layer in forward and never in backward, sending exactly the backward traffic of
no checkpointing (the assertion of tests/test_recompute.py). Compiles with ``aot_eager``. Also: a measured
attention-kernel choice that differs between ranks becomes rank 0's on every rank."""

from __future__ import annotations

from typing import Any

import pytest

from tests.dist_utils import run_distributed

pytestmark = pytest.mark.distributed

TOL = 1e-10


def _worker(rank: int, world: int) -> dict[str, Any]:
    from loongtrain.parallel.comm import CommCounter
    from loongtrain.parallel.mesh import init_mesh
    from loongtrain.train.memory_report import trainer_loss_fn
    from loongtrain.wrap import compile as compile_step
    from tests.counting import count_ring_forward
    from tests.test_compile import doc_batch
    from tests.test_zero import compare, full_params, make_trainer, model_config

    compile_step.BACKEND = "aot_eager"
    mesh = init_mesh(2, 2)
    opts = {"doc_mask": "on", "chunk_layout": "balanced"}
    runs = {}
    for mode in ("off", "on"):
        trainer = make_trainer(mesh, ac_mode="selective", zero="full", train_opts={**opts, "compile": mode})
        losses = [trainer.step([doc_batch(s)])["loss"] for s in range(3)]
        runs[mode] = (trainer, (losses, full_params(trainer.model)))
    out: dict[str, Any] = {"diff": compare(runs["on"][1], runs["off"][1]), "layers": model_config().num_layers}
    for mode in ("off", "on"):  # the proof, on a batch whose documents the compiled blocks have not seen
        trainer = runs[mode][0]
        loss_fn = trainer_loss_fn(trainer, doc_batch(7))
        with count_ring_forward() as calls:
            loss = loss_fn()
            forward_calls = calls["ring_forward"]
            with CommCounter() as comm:
                loss.backward()
            out[mode] = {"forward_calls": forward_calls, "backward_calls": calls["ring_forward"] - forward_calls,
                         "backward_bytes": dict(comm.bytes)}
        trainer.optimizer.zero_grad(set_to_none=True)
    plain = make_trainer(mesh, zero="full", train_opts=opts)  # no checkpointing: the backward's own traffic
    loss_fn = trainer_loss_fn(plain, doc_batch(7))
    loss = loss_fn()
    with CommCounter() as comm:
        loss.backward()
    out["plain_backward_bytes"] = dict(comm.bytes)
    # the measured kernel choice is rank 0's on every rank (loongtrain.attn.kernel_choice.agree_across_ranks)
    from loongtrain.attn.cuda_kernels import CUDA_CUDNN, CUDA_FLASH
    from loongtrain.attn.kernel_choice import agree_across_ranks

    out["kernel"] = agree_across_ranks(CUDA_CUDNN if rank == 0 else CUDA_FLASH, [CUDA_FLASH, CUDA_CUDNN]).name
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(_worker, 4)


def test_compiled_training_equals_eager_on_four_ranks(results: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(results):
        assert result["diff"]["loss"] < TOL and result["diff"]["param"] < TOL, (rank, result["diff"])


def test_measured_kernel_choice_is_rank_0s_on_every_rank(results: list[dict[str, Any]]) -> None:
    assert [r["kernel"] for r in results] == ["cuda_cudnn"] * 4


def test_selective_checkpoint_under_compile_recomputes_no_attention_and_sends_nothing_more(
    results: list[dict[str, Any]],
) -> None:
    for rank, result in enumerate(results):
        for mode in ("off", "on"):
            proof = result[mode]
            assert proof["forward_calls"] == result["layers"] and proof["backward_calls"] == 0, (rank, mode, proof)
            assert proof["backward_bytes"] == result["plain_backward_bytes"], (rank, mode, proof)
