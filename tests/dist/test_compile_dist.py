"""``--compile on`` on 4 gloo ranks (docs/compile.md), one spawn.

- **Inductor** (the backend ``--compile on`` runs, which asserts every op output's strides): on
  ``(hp=2, cp=2)`` with full ZeRO (FSDP2), selective recompute, packed documents and the balanced chunk
  layout, compiled training equals eager training (fp64, 3 AdamW steps, losses and parameters to 1e-10), all
  blocks run one compiled graph, and under compile Selective++ still runs ring attention once per layer in
  forward and never in backward, sending exactly the backward traffic of no checkpointing (the assertion of
  tests/dist/test_recompute.py).
- **The ops' fake implementations** give the real sizes, strides and storage offsets
  (``torch.library.opcheck``) for every call the ring makes at ``hp x cp`` = 2x2, 4x1 (one member: the whole
  path, KV heads replicated), 1x4 and 1x4 as a double ring (inner_ring 2): batch 1 with documents in the
  balanced layout, batch 2 without documents, with a sliding window (an all-to-all's result is a view for
  batch 1, a copy otherwise).
- A measured attention-kernel choice that differs between ranks becomes rank 0's on every rank.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers.dist_utils import run_distributed

pytestmark = pytest.mark.distributed

TOL = 1e-10
LAYOUTS = ((2, 2, 1), (4, 1, 1), (1, 4, 1), (1, 4, 2))  # (hp, cp, inner_ring)


def _opcheck_layouts() -> dict[str, int]:
    """opcheck of every distinct loongtrain op call of an attention forward and backward at each layout;
    returns the number of calls checked per ``"hp x cp / inner_ring op"``."""
    import torch

    from loongtrain.attn.api import attention
    from loongtrain.parallel.documents import balanced_chunk_order
    from loongtrain.parallel.mesh import init_mesh
    from loongtrain.parallel.sharding import shard_sequence
    from tests.helpers.counting import record_loongtrain_ops

    seq, docs, checked = 64, [0, 5, 30, 41, 64], {}
    for hp, cp, inner_ring in LAYOUTS:
        mesh = init_mesh(hp, cp, inner_ring=inner_ring)
        # batch 1 with documents in the balanced layout; batch 2 without, with a sliding window
        for batch, masks in ((1, {"cu_seqlens": [torch.tensor(docs)],
                                  "chunk_order": balanced_chunk_order([docs], seq, cp, hp)}),
                             (2, {"sliding_window": 20})):
            gen = torch.Generator().manual_seed(batch)
            q, k, v = (torch.randn(batch, seq, h, 8, dtype=torch.float64, generator=gen) for h in (4, 2, 2))
            local = [shard_sequence(t, mesh, 1, masks.get("chunk_order")).requires_grad_() for t in (q, k, v)]
            with record_loongtrain_ops() as calls:
                attention(*local, mesh, **masks).square().sum().backward()
            for op, args in calls:
                tests = ("test_schema", "test_faketensor")
                if "backward" not in str(op):  # the forward ops' autograd is registered
                    args = tuple(a.requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point()
                                 else a for a in args)
                    tests += ("test_autograd_registration",)
                torch.library.opcheck(op, args, test_utils=tests)
                name = f"{hp}x{cp}/{inner_ring} {op}"
                checked[name] = checked.get(name, 0) + 1
    return checked


def _worker(rank: int, world: int) -> dict[str, Any]:
    import torch

    from loongtrain.parallel.comm import CommCounter
    from loongtrain.parallel.mesh import init_mesh
    from loongtrain.parallelize import compile as compile_step
    from tests.helpers.counting import count_ring_forward
    from tests.helpers.doc_batches import doc_batch
    from tests.helpers.zero_cases import compare, full_params, make_trainer, model_config

    out: dict[str, Any] = {"opcheck": _opcheck_layouts()}
    from tests.helpers.compiled_graphs import GraphCounter

    counter = GraphCounter("inductor")  # --compile on's backend, counted by this rank (not dynamo's counters)
    compile_step.BACKEND = counter
    torch._inductor.config.compile_threads = 1  # no compile-worker pool per rank: 4 ranks share 2 cores
    mesh = init_mesh(2, 2)
    opts = {"doc_mask": "on", "chunk_order": "balanced"}
    runs = {}
    for mode in ("off", "on"):
        trainer = make_trainer(mesh, recompute="selective", zero="full", train_opts={**opts, "compile": mode})
        losses = [trainer.step([doc_batch(s)])["loss"] for s in range(3)]
        runs[mode] = (trainer, (losses, full_params(trainer.model)))
    out |= {"diff": compare(runs["on"][1], runs["off"][1]), "layers": model_config().num_layers}
    for mode in ("off", "on"):  # the proof, on a batch whose documents the compiled blocks have not seen
        trainer = runs[mode][0]
        loss_fn = (lambda: trainer.loss(doc_batch(7))[0])
        with count_ring_forward() as calls:
            loss = loss_fn()
            forward_calls = calls["ring_forward"]
            with CommCounter() as comm:
                loss.backward()
            out[mode] = {"forward_calls": forward_calls, "backward_calls": calls["ring_forward"] - forward_calls,
                         "backward_bytes": dict(comm.bytes)}
        trainer.optimizer.zero_grad(set_to_none=True)
    out["graphs"] = counter.count
    plain = make_trainer(mesh, zero="full", train_opts=opts)  # no checkpointing: the backward's own traffic
    loss_fn = (lambda: plain.loss(doc_batch(7))[0])
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


def test_inductor_training_equals_eager_on_four_ranks_in_one_graph(results: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(results):
        assert result["diff"]["loss"] < TOL and result["diff"]["param"] < TOL, (rank, result["diff"])
        assert result["graphs"] == 1, (rank, result["graphs"])  # both blocks, documents throughout


def test_op_fakes_match_the_real_layouts_of_every_ring(results: list[dict[str, Any]]) -> None:
    ops = ("head_all_to_all", "ring_attention", "ring_attention_backward")
    for rank, result in enumerate(results):
        expected = {f"{hp}x{cp}/{inner_ring} loongtrain.{op}.default" for hp, cp, inner_ring in LAYOUTS for op in ops
                    if hp > 1 or op != "head_all_to_all"}  # no all-to-all without head parallelism
        assert set(result["opcheck"]) == expected, (rank, result["opcheck"])


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
