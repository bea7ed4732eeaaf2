"""The chunked loss sharded over the sequence (world 2) and with FSDP2's gathered root head equals the unsharded loss and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
import loongtrain
from loongtrain.loss.chunked import (
    IGNORE_INDEX,
    chunked_cross_entropy,
    chunked_loss_peak_bytes,
    default_chunk_tokens,
)
from loongtrain.loss.sharded import sharded_cross_entropy
from tests.helpers.dist_utils import run_distributed
from tests.helpers.chunked_loss_cases import _data, _grads, _reference


def _check_sp(rank: int, world_size: int) -> int:
    mesh = loongtrain.init_mesh(hp=1, cp=world_size)
    hidden, weight, bias, labels = _data(2, 24, 8, 30, torch.float64, seed=5)
    ref = _grads(lambda h, w, b: _reference(h, w, b, labels), hidden, weight, bias)
    shard = lambda t: loongtrain.shard_sequence(t, mesh, dim=1)  # noqa: E731
    got = _grads(lambda h, w, b: chunked_cross_entropy(h, w, shard(labels), mesh, chunk_tokens=5, bias=b),
                 shard(hidden), weight, bias)
    torch.testing.assert_close(got[1], ref[1], rtol=0, atol=1e-12)
    torch.testing.assert_close(got[2][0], shard(ref[2][0]), rtol=0, atol=1e-12)
    for g, r in zip(got[2][1:], ref[2][1:], strict=True):
        dist.all_reduce(g, group=mesh.sp_group)
        torch.testing.assert_close(g, r, rtol=0, atol=1e-12)
    return 1


class _TinyLM(nn.Module):
    def __init__(self, vocab: int, dim: int, tie: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.block = nn.Linear(dim, dim)
        self.head = None if tie else nn.Linear(dim, vocab, bias=False)

    def head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.head is None else self.head.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.block(self.embed(tokens)))


def _check_fsdp(rank: int, world_size: int) -> int:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device_mesh = init_device_mesh("cpu", (world_size,))
    gen = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, 24, (2, 9), generator=gen)
    labels = torch.randint(0, 24, (2, 9), generator=gen)
    labels[0, :3] = IGNORE_INDEX
    checked = 0
    for tie in (False, True):
        torch.manual_seed(0)
        plain = _TinyLM(24, 6, tie).double()
        sharded = _TinyLM(24, 6, tie).double()
        sharded.load_state_dict(plain.state_dict())
        fully_shard(sharded.block, mesh=device_mesh, reshard_after_forward=True)
        fully_shard(sharded, mesh=device_mesh, reshard_after_forward=False)  # root stays gathered
        _reference(plain(tokens), plain.head_weight(), None, labels)[0].backward()
        loss, _ = chunked_cross_entropy(sharded(tokens), sharded.head_weight(), labels, None, chunk_tokens=4)
        loss.backward()  # every rank has the same data: FSDP's average equals the plain gradient
        for (name, p), q in zip(sharded.named_parameters(), plain.parameters(), strict=True):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=0, atol=1e-12, msg=f"{name} {tie=}")
        checked += 1
    resharded = _TinyLM(24, 6, False).double()
    fully_shard(resharded, mesh=device_mesh, reshard_after_forward=True)
    hidden = resharded(tokens)
    with pytest.raises(ValueError, match="DTensor"):
        chunked_cross_entropy(hidden, resharded.head_weight(), labels, None)
    return checked


@pytest.mark.distributed
def test_sp_sharded_matches_unsharded_world2():
    assert run_distributed(_check_sp, 2) == [1, 1]


@pytest.mark.distributed
def test_fsdp2_gathered_root_head_world2():
    assert run_distributed(_check_fsdp, 2) == [2, 2]
