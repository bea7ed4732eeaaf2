"""The gradient sync, exact and safe (loongtrain/train/sync.py, optim.py; docs/kernels.md#gradient-sync): a
parameter that gets no gradient has the same AdamW state at world 1 and world 4; an exception inside the
overlapped sync on one rank reaches every rank within the heartbeat timeout, in one line naming the rank;
a one-parameter bucket is reduced in place."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from loongtrain.parallel.workers import WorkerError
from tests.helpers.dist_utils import run_distributed

WORLD = 4


class Net(nn.Module):
    """Three linear layers; the middle one is never used (no gradient on any rank)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.unused, self.last = (nn.Linear(8, 8).double() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.last(torch.tanh(self.first(x)))).sum()


def _adamw_state(world: int, rank: int) -> dict[str, Any]:
    """One optimizer step as the trainer takes it; the unused layer's weight, bias and AdamW state."""
    from loongtrain.launch.config import TrainConfig
    from loongtrain.train.optim import build_optimizer, clip_grad_norm, fill_missing_grads
    from loongtrain.train.sync import GradientSync

    net = Net()
    optimizer, _ = build_optimizer(net, TrainConfig.from_dict(dict(steps=2, warmup=0)).optim)
    sync = GradientSync(net, dp=world) if world > 1 else None
    x = torch.randn(3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    with sync.overlapped() if sync else torch.enable_grad():
        net(x).backward()
    params = [p for _, p in sorted(net.named_parameters())]
    fill_missing_grads(params)
    clip_grad_norm(params, 1.0)
    optimizer.step()
    state = {name: {k: v.clone() for k, v in optimizer.state[p].items()} for name, p in net.unused.named_parameters()}
    return {"params": {name: p.detach().clone() for name, p in net.unused.named_parameters()}, "state": state}


def _state_worker(rank: int, world: int) -> dict[str, Any]:
    return _adamw_state(world, rank)


@pytest.mark.distributed
def test_a_parameter_without_a_gradient_gets_the_same_adamw_state_at_world_1_and_4():
    alone = _adamw_state(1, 0)
    assert set(alone["state"]) == {"weight", "bias"} and all(alone["state"].values())  # updated, not skipped
    for r in run_distributed(_state_worker, WORLD):
        for name in ("weight", "bias"):
            torch.testing.assert_close(r["params"][name], alone["params"][name], rtol=1e-12, atol=1e-12)
            assert set(r["state"][name]) == set(alone["state"][name])
            for key, value in alone["state"][name].items():
                torch.testing.assert_close(r["state"][name][key], value, rtol=1e-12, atol=1e-12)


def _failure_worker(rank: int, world: int, out: str) -> None:
    """Rank 2 fails in its backward (its hooks launched nothing) and then stays alive for 5 s (as a process
    whose peers learn nothing from its exit: gloo's closed connections would end their all-reduces at once,
    NCCL's do not); every rank writes what it saw and how long it took, then re-raises."""
    from loongtrain.train.sync import GradientSync

    net = Net()
    sync = GradientSync(net, dp=world, bucket_bytes=8 * 8 * 8, poll_s=0.1)  # a tensor per bucket
    x = torch.randn(3, 8, dtype=torch.float64)
    dist.barrier()
    start = time.monotonic()
    try:
        with sync.overlapped():
            if rank == 2:
                raise RuntimeError("CUDA out of memory on this rank")
            net(x).backward()
    except Exception as exc:
        lines = str(exc).splitlines()
        Path(out, f"rank{rank}.json").write_text(json.dumps(
            {"type": type(exc).__name__, "lines": lines, "seconds": time.monotonic() - start}))
        if rank == 2:
            time.sleep(5)
        raise


@pytest.mark.distributed
def test_a_failure_inside_the_sync_reaches_every_rank_naming_it(tmp_path):
    with pytest.raises(WorkerError) as caught:
        run_distributed(_failure_worker, WORLD, str(tmp_path), timeout=120)
    assert "rank 2 failed: RuntimeError: CUDA out of memory" in str(caught.value)  # whichever rank reports first
    seen = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)}
    assert seen[2]["type"] == "RuntimeError"
    for r in (0, 1, 3):
        assert seen[r]["type"] == "PeerFailure" and len(seen[r]["lines"]) == 1
        assert seen[r]["lines"][0] == "gradient sync stopped: rank 2 failed: RuntimeError: CUDA out of memory on this rank"
        # the cause's own text reached them through the failure notice, not through rank 2's exit (which would
        # end their all-reduce with a connection error on gloo, and nothing at all on NCCL)


def _in_place_worker(rank: int, world: int) -> dict[str, Any]:
    from loongtrain.train.sync import GradientSync

    net = Net()
    sync = GradientSync(net, dp=world, bucket_bytes=8 * 8 * 8)  # every tensor alone in its bucket
    net(torch.randn(3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))).backward()
    before = {name: p.grad.data_ptr() for name, p in net.named_parameters() if p.grad is not None}
    local = {name: p.grad.clone() for name, p in net.named_parameters() if p.grad is not None}
    sync.reduce()
    after = {name: p.grad.data_ptr() for name, p in net.named_parameters() if name in before}
    return {"same_storage": before == after, "local": local,
            "reduced": {name: p.grad for name, p in net.named_parameters() if name in before}}


@pytest.mark.distributed
def test_one_parameter_buckets_reduce_in_place():
    results = run_distributed(_in_place_worker, 2)
    for r in results:
        assert r["same_storage"]
        for name, g in r["reduced"].items():
            want = (results[0]["local"][name] + results[1]["local"][name]) / 2
            torch.testing.assert_close(g, want, rtol=1e-12, atol=1e-12)
