"""The in-process ring's results for a kernel and a mask (fp64), shared by the kernel tests."""

from __future__ import annotations

import torch

from loongtrain.attn.masking import AttnMask
from loongtrain.attn.ring import RingCall, local_ring_backward, local_ring_forward


def ring_results(kernel, mask: AttnMask, cp: int = 2, v_head_dim: int = 16) -> list[torch.Tensor]:
    """The in-process ring's out, lse, dq, dk, dv (fp64, 2 batch rows of 24 tokens, 4/2 heads of dim 16, V's and
    dO's of ``v_head_dim``: MLA's where it is not 16) on zigzag shards, concatenated in shard order (compare two
    kernels on the same mask and ``cp``)."""
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(2, h, 24, d, generator=g, dtype=torch.float64)
                     for h, d in ((4, 16), (2, 16), (2, v_head_dim), (4, v_head_dim)))
    order = torch.arange(24).view(2 * cp, -1)
    idx = [torch.cat([order[c], order[2 * cp - 1 - c]]) for c in range(cp)]  # zigzag
    qs, ks, vs, ds = ([t[:, :, i] for i in idx] for t in (q, k, v, dout))
    call = RingCall(mask, 0.25, kernel)
    res = local_ring_forward(qs, ks, vs, 1, call)
    grads = local_ring_backward(ds, qs, ks, vs, [o for o, _ in res], [m for _, m in res], 1, call)
    return [torch.cat(list(parts), dim=2) for parts in (*zip(*res), *zip(*grads))]
