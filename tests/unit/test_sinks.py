"""Attention sinks (docs/attention.md#attention-sinks) in one process: the ring executor with the sinks folded in
after the last merge is exact for every (cp, inner_ring) up to 8 (out, dq, dk, dv and the sinks' gradient
summed over the members), the op's schema, fake and autograd registration hold with sinks, and bad sinks raise
one ValueError line."""

from __future__ import annotations

import pytest
import torch

import loongtrain
from loongtrain.attn import ops
from loongtrain.attn.masking import AttnMask
from loongtrain.attn.ring import RingCall, local_ring_backward, local_ring_forward
from loongtrain.attn.sinks import sinks_grad
from loongtrain.parallel.mesh import single_process_mesh
from loongtrain.parallel.zigzag import shard_indices
from tests.helpers.sinks import sinks_reference

RINGS = [(cp, w) for cp in range(1, 9) for w in range(1, cp + 1) if cp % w == 0]


def _inputs(seq: int, heads: int, kv_heads: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, seq, heads, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, seq, kv_heads, 8, generator=g, dtype=torch.float64) for _ in range(2))
    return q, k, v, torch.randn(2, seq, heads, 8, generator=g, dtype=torch.float64), \
        torch.randn(heads, generator=g, dtype=torch.float64) * 2


@pytest.mark.parametrize("cp, inner_ring", RINGS)
@pytest.mark.parametrize("causal", [True, False])
def test_local_ring_with_sinks_equals_eager(cp, inner_ring, causal):
    seq = 4 * cp
    q, k, v, dout, sinks = _inputs(seq, 4, 2, seed=cp)
    visible = torch.ones(2, seq, seq, dtype=torch.bool)
    if causal:
        visible = visible.tril()
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    out = sinks_reference(*leaves, visible)
    want = (out.detach(), *torch.autograd.grad(out, leaves, dout))

    idx = [shard_indices(seq, 1, cp, c, 0) for c in range(cp)]
    qs, ks, vs, douts = ([t.transpose(1, 2)[:, :, i] for i in idx] for t in (q, k, v, dout))
    qs, ks, vs, douts = list(qs), list(ks), list(vs), list(douts)
    scale = 8 ** -0.5
    call = RingCall(AttnMask(causal), scale)
    results = local_ring_forward(qs, ks, vs, inner_ring, call, sinks=sinks)
    outs, lses = [o for o, _ in results], [m for _, m in results]
    grads = local_ring_backward(douts, qs, ks, vs, outs, lses, inner_ring, call)
    dsinks = sum(sinks_grad(d, o, m, sinks) for d, o, m in zip(douts, outs, lses))
    for name, got, full in zip(("out", "dq", "dk", "dv"), (outs, *zip(*grads)), want):
        for c, g in enumerate(got):
            err = (g - full.transpose(1, 2)[:, :, idx[c]]).abs().max().item()
            assert err < 1e-10, (name, cp, inner_ring, causal, c, err)
    assert (dsinks - want[4]).abs().max().item() < 1e-10
    assert want[4].abs().max() > 1e-3


def test_ring_op_with_sinks_registration():
    q, k, v, _, sinks = _inputs(16, 4, 2)
    q, k, v, sinks = (t.requires_grad_() for t in (q, k, v, sinks))
    key = ops.ring_key(single_process_mesh())
    args = (q, k, v, key, True, 0.3, None, 5, None, sinks)
    torch.library.opcheck(ops.ring_attention, args, test_utils=("test_schema", "test_faketensor",
                                                                "test_autograd_registration"))


def test_sinks_change_the_result_and_none_is_plain_attention():
    q, k, v, _, sinks = _inputs(16, 4, 2)
    plain = loongtrain.attention(q, k, v, None)
    assert torch.equal(plain, loongtrain.attention(q, k, v, None, sinks=None))
    with_sinks = loongtrain.attention(q, k, v, None, sinks=sinks)
    assert (with_sinks - plain).abs().max() > 1e-2
    # a sink of -inf takes no share of the denominator
    assert torch.allclose(loongtrain.attention(q, k, v, None, sinks=torch.full_like(sinks, float("-inf"))), plain,
                          atol=1e-12, rtol=0)


@pytest.mark.parametrize("bad, message", [
    (torch.zeros(3, dtype=torch.float64), r"sinks must be a floating tensor \[num_heads=4\]"),
    (torch.zeros(4, dtype=torch.int64), r"sinks must be a floating tensor"),
    (torch.zeros(1, 4, dtype=torch.float64), r"sinks must be a floating tensor"),
    ([0.0] * 4, r"sinks must be a tensor"),
])
def test_bad_sinks_raise_one_line(bad, message):
    q, k, v, _, _ = _inputs(16, 4, 2)
    with pytest.raises(ValueError, match=message) as info:
        loongtrain.attention(q, k, v, None, sinks=bad)
    assert "\n" not in str(info.value)
