"""Rank placement, zigzag sharding indices and input validation (no communication)."""

from __future__ import annotations

import pytest
import torch

import loongtrain
from loongtrain.parallel.layout import Layout
from loongtrain.parallel.zigzag import replica_permutation, shard_indices


def test_head_first_puts_head_groups_on_consecutive_ranks():
    layout = Layout(world_size=16, hp=4, cp=2)
    assert layout.dp == 2
    assert layout.head_groups()[:2] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.context_groups()[:2] == [[0, 4], [1, 5]]
    assert layout.coords(13) == (1, 1, 1)


def test_context_first_puts_ring_neighbours_on_consecutive_ranks():
    layout = Layout(world_size=8, hp=2, cp=4, placement="context_first")
    assert layout.context_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.head_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_double_ring_peers_and_interleaving():
    layout = Layout(world_size=8, hp=1, cp=8, inner_ring=4, placement="context_first")
    assert layout.ring_peers(1) == {"inner_next": 2, "inner_prev": 0, "outer_next": 5, "outer_prev": 5}
    inter = Layout(world_size=8, hp=1, cp=8, inner_ring=4, placement="context_first", interleaved=True)
    # ring members 0,1,2,3 of an inner ring sit on slots 0,2,1,3: NIC-sharing pairs hold members i, i+2
    assert inter.context_groups() == [[0, 2, 1, 3, 4, 6, 5, 7]]
    assert inter.ring_peers(2)["inner_next"] == 1


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=6, hp=4, cp=1), "not divisible by hp\\*cp"),
    (dict(world_size=8, hp=1, cp=8, inner_ring=3), "inner_ring=3 must divide cp=8"),
    (dict(world_size=8, hp=1, cp=8, placement="ring_first"), "placement='ring_first'"),
    (dict(world_size=8, hp=1, cp=8, inner_ring=1, interleaved=True), "even inner ring"),
    (dict(world_size=8, hp=0, cp=8), "hp=0"),
])
def test_invalid_layouts_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Layout(**kwargs)


@pytest.mark.parametrize("hp, cp", [(1, 1), (2, 1), (1, 2), (2, 2), (3, 2), (2, 4)])
def test_zigzag_permutation(hp, cp):
    seq = 2 * hp * cp * 3
    perm = replica_permutation(seq, hp, cp)
    assert sorted(perm.tolist()) == list(range(seq))
    chunk = seq // (2 * cp)
    for c in range(cp):  # the head group's pieces concatenate to chunk c ++ chunk 2cp-1-c
        pair = torch.cat([shard_indices(seq, hp, cp, c, h) for h in range(hp)])
        expected = list(range(c * chunk, (c + 1) * chunk)) + \
            list(range((2 * cp - 1 - c) * chunk, (2 * cp - c) * chunk))
        assert pair.tolist() == expected


def test_sequence_length_rule():
    with pytest.raises(ValueError, match="divisible by 2\\*cp\\*hp = 2\\*2\\*2 = 8"):
        shard_indices(12, 2, 2, 0, 0)


def _qkv(heads=8, kv=2, seq=8, dim=16, dtype=torch.float32):
    return (torch.randn(1, seq, heads, dim, dtype=dtype), torch.randn(1, seq, kv, dim, dtype=dtype),
            torch.randn(1, seq, kv, dim, dtype=dtype))


def _mesh(hp, cp):
    return loongtrain.Mesh(layout=Layout(world_size=hp * cp, hp=hp, cp=cp), rank=0)


@pytest.mark.parametrize("mesh, inputs, message", [
    (_mesh(3, 1), _qkv(heads=8), "num_heads=8 must be divisible by hp=3"),
    (_mesh(4, 1), _qkv(heads=8, kv=6), "num_heads=8 must be a multiple of num_kv_heads=6"),
    (_mesh(4, 1), _qkv(heads=12, kv=6), "num_kv_heads=6 >= hp=4 must be divisible by hp"),
    (_mesh(1, 2), _qkv(seq=7), "sequence length 14 must be divisible by 2\\*cp\\*hp"),
    (_mesh(1, 1), (torch.randn(1, 8, 8, 16), torch.randn(1, 8, 2, 16), torch.randn(1, 8, 4, 8)),
     "k and v must match in batch, seq and heads \\(only the head dim may differ"),
    (_mesh(1, 1), (torch.randn(1, 8, 8, 16), torch.randn(1, 4, 2, 16), torch.randn(1, 4, 2, 16)),
     "must match q"),
    (_mesh(1, 1), (torch.randn(1, 8, 8, 16), torch.randn(1, 8, 2, 16).double(),
                   torch.randn(1, 8, 2, 16).double()), "dtypes differ"),
    (_mesh(1, 1), (torch.randn(8, 8, 16),) * 3, "4-D tensor"),
])
def test_attention_validation(mesh, inputs, message):
    with pytest.raises(ValueError, match=message):
        loongtrain.attention(*inputs, mesh)


def test_init_mesh_without_distributed_is_single_process():
    mesh = loongtrain.init_mesh(1, 1)
    assert (mesh.hp, mesh.cp, mesh.dp, mesh.inner_ring, mesh.placement) == (1, 1, 1, 1, "head_first")
    with pytest.raises(ValueError, match="world_size=1 is not divisible"):
        loongtrain.init_mesh(2, 1)
