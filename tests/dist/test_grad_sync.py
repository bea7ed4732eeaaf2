"""The replicated-weights gradient sync (``--zero none``, docs/memory.md): the bucket plan
(``loongtrain.parallel.buckets``), and on two gloo ranks the overlapped, bucketed all-reduce from gradient
hooks (``loongtrain.train.sync.GradientSync``) against an all-reduce of every gradient after the whole
backward (fp64, 1e-12): buckets launched while the backward runs, in bucket order on every rank, only for the
last micro-batch, with parameters that got no gradient on one rank; and the trainer's gradients and loss."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from loongtrain.parallel.buckets import BUCKET_BYTES, gradient_buckets
from tests.helpers.dist_utils import run_distributed
from tests.helpers.fixtures import tiny_model

TOL = dict(rtol=1e-12, atol=1e-12)


class Net(nn.Module):
    """Four linear layers; ``skip`` leaves one out of the forward (no gradient for its parameters)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(8, 8).double() for _ in range(4))

    def forward(self, x: torch.Tensor, skip: int | None = None) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if i != skip:
                x = torch.tanh(layer(x))
        return x.sum()


def _sync_worker(rank: int, world: int) -> dict[str, Any]:
    from loongtrain.train.sync import GradientSync

    net = Net()
    sync = GradientSync(net, dp=world, bucket_bytes=8 * 8 * 8 + 8 * 8)  # a layer per bucket: 4 buckets
    x = [torch.randn(3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(10 * rank + i))
         for i in range(2)]
    reduces: list[int] = []
    original = dist.all_reduce

    def counted(tensor, *args, **kwargs):
        reduces.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counted
    try:
        net(x[0]).backward()  # the first micro-batch: accumulated, not reduced
        first = [p.grad.clone() for p in net.parameters()]
        assert not reduces
        skip = 1 if rank == 1 else None  # on rank 1 one layer gets no gradient in the last micro-batch
        with sync.overlapped():
            net(x[1], skip=skip).backward()
            launched_in_backward = len(sync._launched)
        got = [p.grad.clone() for p in net.parameters()]
    finally:
        dist.all_reduce = original
    # the reference: each rank's accumulated local gradient, every one all-reduced after the backward
    net.zero_grad(set_to_none=True)
    net(x[0]).backward()
    local_first = [p.grad.clone() for p in net.parameters()]
    net(x[1], skip=skip).backward()
    want = []
    for p in net.parameters():
        g = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g)
        want.append(g / world)
    return {"got": got, "want": want, "reduces": reduces, "launched_in_backward": launched_in_backward,
            "buckets": len(sync.buckets), "first": first, "local_first": local_first}


def _worker(rank: int, world: int) -> dict[str, Any]:
    return {"sync": _sync_worker(rank, world), "trainer": _trainer_worker(rank, world)}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(_worker, 2)  # one spawn for both tests


@pytest.mark.distributed
def test_overlapped_buckets_equal_one_all_reduce_after_the_backward(results):
    results = [r["sync"] for r in results]
    for r in results:
        assert r["buckets"] == 4 and len(r["reduces"]) == 4, r["reduces"]  # one all-reduce per bucket
        assert r["reduces"] == results[0]["reduces"]  # the same collectives, in the same order, on every rank
        for got, want in zip(r["got"], r["want"], strict=True):
            torch.testing.assert_close(got, want, **TOL)
        for got, want in zip(r["first"], r["local_first"], strict=True):  # outside the block: local, untouched
            assert torch.equal(got, want)
    # rank 0: every bucket started from the hooks while the backward ran; rank 1 (layer 1 without a gradient)
    # the buckets before it only (bucket order), the rest when the block ends
    assert results[0]["launched_in_backward"] == 4
    assert results[1]["launched_in_backward"] == 2  # layers 3 and 2 (reverse order), then layer 1 is missing


def _trainer_worker(rank: int, world: int) -> dict[str, Any]:
    return {layout: _trainer_grads(*layout) for layout in ((1, 1), (1, 2))}  # dp = 2; cp = 2


def _trainer_grads(hp: int, cp: int) -> dict[bool, Any]:
    from loongtrain.data.synthetic import global_batch
    from loongtrain.parallel.config import ParallelConfig
    from loongtrain.parallel.mesh import init_mesh
    from loongtrain.launch.config import TrainConfig, run_of
    from loongtrain.train.trainer import Trainer

    mesh = init_mesh(hp, cp)
    cfg = TrainConfig.from_dict(dict(seq_len=16, batch_size=1, grad_accum=2, steps=2, warmup=1, dtype="fp64",
                      parallel=ParallelConfig(hp=hp, cp=cp)))
    rows = [global_batch(s, mesh.dp, 16, 64, seed=0) for s in range(2)]
    batches = [{k: v[mesh.dp_rank:mesh.dp_rank + 1] for k, v in b.items()} for b in rows]
    out = {}
    for overlapped in (True, False):
        trainer = Trainer(run_of(cfg, tiny_model()), mesh, torch.device("cpu"))
        assert trainer.grad_sync is not None
        if not overlapped:  # the reference: no hooks; every gradient all-reduced after the whole backward
            trainer.grad_sync.remove()
            trainer.grad_sync = None
        trainer.optimizer.zero_grad(set_to_none=True)
        loss = trainer._forward_backward([trainer.ctx.local(b) for b in batches])
        if not overlapped:
            for p in trainer.params:
                dist.all_reduce(p.grad)
                p.grad.div_(mesh.dp)
        out[overlapped] = (float(loss), {n: p.grad.clone() for n, p in trainer.model.named_parameters()})
    return out


@pytest.mark.distributed
def test_trainer_gradients_and_loss_equal_the_sync_after_the_backward(results):
    for by_layout in (r["trainer"] for r in results):
        for layout, r in by_layout.items():
            (loss, grads), (ref_loss, ref_grads) = r[True], r[False]
            assert loss == ref_loss, layout
            assert grads.keys() == ref_grads.keys()
            for name in grads:
                torch.testing.assert_close(grads[name], ref_grads[name], **TOL,
                                           msg=lambda m, n=name, lay=layout: f"{lay} {n}: {m}")
