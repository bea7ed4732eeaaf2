"""The post-training losses on one rank, float64 against plain autograd on full logits (1e-10):
:func:`~loongtrain.loss.token_logprobs.chunked_token_logprobs` (values and gradients for any per-token
upstream weights, with the final norm and a bias), :func:`~loongtrain.loss.sft.sft_loss` (no NaN when
nothing is a target), :func:`~loongtrain.loss.dpo.sequence_logps` and :func:`~loongtrain.loss.dpo.dpo_loss`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loongtrain.loss.chunked import FinalNorm
from loongtrain.loss.dpo import dpo_loss, sequence_logps
from loongtrain.loss.sft import sft_loss, step_scale, target_count
from loongtrain.loss.token_logprobs import chunked_token_logprobs

T, D, V = 37, 8, 29


def _inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, T, D, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, D, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(V, generator=gen, dtype=torch.float64, requires_grad=True)
    norm = (1 + 0.1 * torch.randn(D, generator=gen, dtype=torch.float64)).requires_grad_()
    labels = torch.randint(0, V, (2, T), generator=gen)
    labels[0, 3:9] = -100
    labels[1, -4:] = -100
    return hidden, weight, bias, norm, labels


def _reference_logps(hidden, weight, bias, norm, labels):
    x = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + 1e-5) * norm if norm is not None else hidden
    logps = torch.log_softmax(F.linear(x, weight, bias), dim=-1)
    safe = labels.clamp(min=0)
    return torch.where(labels != -100, logps.gather(-1, safe[..., None]).squeeze(-1), 0)


@pytest.mark.parametrize("with_norm", [False, True])
@pytest.mark.parametrize("chunk_tokens", [5, 1000])
def test_token_logprobs_values_and_gradients(with_norm, chunk_tokens):
    hidden, weight, bias, norm, labels = _inputs()
    upstream = torch.randn(2, T, dtype=torch.float64)
    final = FinalNorm(norm, 1e-5) if with_norm else None
    got = chunked_token_logprobs(hidden, weight, labels, bias=bias, norm=final, chunk_tokens=chunk_tokens)
    ref = _reference_logps(hidden, weight, bias, norm if with_norm else None, labels)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)
    params = [hidden, weight, bias] + ([norm] if with_norm else [])
    mine = torch.autograd.grad((got * upstream).sum(), params)
    theirs = torch.autograd.grad((ref * upstream).sum(), params)
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    assert (got[labels == -100] == 0).all()


def test_sft_loss_is_a_sum_scaled_by_the_step_and_never_nan():
    hidden, weight, _, _, labels = _inputs(1)
    count = target_count([labels])
    loss, value = sft_loss(hidden, weight, labels, None, step_scale(count, 1, 1))
    ref = F.cross_entropy(F.linear(hidden, weight).reshape(-1, V), labels.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(value, ref.detach(), rtol=0, atol=1e-12)
    (g,) = torch.autograd.grad(loss, hidden)
    (g_ref,) = torch.autograd.grad(ref, hidden)
    torch.testing.assert_close(g, g_ref, rtol=0, atol=1e-12)
    nothing = torch.full_like(labels, -100)
    loss, value = sft_loss(hidden, weight, nothing, None, step_scale(0, 1, 1))
    (g,) = torch.autograd.grad(loss, hidden)
    assert float(value) == 0.0 and torch.isfinite(g).all() and not g.any()
    assert step_scale(40, 2, 4) == 4 * 2 / 40


def test_sequence_logps_and_dpo_loss():
    token = torch.randn(2, 10, dtype=torch.float64, requires_grad=True)
    segment = torch.tensor([[-1, 0, 0, -1, 1, 1, 1, -1, 2, 3], [-1, 1, 0, 0, -1, -1, -1, -1, -1, -1]])
    seqs = sequence_logps(token, segment, 4, None)
    expected = torch.stack([torch.stack([token[b][segment[b] == s].sum() for s in range(4)]) for b in range(2)])
    torch.testing.assert_close(seqs, expected, rtol=0, atol=0)
    reference = torch.randn(2, 4, dtype=torch.float64)
    num_pairs = torch.tensor([2, 1])  # the second row's second pair slot is padding
    beta, scale = 0.3, 1 / 3
    loss, value, stats = dpo_loss(seqs, reference, num_pairs, beta, scale)
    margins = beta * ((seqs[:, 0::2] - reference[:, 0::2]) - (seqs[:, 1::2] - reference[:, 1::2]))
    valid = torch.tensor([[True, True], [True, False]])
    ref_loss = -F.logsigmoid(margins[valid]).sum() * scale
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-14)
    chosen = beta * (seqs[:, 0::2] - reference[:, 0::2])[valid]
    rejected = beta * (seqs[:, 1::2] - reference[:, 1::2])[valid]
    torch.testing.assert_close(stats, torch.stack([chosen.sum(), rejected.sum(), (chosen - rejected).sum(),
                                                   (chosen > rejected).sum().double()]).detach(), rtol=0, atol=1e-14)
    (g,) = torch.autograd.grad(loss, token, retain_graph=True)
    (g_ref,) = torch.autograd.grad(ref_loss, token)
    torch.testing.assert_close(g, g_ref, rtol=0, atol=1e-14)
    assert float(value) == pytest.approx(float(ref_loss.detach()))
