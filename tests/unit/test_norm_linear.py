"""The attention norm fused into q/k/v (loongtrain/parallelize/norm_linear.py, docs/memory.md): the same output
and gradients as norm-then-linear, in one chunk and in many, with bias, under autocast; the norm's output
is not kept; loongtrain's and Hugging Face's blocks fused from outside."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loongtrain.hf.families import decoder_layers
from loongtrain.model.config import ModelConfig
from loongtrain.model.llama import Transformer
from loongtrain.model.rms_norm import rms_norm
from loongtrain.parallelize.norm_linear import NormLinear, fuse_norm_linear


def _inputs(dtype, bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 7, 16, generator=gen).to(dtype).requires_grad_()
    nw = (1 + 0.1 * torch.randn(16, generator=gen)).to(dtype).requires_grad_()
    w = (0.2 * torch.randn(12, 16, generator=gen)).to(dtype).requires_grad_()
    b = (0.1 * torch.randn(12, generator=gen)).to(dtype).requires_grad_() if bias else None
    g = torch.randn(2, 7, 12, generator=gen).to(dtype)
    return x, nw, w, b, g


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("dtype", "chunk_elems", "tol"), [
    (torch.float64, 1 << 24, 1e-12), (torch.float64, 3 * 16, 1e-12), (torch.float32, 3 * 16, 1e-5),
    (torch.bfloat16, 1 << 24, 0.0), (torch.bfloat16, 3 * 16, 2e-2)])
def test_matches_norm_then_linear(dtype, chunk_elems, tol, bias):
    x, nw, w, b, g = _inputs(dtype, bias)
    ref = F.linear(rms_norm(x, nw, 1e-5), w, b)
    ours = NormLinear.apply(x, nw, 1e-5, None, w, b, chunk_elems)
    if chunk_elems >= x.numel():  # one chunk: nn.Linear's own ops, the same bits
        assert torch.equal(ours, ref)
    else:  # a matmul over fewer rows may round differently
        assert (ours.double() - ref.double()).abs().max() <= max(tol, 1e-15) * ref.double().abs().max()
    leaves = (x, nw, w) + ((b,) if bias else ())
    got, want = torch.autograd.grad(ours, leaves, g), torch.autograd.grad(ref, leaves, g)
    for name, a, r in zip("x nw w b".split(), got, want, strict=False):
        scale = r.double().abs().max()
        assert (a.double() - r.double()).abs().max() <= tol * max(1.0, scale), (name, dtype, chunk_elems)


def test_gradcheck_fp64_chunked():
    x, nw, w, b, _ = _inputs(torch.float64, True)
    assert torch.autograd.gradcheck(lambda *a: NormLinear.apply(a[0], a[1], 1e-6, None, a[2], a[3], 32),
                                    (x, nw, w, b))


@pytest.mark.parametrize("chunk_elems", [1 << 24, 3 * 16])
def test_under_autocast_matches(chunk_elems):
    """fp32 weights and residual stream, bf16 matmuls (the trainer's z=1 autocast path), in one chunk and many."""
    x, nw, w, _, g = _inputs(torch.float32, False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.linear(rms_norm(x, nw, 1e-5), w)
        ours = NormLinear.apply(x, nw, 1e-5, None, w, None, chunk_elems)
    assert ours.dtype == ref.dtype == torch.bfloat16 and torch.equal(ours, ref)
    got, want = torch.autograd.grad(ours, (x, nw, w), g.bfloat16()), torch.autograd.grad(ref, (x, nw, w), g.bfloat16())
    for a, r in zip(got, want, strict=True):  # bf16 roundings (per chunk for the weight): 2**-6 of the largest
        assert a.dtype == r.dtype and (a - r).abs().max() <= 2 ** -6 * r.abs().max()


def test_keeps_no_norm_output():
    x, nw, w, _, _ = _inputs(torch.bfloat16, False)
    saved: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        NormLinear.apply(x, nw, 1e-5, None, w, None, 1 << 24)
    assert sorted(saved) == sorted([x.numel(), nw.numel(), 2 * 7, w.numel()])  # x, norm weight, rstd, weight


def test_fused_native_model_equals_plain():
    cfg = ModelConfig(vocab_size=50, dim=16, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=24)
    plain, fused = Transformer(cfg).double(), Transformer(cfg).double()
    assert fuse_norm_linear(fused) == 2 and fuse_norm_linear(fused) == 0  # idempotent
    ids = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(1))
    a, b = plain(ids), fused(ids)
    torch.testing.assert_close(b, a, rtol=0, atol=1e-12)
    a.square().mean().backward()
    b.square().mean().backward()
    for (name, p), q in zip(plain.named_parameters(), fused.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=1e-12, msg=name)


@pytest.mark.parametrize("q_lora_rank", [20, 0])
def test_fused_mla_equals_plain(q_lora_rank):
    """MLA's input projections (the queries' one or its latent's, and the keys' and values' latent) take the norm
    fused: loongtrain's decoder and HF's DeepSeek-V3."""
    import dataclasses

    from tests.helpers.deepseek import native_mla_config, tiny_deepseek

    cfg = dataclasses.replace(native_mla_config(), q_lora_rank=q_lora_rank)
    pairs = [(Transformer(cfg).double(), Transformer(cfg).double())]
    pairs.append(tuple(tiny_deepseek(q_lora_rank=q_lora_rank or None) for _ in range(2)))
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    for plain, fused in pairs:
        assert fuse_norm_linear(fused) == cfg.num_layers
        names = ("attention", "wq_a" if q_lora_rank else "wq") if fused is pairs[0][1] else (
            "self_attn", "q_a_proj" if q_lora_rank else "q_proj")
        assert type(getattr(getattr(decoder_layers(fused)[0], names[0]), names[1])).__name__ != "Linear"
        a, b = (m(ids) for m in (plain, fused))
        a, b = getattr(a, "logits", a), getattr(b, "logits", b)
        torch.testing.assert_close(b, a, rtol=0, atol=1e-12)
        a.square().mean().backward()
        b.square().mean().backward()
        for (name, p), q in zip(plain.named_parameters(), fused.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=1e-12, msg=name)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.float64, 1e-13)])
def test_fused_hf_llama_equals_stock(dtype, tol):
    """float64: HF's norm of a float64 input rounds to float32 statistics; the fused blocks then run its own
    ops once (parallelize/norm_linear._norm_forward), so the gradients agree to float64 rounding, not float32's."""
    import transformers  # the hf extra: installed by the test command
    config = transformers.Qwen2Config(vocab_size=64, hidden_size=24, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)  # q/k/v with bias
    stock = transformers.Qwen2ForCausalLM(config).to(dtype)
    fused = transformers.Qwen2ForCausalLM(config).to(dtype)
    fused.load_state_dict(stock.state_dict())
    assert fuse_norm_linear(fused) == 2
    ids = torch.randint(0, 64, (1, 11), generator=torch.Generator().manual_seed(2))
    a, b = stock(ids).logits, fused(ids).logits
    torch.testing.assert_close(b, a, rtol=tol, atol=tol)
    a.square().mean().backward()
    b.square().mean().backward()
    for (name, p), q in zip(stock.named_parameters(), fused.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=10 * tol, atol=tol / 10, msg=name)
