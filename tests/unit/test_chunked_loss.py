"""``chunked_cross_entropy(hidden, weight, labels)`` equals ``sharded_cross_entropy(hidden @ weight.T, labels)``
(forward and gradients: fp64 exactly, fp32 / bf16-autocast to rounding), sharded over sp ranks and with
FSDP2, and its peak memory is a small fraction of the unchunked loss's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from loongtrain.loss.chunked import (
    IGNORE_INDEX,
    chunked_cross_entropy,
    chunked_loss_peak_bytes,
    default_chunk_tokens,
)
from tests.helpers.chunked_loss_cases import _data, _grads, _reference


@pytest.mark.parametrize("chunk_tokens", [1, 7, 64, 1000])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp64_equals_unchunked_loss_and_grads(chunk_tokens, with_bias):
    hidden, weight, bias, labels = _data(3, 21, 16, 50, torch.float64)
    bias = bias if with_bias else None
    ref = _grads(lambda h, w, b: _reference(h, w, b, labels), hidden, weight, bias)
    got = _grads(lambda h, w, b: chunked_cross_entropy(h, w, labels, None, chunk_tokens=chunk_tokens, bias=b),
                 hidden, weight, bias)
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(got[1], ref[1], rtol=0, atol=1e-12)
    assert not got[1].requires_grad
    for name, g, r in zip(("hidden", "weight", "bias"), got[2], ref[2], strict=True):
        if r is None:
            assert g is None
            continue
        torch.testing.assert_close(g, r, rtol=0, atol=1e-12, msg=name)


def test_fp64_tied_embedding_and_head():
    """The head weight is also the embedding: both gradient paths land on one parameter."""
    vocab, dim, batch, seq = 40, 12, 2, 19
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
    inputs, labels = tokens[:, :-1], tokens[:, 1:].clone()
    labels[1, :4] = IGNORE_INDEX
    base = torch.randn(vocab, dim, dtype=torch.float64, generator=gen)
    mix = torch.randn(dim, dim, dtype=torch.float64, generator=gen) / dim**0.5

    def run(loss_fn):
        embedding = base.clone().requires_grad_(True)
        hidden = torch.tanh(F.embedding(inputs, embedding) @ mix)
        loss, value = loss_fn(hidden, embedding)
        loss.backward()
        return loss.detach(), embedding.grad

    ref = run(lambda h, w: _reference(h, w, None, labels))
    got = run(lambda h, w: chunked_cross_entropy(h, w, labels, None, chunk_tokens=5))
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(got[1], ref[1], rtol=0, atol=1e-12)


def test_all_ignored_gives_zero_loss_and_grads():
    hidden, weight, _, labels = _data(2, 5, 8, 11, torch.float64)
    loss, value, (g_h, g_w) = _grads(
        lambda h, w: chunked_cross_entropy(h, w, torch.full_like(labels, IGNORE_INDEX), None, chunk_tokens=3),
        hidden, weight)
    assert loss.item() == 0.0 and value.item() == 0.0
    assert torch.count_nonzero(g_h) == 0 and torch.count_nonzero(g_w) == 0


def test_fp32_matches_to_rounding():
    hidden, weight, bias, labels = _data(2, 33, 32, 300, torch.float32)
    ref = _grads(lambda h, w, b: _reference(h, w, b, labels), hidden, weight, bias)
    got = _grads(lambda h, w, b: chunked_cross_entropy(h, w, labels, None, chunk_tokens=10, bias=b),
                 hidden, weight, bias)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-6, atol=1e-6)
    for g, r in zip(got[2], ref[2], strict=True):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def test_bf16_autocast_matches_autocast_reference():
    """Under autocast the logits are bf16 and the statistics fp32, as in the unchunked path; fp32
    parameters get fp32 gradients. The fp64 truth bounds both paths' errors alike."""
    hidden, weight, bias, labels = _data(2, 40, 64, 500, torch.float32)
    truth = _grads(lambda h, w, b: _reference(h, w, b, labels), hidden.double(), weight.double(), bias.double())

    def under_autocast(fn):
        def wrapped(*args):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return fn(*args)
        return wrapped

    ref = _grads(under_autocast(lambda h, w, b: _reference(h, w, b, labels)), hidden, weight, bias)
    got = _grads(under_autocast(lambda h, w, b: chunked_cross_entropy(h, w, labels, None, chunk_tokens=16, bias=b)),
                 hidden, weight, bias)
    assert got[0].dtype == torch.float32
    torch.testing.assert_close(got[0], ref[0], rtol=2e-3, atol=2e-3)
    for name, g, r, t in zip(("hidden", "weight", "bias"), got[2], ref[2], truth[2], strict=True):
        assert g.dtype == torch.float32, name
        scale = t.abs().max().item()
        err_got = (g.double() - t).abs().max().item()
        err_ref = (r.double() - t).abs().max().item()
        assert err_got <= max(2 * err_ref, 1e-3 * scale), (name, err_got, err_ref)
        assert err_ref > 0 or name == "bias"  # the reference really ran in bf16


def test_rejects_bad_shapes_and_sharded_weight():
    hidden, weight, _, labels = _data(1, 4, 8, 10, torch.float64)
    with pytest.raises(ValueError, match="labels shape"):
        chunked_cross_entropy(hidden, weight, labels[:, :2], None)
    with pytest.raises(ValueError, match="weight shape"):
        chunked_cross_entropy(hidden, weight[:, :4], labels, None)
    with pytest.raises(ValueError, match="chunk_tokens=0"):
        chunked_cross_entropy(hidden, weight, labels, None, chunk_tokens=0)
    assert default_chunk_tokens(128 * 1024) == 512 and default_chunk_tokens(1 << 40) == 1


# ---- memory -------------------------------------------------------------------------------------


class LiveBytes(TorchDispatchMode):
    """Peak bytes of tensor storages allocated while active and still alive (CPU, no allocator hooks).

    After every op, new output storages (not an input's: views and in-place results are not
    allocations) are recorded by weak reference; dead ones drop out; the live sum's maximum is kept.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key and key not in inputs and (key not in self.live or self.live[key][0].expired()):
                self.live[key] = (StorageWeakRef(storage), storage.nbytes())
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def _loss_peak(loss_fn, hidden, weight, labels, autocast: bool) -> int:
    hidden = hidden.detach().requires_grad_(True)
    weight = weight.detach().requires_grad_(True)
    with LiveBytes() as tracker:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss, _ = loss_fn(hidden, weight, labels)
        loss.backward()
    assert hidden.grad.dtype == weight.grad.dtype == torch.float32
    return tracker.peak


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_peak_memory_is_an_eighth_of_unchunked(autocast):
    """V=32768, 2048 tokens, d=64: the unchunked loss holds several [tokens, V] buffers, the chunked
    one a [chunk, V] working set; both also hold grad hidden and grad weight (fp32)."""
    vocab, dim, tokens, chunk = 32768, 64, 2048, 128
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, tokens // 2, dim, generator=gen)
    weight = torch.randn(vocab, dim, generator=gen) * 0.1
    labels = torch.randint(0, vocab, (2, tokens // 2), generator=gen)
    unchunked = _loss_peak(lambda h, w, y: _reference(h, w, None, y), hidden, weight, labels, autocast)
    chunked = _loss_peak(lambda h, w, y: chunked_cross_entropy(h, w, y, None, chunk_tokens=chunk),
                         hidden, weight, labels, autocast)
    assert unchunked >= 2 * tokens * vocab * 4  # the tracker sees the full logits
    assert chunked * 8 <= unchunked, (chunked, unchunked)
    # the planner's formula (plus the two gradients it leaves out) predicts the measurement
    grads = (tokens * dim + vocab * dim) * 4
    predicted = grads + chunked_loss_peak_bytes(tokens, vocab, dim, chunk_tokens=chunk,
                                                compute_bytes=2 if autocast else 4)
    assert abs(chunked - predicted) <= 0.02 * predicted, (chunked, predicted)


def test_saves_no_per_token_tensor():
    hidden, weight, _, labels = _data(2, 300, 16, 1000, torch.float32)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    inputs = {t.untyped_storage().data_ptr() for t in (hidden, weight, labels)}
    saved = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in inputs:
            saved.append(t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chunked_cross_entropy(hidden, weight, labels, None, chunk_tokens=64)
    # the gradients computed in the forward (hidden's and the head's, held as saved tensors so the memory report
    # sees them) and the scalar replica count of the final division: no logits, no per-token statistics
    assert sorted(saved) == sorted([4, hidden.numel() * 4, weight.numel() * 4]), saved


# ---- sharded: sp ranks, FSDP2 ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_the_final_norm_inside_the_loss_equals_norm_then_loss(dtype):
    """``norm=FinalNorm(w, eps)`` on the norm's input: the same loss bit for bit, the same gradients (fp64 to
    1e-12; bf16 to its rounding), and the norm's input is not kept for the backward (docs/memory.md)."""
    from loongtrain.loss.chunked import FinalNorm
    from loongtrain.model.rms_norm import rms_norm

    x, weight, _, labels = _data(2, 40, 16, 50, dtype)
    norm_w = (1 + 0.1 * torch.randn(16, generator=torch.Generator().manual_seed(3))).to(dtype)

    def plain(x, w, nw):
        return chunked_cross_entropy(rms_norm(x, nw, 1e-5), w, labels, None, chunk_tokens=7)

    def fused(x, w, nw):
        return chunked_cross_entropy(x, w, labels, None, chunk_tokens=7, norm=FinalNorm(nw, 1e-5))

    (want, _, want_grads), (got, _, got_grads) = _grads(plain, x, weight, norm_w), _grads(fused, x, weight, norm_w)
    assert torch.equal(got, want)
    tol = 1e-12 if dtype == torch.float64 else 2e-2
    for a, b in zip(got_grads, want_grads, strict=True):
        assert (a.double() - b.double()).abs().max() <= tol * max(1.0, b.double().abs().max().item())
    leaf = x.detach().clone().requires_grad_()
    saved: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.untyped_storage().data_ptr()) or t,
                                                  lambda t: t):
        fused(leaf, weight, norm_w)[0]
        plain(leaf, weight, norm_w)[0]
    assert saved.count(leaf.untyped_storage().data_ptr()) == 1  # only the plain norm keeps x: the count can fail
