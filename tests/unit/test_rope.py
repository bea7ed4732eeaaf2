"""RoPE as one chunked autograd function (loongtrain/model/rope.py, docs/memory.md#rope): the plain ops' bits,
forward and gradient, in one chunk and in many, and only ``cos``/``sin`` kept for the backward."""

from __future__ import annotations

import pytest
import torch

from loongtrain.model.rope import apply_rope, rope_cos_sin


def plain(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.to(cos.dtype)
    x1, x2 = xf.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_elems", [1 << 24, 3 * 16, 1])  # one chunk; 3 tokens of 2 heads x 8; one token
def test_same_bits_as_the_plain_ops(dtype, chunk_elems):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 11, 2, 8, generator=gen).to(dtype).requires_grad_()
    g = torch.randn(2, 11, 2, 8, generator=gen).to(dtype)
    cos, sin = rope_cos_sin(torch.randint(0, 5000, (2, 11), generator=gen), 8, 10000.0, dtype)
    ours, ref = apply_rope(x, cos, sin, chunk_elems), plain(x, cos, sin)
    assert torch.equal(ours, ref)
    (got,), (want,) = torch.autograd.grad(ours, x, g), torch.autograd.grad(ref, x, g)
    assert torch.equal(got, want), (got - want).abs().max()
    with torch.no_grad():
        assert torch.equal(apply_rope(x, cos, sin, chunk_elems), ref)


def test_keeps_only_cos_and_sin():
    x = torch.randn(1, 6, 2, 8, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = rope_cos_sin(torch.arange(6)[None], 8, 10000.0, torch.bfloat16)
    saved: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        apply_rope(x, cos, sin, chunk_elems=16)
    assert sorted(saved) == [cos.numel(), sin.numel()]


def test_gradcheck_fp64_chunked():
    x = torch.randn(1, 5, 2, 4, dtype=torch.float64, requires_grad=True)
    cos, sin = rope_cos_sin(torch.arange(5)[None], 4, 10000.0, torch.float64)
    assert torch.autograd.gradcheck(lambda x: apply_rope(x, cos, sin, chunk_elems=8), (x,))
