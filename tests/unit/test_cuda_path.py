"""The CUDA kernel wrappers without a GPU (docs/testing.md): exactness through a CPU emulation of the
CUDA ops (tests/helpers/cuda_emulation.py), planted faults the checks must catch, shapes/dtypes/strides of the
real ops on fake CUDA tensors, and kernel selection over device capabilities."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from loongtrain.attn.cuda_kernels import (
    CUDA_CUDNN,
    CUDA_EFFICIENT,
    CUDA_EFFICIENT_PADDED,
    CUDA_FLASH,
    CUDA_FLASH_PADDED,
)
from loongtrain.attn.kernel_choice import bf16_supported, kernel_candidates, select_kernel
from loongtrain.attn.kernels import REFERENCE, Kernel, for_head_dims
from loongtrain.attn.masking import AttnMask
from loongtrain.attn.ring import RingCall, local_ring_backward, local_ring_forward
from loongtrain.parallel.zigzag import shard_indices
from tests.helpers.cuda_emulation import FAULTS, VARLEN_FAULTS

CUDA_KERNELS = [CUDA_FLASH, CUDA_EFFICIENT, CUDA_CUDNN]
SCALE = 0.3


def _inputs(num_heads, num_kv_heads, seq_q, seq_k, head_dim, dtype, layout="bshd", seed=0):
    """q, k, v, dout ``[B, H, S, D]``: transposed views of ``[B, S, H, D]`` (as the model passes them)
    or contiguous."""
    g = torch.Generator().manual_seed(seed)

    def make(heads, seq):
        x = torch.randn(2, seq, heads, head_dim, generator=g, dtype=torch.float64).to(dtype)
        return x.transpose(1, 2) if layout == "bshd" else x.transpose(1, 2).contiguous()

    return make(num_heads, seq_q), make(num_kv_heads, seq_k), make(num_kv_heads, seq_k), make(num_heads, seq_q)


def assert_exact(kernel: Kernel, q, k, v, dout, causal: bool, tol: float) -> None:
    """Forward (out, lse) and backward (dq, dk, dv) of ``kernel`` equal fp64 autograd through the
    reference within ``tol``; raises AssertionError otherwise."""
    out, lse = kernel.forward(q, k, v, causal, SCALE)
    grads = kernel.backward(dout, q, k, v, out, lse, causal, SCALE)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out64, lse64 = REFERENCE.forward(q64, k64, v64, causal, SCALE)
    want = torch.autograd.grad(out64, (q64, k64, v64), dout.double())
    for name, got, ref in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads), (out64, lse64, *want)):
        assert got.shape == ref.shape, (name, got.shape, ref.shape)
        torch.testing.assert_close(got.double(), ref.detach(), rtol=0, atol=tol, msg=lambda m, n=name: f"{n}: {m}")


# ---------------------------------------------------------------- exactness through the emulation


@pytest.mark.parametrize("kernel", CUDA_KERNELS, ids=lambda k: k.name)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_cuda_wrappers_exact(emulate, kernel, causal, num_heads, num_kv_heads, layout):
    ops = emulate(allow_fp64=True)
    q, k, v, dout = _inputs(num_heads, num_kv_heads, 40, 40, 16, torch.float64, layout)
    assert_exact(kernel, q, k, v, dout, causal, 1e-10)
    assert len(ops.calls) == 2, ops.calls  # one forward and one backward op, nothing else


@pytest.mark.parametrize("kernel", CUDA_KERNELS, ids=lambda k: k.name)
def test_cuda_wrappers_exact_on_ring_slices(emulate, kernel):
    """The ring's non-causal steps: the back half of the queries, or the front half of the keys."""
    emulate(allow_fp64=True)
    q, k, v, dout = _inputs(4, 2, 48, 48, 16, torch.float64)
    half = 24
    assert_exact(kernel, q[:, :, half:], k, v, dout[:, :, half:], False, 1e-10)
    assert_exact(kernel, q, k[:, :, :half], v[:, :, :half], dout, False, 1e-10)


@pytest.mark.parametrize("kernel", [CUDA_FLASH, CUDA_CUDNN], ids=lambda k: k.name)
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (4, 2), (4, 1)])
def test_backward_one_head_at_a_time(emulate, monkeypatch, num_heads, num_kv_heads, kernel):
    """Past SPLIT_BACKWARD_BYTES (here 0) FA2's and cuDNN's backwards run per query head: exact in fp64, one op
    call per head; in bf16 dQ the same bits as one call, dK/dV within one rounding (the group sum in fp32)."""
    from loongtrain.attn import cuda_kernels

    ops = emulate(allow_fp64=True)
    q, k, v, dout = _inputs(num_heads, num_kv_heads, 40, 40, 16, torch.float64)
    monkeypatch.setattr(cuda_kernels, "SPLIT_BACKWARD_BYTES", 0)
    ops.calls.clear()
    assert_exact(kernel, q, k, v, dout, True, 1e-10)
    assert len(ops.calls) == 1 + num_heads, ops.calls  # the forward, then one backward call per query head
    emulate(allow_fp64=False)
    qb, kb, vb, db = (t.to(torch.bfloat16) for t in (q, k, v, dout))
    out, lse = kernel.forward(qb, kb, vb, True, SCALE)
    split = kernel.backward(db, qb, kb, vb, out, lse, True, SCALE)
    monkeypatch.setattr(cuda_kernels, "SPLIT_BACKWARD_BYTES", 1 << 40)
    whole = kernel.backward(db, qb, kb, vb, out, lse, True, SCALE)
    assert torch.equal(split[0], whole[0])
    for a, b in zip(split[1:], whole[1:], strict=True):
        assert a.shape == b.shape and a.stride() == b.stride()
        assert (a.double() - b.double()).abs().max() <= 2 ** -7 * b.double().abs().max()


@pytest.mark.parametrize("kernel", [CUDA_FLASH_PADDED, CUDA_EFFICIENT_PADDED], ids=lambda k: k.name)
def test_head_dim_padding_exact(emulate, kernel):
    ops = emulate(allow_fp64=True)
    q, k, v, dout = _inputs(4, 2, 40, 40, 12, torch.float64)
    assert_exact(kernel, q, k, v, dout, True, 1e-10)
    with pytest.raises(AssertionError, match="head dim"):  # the unpadded flash op refuses head dim 12
        CUDA_FLASH.forward(q, k, v, True, SCALE)
    assert ops.calls[-1].startswith("_scaled_dot_product_flash_attention")


# (kernel, Q/K head dim, V head dim): a head dim that is no multiple of 8 goes to the *_padded kernels only (the rules)
MLA_CASES = [(kernel, qk, v) for kernel in (*CUDA_KERNELS, CUDA_FLASH_PADDED, CUDA_EFFICIENT_PADDED)
             for qk, v in ((24, 16), (16, 24), (20, 12)) if qk % 8 == 0 or kernel.name.endswith("_padded")]


@pytest.mark.parametrize("kernel, qk_dim, v_dim", MLA_CASES, ids=lambda x: getattr(x, "name", str(x)))
def test_another_v_head_dim_runs_padded_and_exact(emulate, kernel, qk_dim, v_dim):
    """MLA: V's head dim differs from Q/K's. The ops need one head dim (the emulated ones, as torch's, refuse
    two); ``for_head_dims`` runs them on the narrower zero-padded to the wider, exactly (docs/attention.md#mla)."""
    ops = emulate(allow_fp64=True)
    q, k, _, _ = _inputs(4, 2, 40, 40, qk_dim, torch.float64)
    _, _, v, dout = _inputs(4, 2, 40, 40, v_dim, torch.float64, seed=1)
    if not kernel.unequal_head_dims:  # the op alone refuses two head dims
        with pytest.raises(AssertionError, match="differ|head dim"):
            kernel.forward(q, k, v, True, SCALE)
    assert_exact(for_head_dims(kernel, qk_dim, v_dim), q, k, v, dout, True, 1e-10)
    assert ops.calls, "the emulated ops ran"


@pytest.mark.parametrize("kernel, dtype, tol", [
    (CUDA_FLASH, torch.bfloat16, 3e-2), (CUDA_FLASH, torch.float16, 5e-3),
    (CUDA_EFFICIENT, torch.bfloat16, 3e-2), (CUDA_EFFICIENT, torch.float32, 1e-5),
    (CUDA_CUDNN, torch.bfloat16, 3e-2),
], ids=lambda x: getattr(x, "name", str(x)))
def test_cuda_wrappers_in_device_dtypes(emulate, kernel, dtype, tol):
    """With the real ops' dtype rules (no fp64): outputs in the input dtype, lse fp32, close to fp64."""
    emulate(allow_fp64=False)
    q, k, v, dout = _inputs(4, 2, 40, 40, 16, dtype)
    out, lse = kernel.forward(q, k, v, True, SCALE)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_exact(kernel, q, k, v, dout, True, tol)


# ---------------------------------------------------------------- the checks can fail


@pytest.mark.parametrize("fault", [f for f in FAULTS if f not in VARLEN_FAULTS])  # varlen: tests/unit/test_varlen.py
def test_planted_fault_is_caught(emulate, fault):
    emulate(allow_fp64=True, fault=fault)
    kernel = CUDA_EFFICIENT if fault.startswith("efficient") else CUDA_FLASH
    q, k, v, dout = _inputs(4, 2, 40, 40, 16, torch.float64)
    with pytest.raises(AssertionError, match="not close"):  # caught by the comparison, not a check
        assert_exact(kernel, q, k, v, dout, True, 1e-10)


def test_flash_backward_needs_a_dense_lse(emulate):
    """The FA2 backward reads lse as a dense [B, H, S] buffer: a strided lse (the ring's back-half
    slice) gives wrong gradients unless made contiguous, which the wrapper does."""
    ops = emulate(allow_fp64=True)
    q, k, v, dout = _inputs(4, 2, 48, 48, 16, torch.float64)
    full_out, full_lse = CUDA_FLASH.forward(q, k, v, False, SCALE)
    back = slice(24, None)
    q_b, dout_b, out_b, lse_b = q[:, :, back], dout[:, :, back], full_out[:, :, back], full_lse[:, :, back]
    assert not lse_b.is_contiguous()
    want = REFERENCE.backward(dout_b, q_b, k, v, out_b, lse_b, False, SCALE)
    got = CUDA_FLASH.backward(dout_b, q_b, k, v, out_b, lse_b, False, SCALE)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-10)
    rng, unused = torch.zeros(2, dtype=torch.uint64), torch.zeros((), dtype=torch.uint64)
    raw = ops._scaled_dot_product_flash_attention_backward(
        dout_b, q_b, k, v, out_b, lse_b, None, None, 24, 48, 0.0, False, rng, unused, scale=SCALE)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(raw[0], want[0], rtol=0, atol=1e-10)


def test_emulation_enforces_op_rules(emulate):
    ops = emulate(allow_fp64=False)
    q, k, v, dout = _inputs(4, 2, 40, 40, 16, torch.float64)
    with pytest.raises(AssertionError, match="dtype"):  # no fused CUDA op takes fp64
        CUDA_FLASH.forward(q, k, v, True, SCALE)
    q, k, v, dout = _inputs(4, 2, 40, 40, 16, torch.float32)
    with pytest.raises(AssertionError, match="dtype"):  # flash is fp16/bf16 only
        CUDA_FLASH.forward(q, k, v, True, SCALE)
    with pytest.raises(AssertionError, match="equal head counts"):  # hence the wrapper's K/V expansion
        ops._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True, scale=SCALE)
    with pytest.raises(TypeError, match="positional"):  # calls are bound against the real schema
        ops._scaled_dot_product_efficient_attention(q, q, q, None, True, 0.0, True, SCALE)


# ---------------------------------------------------------------- the real ops on fake CUDA tensors


@pytest.mark.parametrize("kernel", CUDA_KERNELS, ids=lambda k: k.name)
@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
def test_real_ops_on_fake_cuda_tensors(kernel, num_kv_heads):
    """torch's meta/fake registrations of the real ops: shapes, dtypes, strides the ring relies on."""
    with FakeTensorMode():
        def make(heads, seq=64):
            return torch.empty(2, seq, heads, 64, dtype=torch.bfloat16, device="cuda").transpose(1, 2)

        q, k, v, dout = make(8), make(num_kv_heads), make(num_kv_heads), make(8)
        back = (q.narrow(2, 32, 32), k, v, dout.narrow(2, 32, 32), False)  # (indexing fails on fake cuda)
        for qq, kk, vv, dd, causal in ((q, k, v, dout, True), back):
            out, lse = kernel.forward(qq, kk, vv, causal, SCALE)
            assert out.device.type == "cuda" and out.shape == qq.shape and out.dtype == torch.bfloat16
            assert out.stride(-1) == 1
            assert lse.shape == qq.shape[:3] and lse.dtype == torch.float32
            grads = kernel.backward(dd, qq, kk, vv, out, lse, causal, SCALE)
            for g, x in zip(grads, (qq, kk, vv)):
                assert g.shape == x.shape and g.dtype == x.dtype and g.stride(-1) == 1
            if causal:  # dense [B, S, H, D] inputs: out and dq come in the same layout
                assert out.stride() == qq.stride() and grads[0].stride() == qq.stride()
        # the ring's back-half step: out and lse are slices of the member's accumulators
        out_acc, lse_acc = torch.empty(2, 8, 64, 64, device="cuda"), torch.empty(2, 8, 64, device="cuda")
        qq, dd, oo, ll = (x.narrow(2, 32, 32) for x in (q, dout, out_acc.to(torch.bfloat16), lse_acc))
        assert not ll.is_contiguous()
        grads = kernel.backward(dd, qq, k, v, oo, ll, False, SCALE)
        assert [g.shape for g in grads] == [qq.shape, k.shape, v.shape]


# ---------------------------------------------------------------- selection


F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
SELECTION = {  # (sm, dtype, head_dim) -> kernel
    ((7, 0), F16, 64): CUDA_EFFICIENT, ((7, 0), F16, 72): CUDA_EFFICIENT, ((7, 0), F16, 100): CUDA_EFFICIENT_PADDED,
    ((7, 0), F16, 256): CUDA_EFFICIENT, ((7, 0), F16, 320): CUDA_EFFICIENT,
    ((7, 0), BF16, 64): REFERENCE, ((7, 0), BF16, 100): REFERENCE,
    ((7, 0), F32, 64): CUDA_EFFICIENT, ((7, 0), F32, 100): CUDA_EFFICIENT, ((7, 0), F32, 320): CUDA_EFFICIENT,
    ((7, 0), F64, 64): REFERENCE,
    ((8, 0), BF16, 64): CUDA_FLASH, ((8, 0), BF16, 72): CUDA_FLASH, ((8, 0), BF16, 100): CUDA_FLASH_PADDED,
    ((8, 0), BF16, 256): CUDA_FLASH, ((8, 0), BF16, 320): CUDA_EFFICIENT, ((8, 0), F16, 128): CUDA_FLASH,
    ((8, 0), F16, 100): CUDA_FLASH_PADDED, ((8, 0), F16, 330): CUDA_EFFICIENT_PADDED,
    ((8, 0), F32, 64): CUDA_EFFICIENT, ((8, 0), F32, 100): CUDA_EFFICIENT, ((8, 0), F32, 256): CUDA_EFFICIENT,
    ((8, 0), F32, 320): CUDA_EFFICIENT, ((8, 0), F32, 98): CUDA_EFFICIENT_PADDED, ((8, 0), F64, 128): REFERENCE,
    ((8, 6), BF16, 200): CUDA_EFFICIENT, ((8, 6), BF16, 192): CUDA_FLASH, ((8, 0), BF16, 200): CUDA_FLASH,
    ((9, 0), BF16, 64): CUDA_FLASH, ((9, 0), BF16, 72): CUDA_FLASH, ((9, 0), BF16, 100): CUDA_FLASH_PADDED,
    ((9, 0), BF16, 256): CUDA_FLASH, ((9, 0), BF16, 320): CUDA_EFFICIENT, ((9, 0), F16, 128): CUDA_FLASH,
    ((9, 0), F32, 128): CUDA_EFFICIENT, ((9, 0), F64, 128): REFERENCE,
}


@pytest.mark.parametrize("case", list(SELECTION), ids=str)
def test_select_kernel(gpu, case):
    sm, dtype, head_dim = case
    assert select_kernel(gpu(sm), dtype, head_dim) is SELECTION[case]


def test_cudnn_is_a_measured_option_on_hopper(gpu):
    device = gpu((9, 0))
    assert kernel_candidates(device, BF16, 128) == [CUDA_FLASH, CUDA_CUDNN, CUDA_EFFICIENT]
    assert CUDA_CUDNN not in kernel_candidates(device, BF16, 256)  # cuDNN limit used here: head dim 128
    times = {CUDA_FLASH.name: 2.0, CUDA_CUDNN.name: 1.0, CUDA_EFFICIENT.name: 3.0}
    assert select_kernel(device, BF16, 128, measure=lambda k: times[k.name]) is CUDA_CUDNN
    assert CUDA_CUDNN not in kernel_candidates(gpu((8, 0)), BF16, 128)
    assert CUDA_CUDNN not in kernel_candidates(gpu((9, 0), cudnn=None), BF16, 128)


def test_flash_needs_a_build_with_it(gpu, monkeypatch):
    device = gpu((8, 0))
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: False)
    assert select_kernel(device, BF16, 128) is CUDA_EFFICIENT


@pytest.mark.parametrize("sm, want", [((7, 0), False), ((7, 5), False), ((8, 0), True), ((9, 0), True)])
def test_bf16_supported(gpu, sm, want):
    assert bf16_supported(gpu(sm)) is want
    assert bf16_supported(torch.device("cpu"))


def test_cpu_and_other_devices():
    assert select_kernel(torch.device("cpu"), BF16, 100).name == "cpu_flash"
    assert select_kernel(torch.device("meta"), F32, 64) is REFERENCE
    assert not bf16_supported(torch.device("meta"))


# ---------------------------------------------------------------- the ring on the emulated CUDA kernels


def _zigzag(x: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """Member ``rank``'s ``[B, H, S_c, D]`` shard (a transposed view) of a full ``[B, S, H, D]`` tensor."""
    return x[:, shard_indices(x.shape[1], 1, cp, rank, 0)].transpose(1, 2)


@pytest.mark.parametrize("kernel", [CUDA_FLASH, CUDA_EFFICIENT], ids=lambda k: k.name)
@pytest.mark.parametrize("causal", [True, False])
def test_ring_on_emulated_cuda_kernels(emulate, kernel, causal):
    """The in-process ring executor with a CUDA kernel equals unsharded attention, forward and grads."""
    ops = emulate(allow_fp64=True)
    cp, inner_ring, seq = 4, 2, 64
    g = torch.Generator().manual_seed(1)
    q, dout = (torch.randn(2, seq, 4, 16, generator=g, dtype=F64) for _ in range(2))
    k, v = (torch.randn(2, seq, 2, 16, generator=g, dtype=F64) for _ in range(2))
    qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
    out_full, _ = REFERENCE.forward(qa.transpose(1, 2), ka.transpose(1, 2), va.transpose(1, 2), causal, SCALE)
    want = (out_full.transpose(1, 2), *torch.autograd.grad(out_full, (qa, ka, va), dout.transpose(1, 2)))

    qs, ks, vs, douts = ([_zigzag(t, cp, r) for r in range(cp)] for t in (q, k, v, dout))
    call = RingCall(AttnMask(causal), SCALE, kernel)
    fwd = local_ring_forward(qs, ks, vs, inner_ring, call)
    outs, lses = [o for o, _ in fwd], [lse for _, lse in fwd]
    bwd = local_ring_backward(douts, qs, ks, vs, outs, lses, inner_ring, call)
    for r in range(cp):
        got = (outs[r], *bwd[r])
        for g_r, w in zip(got, want):
            torch.testing.assert_close(g_r, _zigzag(w, cp, r), rtol=0, atol=1e-10)
    assert {c.split("attention")[-1] for c in ops.calls} == {"", "_backward"}
