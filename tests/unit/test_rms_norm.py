"""The one-function RMSNorm (loongtrain/model/rms_norm.py, docs/memory.md): the same forward bit for bit as
the plain ops, the same gradients, and only the input and the per-token scale kept for the backward; Hugging
Face's Llama-family norms routed through it (loongtrain/hf/norms.py)."""

from __future__ import annotations

import pytest
import torch

from loongtrain.hf.norms import use_rms_norm_function
from loongtrain.model.rms_norm import rms_norm

DTYPES = [(torch.float64, torch.float64), (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
          (torch.bfloat16, torch.float32)]


def plain(x: torch.Tensor, weight: torch.Tensor, eps: float, stats: torch.dtype | None = None) -> torch.Tensor:
    xf = x.to(stats or (torch.float32 if x.dtype == torch.bfloat16 else x.dtype))
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def _inputs(dtype, weight_dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 9, 24, generator=gen).to(dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(24, generator=gen)).to(weight_dtype).requires_grad_()
    g = torch.randn(2, 9, 24, generator=gen).to(torch.promote_types(dtype, weight_dtype))
    return x, w, g


@pytest.mark.parametrize(("dtype", "weight_dtype"), DTYPES)
def test_forward_is_bit_identical_and_gradients_match(dtype, weight_dtype):
    x, w, g = _inputs(dtype, weight_dtype)
    ours, ref = rms_norm(x, w, 1e-5), plain(x, w, 1e-5)
    assert torch.equal(ours, ref)
    got, want = torch.autograd.grad(ours, (x, w), g), torch.autograd.grad(ref, (x, w), g)
    tol = {torch.float64: 1e-12, torch.float32: 1e-5}.get(dtype, 0.0)  # bf16: the same roundings, bit for bit
    for a, b in zip(got, want, strict=True):
        assert (a.double() - b.double()).abs().max() <= tol, (dtype, weight_dtype)


def test_gradcheck_fp64():
    x, w, _ = _inputs(torch.float64, torch.float64)
    assert torch.autograd.gradcheck(lambda x, w: rms_norm(x, w, 1e-6), (x, w))


def _saved_bytes(fn, x, w) -> int:
    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x, w, 1e-5)
    return sum(storages.values())


def test_keeps_only_the_input_and_the_scale():
    x, w, _ = _inputs(torch.bfloat16, torch.bfloat16)
    tokens, dim = 2 * 9, 24
    ours, ref = _saved_bytes(rms_norm, x, w), _saved_bytes(plain, x, w)
    assert ours == tokens * dim * 2 + dim * 2 + tokens * 4  # x, weight, fp32 rstd
    assert ref >= ours + tokens * dim * 4  # the plain ops keep the fp32 upcast (and more): the count can fail


def test_hf_llama_norms_use_it(tmp_path):
    import transformers  # the hf extra: installed by the test command
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=24, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    norm = model.model.norm
    x, _, g = _inputs(torch.bfloat16, torch.bfloat16, seed=1)
    want = norm(x)
    want_grads = torch.autograd.grad(want, (x, norm.weight), g)
    assert use_rms_norm_function(model) == 3  # two per layer and the final one
    got = norm(x)
    assert torch.equal(got, want) and all(torch.equal(a, b) for a, b in
                                          zip(torch.autograd.grad(got, (x, norm.weight), g), want_grads, strict=True))
    assert _saved_bytes(lambda x, w, eps: norm(x), x, norm.weight) == 2 * 9 * 24 * 2 + 24 * 2 + 2 * 9 * 4
    assert use_rms_norm_function(model) == 0  # already routed: left as it is


@pytest.mark.parametrize(("dtype", "weight_dtype"), DTYPES)
def test_chunks_give_the_same_forward_and_input_gradient(dtype, weight_dtype):
    """Chunks of rows (5 tokens of 24 here: 4 chunks of the 18 tokens, the last one short) give the same bits
    for the output and the input's gradient; the weight's gradient, summed over the chunks in float32, is
    within one rounding of the one-chunk sum (float64: 1e-12)."""
    x, w, g = _inputs(dtype, weight_dtype)
    one = rms_norm(x, w, 1e-5)
    chunked = rms_norm(x, w, 1e-5, chunk_elems=5 * 24)
    assert torch.equal(one, chunked)
    (gx1, gw1), (gx2, gw2) = torch.autograd.grad(one, (x, w), g), torch.autograd.grad(chunked, (x, w), g)
    assert torch.equal(gx1, gx2)
    tol = 1e-12 if weight_dtype == torch.float64 else 1e-5 if dtype == torch.float32 else 2 ** -6
    assert (gw1.double() - gw2.double()).abs().max() <= tol * gw1.double().abs().max()
    with torch.no_grad():
        assert torch.equal(rms_norm(x, w, 1e-5, chunk_elems=24), one)  # one row per chunk, no autograd


def test_chunked_gradcheck_fp64():
    x, w, _ = _inputs(torch.float64, torch.float64)
    assert torch.autograd.gradcheck(lambda x, w: rms_norm(x, w, 1e-6, chunk_elems=48), (x, w))
