"""Local kernels: the CPU flash op and the reference agree, forward and backward, MHA and GQA."""

from __future__ import annotations

import pytest
import torch

from loongtrain.attn.kernels import CPU_FLASH, REFERENCE, select_kernel


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (4, 2), (4, 1)])
def test_cpu_flash_matches_reference(causal, num_heads, num_kv_heads):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, num_heads, 24, 16, generator=g, dtype=torch.float64)
    k = torch.randn(2, num_kv_heads, 24, 16, generator=g, dtype=torch.float64)
    v = torch.randn(2, num_kv_heads, 24, 16, generator=g, dtype=torch.float64)
    dout = torch.randn(2, num_heads, 24, 16, generator=g, dtype=torch.float64)
    out_r, lse_r = REFERENCE.forward(q, k, v, causal, 0.25)
    out_c, lse_c = CPU_FLASH.forward(q, k, v, causal, 0.25)
    torch.testing.assert_close(out_c, out_r, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse_c, lse_r, rtol=0, atol=1e-12)
    grads_r = REFERENCE.backward(dout, q, k, v, out_r, lse_r, causal, 0.25)
    grads_c = CPU_FLASH.backward(dout, q, k, v, out_c, lse_c, causal, 0.25)
    # the reference backward itself against autograd through the reference forward
    qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
    auto = torch.autograd.grad(REFERENCE.forward(qa, ka, va, causal, 0.25)[0], (qa, ka, va), dout)
    for got_c, got_r, want in zip(grads_c, grads_r, auto):
        torch.testing.assert_close(got_r, want, rtol=0, atol=1e-12)
        torch.testing.assert_close(got_c, want, rtol=0, atol=1e-12)


def test_kernel_selection():
    assert select_kernel(torch.device("cpu"), torch.bfloat16, 128) is CPU_FLASH
    assert select_kernel(torch.device("cuda"), torch.bfloat16, 128).name == "cuda_flash"
    assert select_kernel(torch.device("cuda"), torch.float32, 128) is REFERENCE
    assert select_kernel(torch.device("cuda"), torch.bfloat16, 512) is REFERENCE
