"""Local kernels: the CPU flash op and the reference agree, forward and backward, MHA and GQA."""

from __future__ import annotations

import pytest
import torch

from loongtrain.attn.kernel_choice import select_kernel
from loongtrain.attn.kernels import CPU_FLASH, REFERENCE, expand_kv, for_head_dims


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


@pytest.mark.parametrize("num_kv_heads", [4, 1])
def test_cpu_flash_with_another_v_head_dim_is_padded_and_exact(num_kv_heads):
    """MLA's V head dim (16) below Q/K's (24): the CPU op refuses two head dims, ``for_head_dims`` runs it on V
    zero-padded to 24 and cuts the padding off out and dV, equal to autograd through the reference."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 24, 24, generator=g, dtype=torch.float64)
    k = torch.randn(2, num_kv_heads, 24, 24, generator=g, dtype=torch.float64)
    v = torch.randn(2, num_kv_heads, 24, 16, generator=g, dtype=torch.float64)
    dout = torch.randn(2, 4, 24, 16, generator=g, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="same head size"):
        CPU_FLASH.forward(q, k, v, True, 0.25)
    assert for_head_dims(REFERENCE, 24, 16) is REFERENCE and for_head_dims(CPU_FLASH, 16, 16) is CPU_FLASH
    kernel = for_head_dims(CPU_FLASH, 24, 16)
    assert kernel is for_head_dims(CPU_FLASH, 24, 16) and kernel.name == "cpu_flash_v_padded"
    out, lse = kernel.forward(q, k, v, True, 0.25)
    grads = kernel.backward(dout, q, k, v, out, lse, True, 0.25)
    qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
    want_out, want_lse = REFERENCE.forward(qa, ka, va, True, 0.25)
    want = torch.autograd.grad(want_out, (qa, ka, va), dout)
    for got, ref in zip((out, lse, *grads), (want_out, want_lse, *want), strict=True):
        assert got.shape == ref.shape
        torch.testing.assert_close(got, ref.detach(), rtol=0, atol=1e-12)


def test_kernel_selection_on_cpu():
    """CPU: the fused CPU op for every float dtype (CUDA selection: tests/unit/test_cuda_path.py)."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        assert select_kernel(torch.device("cpu"), dtype, 100) is CPU_FLASH


def test_kv_expansion_only_copies_when_it_must():
    k = torch.randn(2, 1, 8, 4)  # one KV head
    assert expand_kv(k, 4).data_ptr() == k.data_ptr() and expand_kv(k, 4).stride(1) == 0
    k2 = torch.randn(2, 2, 8, 4)
    expanded = expand_kv(k2, 4)
    torch.testing.assert_close(expanded, k2.repeat_interleave(2, dim=1), rtol=0, atol=0)
    assert expand_kv(k2, 2) is k2


def test_cpu_flash_on_strided_ring_slices():
    """The ring's back-half step on strided views (transposed [B, S, H, D], S-slices, a sliced lse
    accumulator): no copies are needed for exact results."""
    g = torch.Generator().manual_seed(1)

    def make(heads):
        return torch.randn(2, 48, heads, 16, generator=g, dtype=torch.float64).transpose(1, 2)

    q, k, v, dout = make(4), make(2), make(2), make(4)
    out, lse = REFERENCE.forward(q, k, v, False, 0.3)
    back = slice(24, None)
    args = (dout[:, :, back], q[:, :, back], k, v, out[:, :, back], lse.contiguous()[:, :, back], False, 0.3)
    assert not any(t.is_contiguous() for t in args[:6] if t is not k and t is not v)
    for got, want in zip(CPU_FLASH.backward(*args), REFERENCE.backward(*args)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_only_cuda_flash_and_cudnn_have_a_varlen_form():
    """The packed variable-length ops are FA2's and cuDNN's ragged one (docs/attention.md#kernels), the latter with
    top-left causal masks: every other kernel, the head-dim padded flash kernel included, runs one dense call
    per piece."""
    from loongtrain.attn import cuda_kernels, kernels

    every = (kernels.REFERENCE, kernels.CPU_FLASH, cuda_kernels.CUDA_FLASH, cuda_kernels.CUDA_EFFICIENT,
             cuda_kernels.CUDA_CUDNN, cuda_kernels.CUDA_FLASH_PADDED, cuda_kernels.CUDA_EFFICIENT_PADDED)
    assert [k.name for k in every if k.varlen_forward is not None] == ["cuda_flash", "cuda_cudnn"]
    assert [k.name for k in every if k.varlen_backward is not None] == ["cuda_flash", "cuda_cudnn"]
    assert [k.name for k in every if not k.varlen_bottom_right] == ["cuda_cudnn"]



def test_a_ring_of_one_calls_the_kernel_once_without_accumulators(monkeypatch):
    """cp = 1, one document: forward and backward are the kernel's own results, no ring step (whose fp32 out,
    dQ and dK/dV accumulators are q- and kv-sized), bit for bit what the accumulating step computes
    (docs/memory.md)."""
    import loongtrain.attn.ring as ring
    from loongtrain import attention

    steps: list[str] = []
    for name in ("ForwardStep", "BackwardStep"):
        cls = getattr(ring, name)
        monkeypatch.setattr(ring, name, lambda *a, _cls=cls, _n=name, **kw: steps.append(_n) or _cls(*a, **kw))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 64, 4, 16, generator=gen).to(torch.bfloat16).requires_grad_() for _ in range(3))
    dout = torch.randn(2, 64, 4, 16, generator=gen).to(torch.bfloat16)

    def run():
        out = attention(q, k, v, None, causal=True)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    fast = run()
    assert steps == []
    monkeypatch.setattr(ring, "_whole", lambda *args: None)  # the general ring step
    general = run()
    assert steps == ["ForwardStep", "BackwardStep"]  # the count can fail
    for a, b in zip(fast, general, strict=True):
        assert torch.equal(a, b)
