"""The attention backward op's own workspace (loongtrain/attn/ring.backward_workspace_bytes), which the
planner and the full-size simulation use because torch's MemTracker sees a custom op's results, not what
its implementation allocates: measured here against the ring code itself, under fake tensors at a
Llama-3-8B-like head layout (32 query heads, 8 KV heads, head dim 128)."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

from loongtrain.attn.kernels import CPU_FLASH, for_head_dims
from loongtrain.attn.masking import AttnMask, Piece
from loongtrain.attn.ring import RingCall, backward_workspace_bytes, local_ring_backward, whole_backward

H, HKV, D = 32, 8, 128


def _peak(fn) -> int:
    tracker = MemTracker()
    with tracker:
        fn()
    return max(max(parts.values()) for parts in tracker.get_tracker_snapshot("peak").values())


def _tensors(n: int, tokens: int, heads: int, dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.empty(1, tokens, heads, D, dtype=dtype).transpose(1, 2) for _ in range(n)]


@pytest.mark.parametrize("cp, tokens", [(4, 8192), (8, 4096)])
def test_ring_backward_workspace_is_described(cp, tokens):
    """``cp`` members in one process step in lockstep, so the peak over all of them is ``cp`` times one
    member's: its results (dQ, dK, dV) plus its workspace."""
    with FakeTensorMode():
        qs, outs, douts = (_tensors(cp, tokens, H, torch.bfloat16) for _ in range(3))
        ks, vs = (_tensors(cp, tokens, HKV, torch.bfloat16) for _ in range(2))
        lses = [torch.empty(1, H, tokens) for _ in range(cp)]
        peak = _peak(lambda: local_ring_backward(douts, qs, ks, vs, outs, lses, 1, RingCall(AttnMask(True), 0.1)))
    results = tokens * (H + 2 * HKV) * D * 2
    described = backward_workspace_bytes(tokens, H, HKV, D, 2, cp) + results
    assert abs(peak / cp / described - 1) <= 0.10, (peak / cp, described)


def test_whole_backward_workspace_is_described():
    """One kernel call (cp = 1): the kernel's results and their copies in the op's layout (float32, where the
    CPU kernel takes GQA natively and keeps no scratch of its own under fake tensors)."""
    tokens = 8192
    with FakeTensorMode():
        (q, out, dout), (k, v) = _tensors(3, tokens, H, torch.float32), _tensors(2, tokens, HKV, torch.float32)
        lse = torch.empty(1, H, tokens)
        causal = Piece(0, tokens, 0, tokens, "causal")
        peak = _peak(lambda: whole_backward(CPU_FLASH, causal, dout, q, k, v, out, lse, 0.1))
    results = tokens * (H + 2 * HKV) * D * 4
    assert peak == backward_workspace_bytes(tokens, H, HKV, D, 4, 1) + results


@pytest.mark.parametrize("cp", [1, 4])
def test_mla_workspace_is_described(cp):
    """MLA's heads (16 query and key heads of 192, values of 128): one call (cp = 1) on V, dO and O padded to 192,
    exactly; the ring (cp = 4) within the bound the equal head dims keep at this head layout (the description
    counts every dK/dV block at once: 25% over here)."""
    heads, qk, v_dim, tokens = 16, 192, 128, 4096
    with FakeTensorMode():
        def make(n, d, dtype=torch.bfloat16):
            return [torch.empty(1, tokens, heads, d, dtype=dtype).transpose(1, 2) for _ in range(n)]

        qs, ks, (vs, outs, douts) = make(cp, qk), make(cp, qk), (make(cp, v_dim) for _ in range(3))
        lses = [torch.empty(1, heads, tokens) for _ in range(cp)]
        if cp == 1:
            kernel, causal = for_head_dims(CPU_FLASH, qk, v_dim), Piece(0, tokens, 0, tokens, "causal")
            peak = _peak(lambda: whole_backward(kernel, causal, douts[0], qs[0], ks[0], vs[0], outs[0], lses[0], 0.1))
        else:
            call = RingCall(AttnMask(True), 0.1)
            peak = _peak(lambda: local_ring_backward(douts, qs, ks, vs, outs, lses, 1, call)) / cp
    results = tokens * heads * (2 * qk + v_dim) * 2
    described = backward_workspace_bytes(tokens, heads, heads, qk, 2, cp, v_head_dim=v_dim) + results
    if cp == 1:
        assert peak == described
    else:
        assert 0.75 <= peak / described <= 1.0, (peak, described)
