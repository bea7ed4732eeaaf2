"""The GRPO family's loss on one rank, float64 against TRL's definitions on padded per-sequence tensors
(tests/helpers/grpo_reference.py), values and gradients: every ``--grpo-loss``, token and sequence ratios,
with and without the KL term and behaviour log-probabilities that leave the clip range, the step split
into micro-batches; token log-probabilities at a temperature with their entropies; TRL's advantages."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from loongtrain.data.rollouts import group_advantages
from loongtrain.loss.chunked import FinalNorm
from loongtrain.loss.grpo import Completions, GRPOSettings, StepCounts, grpo_loss
from loongtrain.loss.token_logprobs import chunked_logprobs_and_entropy
from tests.helpers.grpo_reference import formula_loss, trl_advantages

T, D, V = 29, 8, 23


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_at_a_temperature_with_entropy(temperature):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, T, D, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, D, generator=gen, dtype=torch.float64, requires_grad=True)
    norm = (1 + 0.1 * torch.randn(D, generator=gen, dtype=torch.float64)).requires_grad_()
    labels = torch.randint(0, V, (2, T), generator=gen)
    labels[0, :5] = -100
    logps, entropy = chunked_logprobs_and_entropy(hidden, weight, labels, norm=FinalNorm(norm, 1e-5),
                                                  chunk_tokens=7, temperature=temperature)
    x = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + 1e-5) * norm
    all_logps = torch.log_softmax(F.linear(x, weight) / temperature, dim=-1)
    valid = labels != -100
    ref = torch.where(valid, all_logps.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1), 0)
    ref_entropy = torch.where(valid, -(all_logps.exp() * all_logps).sum(-1), 0)
    torch.testing.assert_close(logps, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(entropy, ref_entropy.detach(), rtol=0, atol=1e-12)
    assert not entropy.requires_grad
    upstream = torch.randn(2, T, dtype=torch.float64, generator=gen)
    mine = torch.autograd.grad((logps * upstream).sum(), [hidden, weight, norm])
    theirs = torch.autograd.grad((ref * upstream).sum(), [hidden, weight, norm])
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


# sequences: (row, start of its completion labels, length); two rows of 24 labels, a group split across them
SEQUENCES = [(0, 2, 5), (0, 9, 3), (0, 14, 8), (1, 1, 6), (1, 8, 2), (1, 12, 9)]
S, ROWS = 24, 2


def _packed(seed: int):
    gen = torch.Generator().manual_seed(seed)
    logps = (-torch.rand(ROWS, S, generator=gen, dtype=torch.float64) * 3).requires_grad_()
    segment = torch.full((ROWS, S), -1)
    slot = [0, 0]
    seq_slot = []
    for row, start, n in SEQUENCES:
        segment[row, start:start + n] = slot[row]
        seq_slot.append(slot[row])
        slot[row] += 1
    shifts = torch.randn(ROWS, S, generator=gen, dtype=torch.float64) * 0.4  # ratios out of [0.8, 1.2] too
    ref = logps.detach() + torch.randn(ROWS, S, generator=gen, dtype=torch.float64) * 0.3
    entropy = torch.rand(ROWS, S, generator=gen, dtype=torch.float64)
    advantages = torch.randn(len(SEQUENCES), generator=gen, dtype=torch.float64)
    return logps, segment, seq_slot, logps.detach() + shifts, ref, entropy, advantages


CASES = list(itertools.product(["dapo", "grpo", "dr_grpo"], ["token", "sequence"], [0.0, 0.04], [False, True]))


@pytest.mark.parametrize("loss_type,level,beta,with_old", CASES)
def test_grpo_loss_equals_trl_definitions(loss_type, level, beta, with_old):
    logps, segment, slots, old, ref, entropy, advantages = _packed(1)
    settings = GRPOSettings(loss_type, 0.2, 0.28, beta, level, max_completion_length=10)
    lengths = torch.zeros(ROWS, 3, dtype=torch.int64)
    adv = torch.zeros(ROWS, 3, dtype=torch.float64)
    for (row, _, n), slot, a in zip(SEQUENCES, slots, advantages):
        lengths[row, slot], adv[row, slot] = n, a
    counts = StepCounts(float(sum(n for _, _, n in SEQUENCES)), float(len(SEQUENCES)))
    total, stats = 0.0, 0.0
    for row in range(ROWS):  # one micro-batch a row: the trainer averages loss / micro_batches
        take = slice(row, row + 1)
        shard = Completions(logps[take], segment[take], adv[take], lengths[take], old[take] if with_old else None,
                            ref[take] if beta else None, entropy[take])
        loss, value, s = grpo_loss(settings, shard, counts, ROWS, None)
        total = total + loss / ROWS
        stats = stats + s
        torch.testing.assert_close(value, loss.detach(), rtol=0, atol=0)
    pieces = [(row, slice(start, start + n)) for row, start, n in SEQUENCES]
    expected, metrics = formula_loss(
        [logps[r, p] for r, p in pieces], advantages.tolist(), loss_type=loss_type, epsilon=0.2, epsilon_high=0.28,
        beta=beta, importance_sampling=level, max_completion_length=10,
        old=[old[r, p] for r, p in pieces] if with_old else None, ref=[ref[r, p] for r, p in pieces] if beta else None,
        entropies=[entropy[r, p] for r, p in pieces])
    torch.testing.assert_close(total, expected, rtol=0, atol=1e-13)
    (mine,) = torch.autograd.grad(total, logps)
    (theirs,) = torch.autograd.grad(expected, logps)
    torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-13)
    unit = counts.sequences if level == "sequence" else counts.tokens
    assert abs(float(stats[1]) / counts.tokens - metrics["entropy"]) < 1e-12
    if beta:
        assert abs(float(stats[0]) / counts.tokens - metrics["kl"]) < 1e-12
    for i, name in enumerate(("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")):
        assert abs(float(stats[2 + i]) / unit - metrics[name]) < 1e-12, name
    if with_old:  # the case meant to clip does
        assert metrics["clip_ratio/region_mean"] > 0


def test_no_completion_token_gives_zero_and_no_nan():
    logps = torch.zeros(1, 8, dtype=torch.float64, requires_grad=True)
    segment = torch.full((1, 8), -1)
    for loss_type in ("dapo", "grpo", "dr_grpo"):
        settings = GRPOSettings(loss_type, beta=0.04, importance_sampling="sequence")
        shard = Completions(logps, segment, torch.zeros(1, 1, dtype=torch.float64),
                            torch.zeros(1, 1, dtype=torch.int64), ref_logps=torch.zeros(1, 8, dtype=torch.float64))
        loss, value, stats = grpo_loss(settings, shard, StepCounts(10.0, 2.0), 2.0, None)
        (g,) = torch.autograd.grad(loss, logps)
        assert float(value) == 0 and not g.any() and torch.isfinite(g).all() and not stats.any()


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_are_trls(scale):
    gen = torch.Generator().manual_seed(2)
    rewards = torch.rand(12, generator=gen, dtype=torch.float64).tolist()
    rewards[4:8] = [0.5] * 4  # a group without spread
    expected = trl_advantages(rewards, 4, scale)
    order = torch.randperm(12, generator=gen).tolist()  # groups in any order, by key
    got, zero = group_advantages([rewards[i] for i in order], [i // 4 for i in order], scale)
    torch.testing.assert_close(torch.tensor(got), expected[order], rtol=0, atol=1e-12)
    if scale == "batch":
        assert not zero.any()
    else:
        assert [bool(z) for z in zero] == [4 <= i < 8 for i in order]


def test_advantages_use_trls_unbiased_std():
    from trl.trainer.utils import nanstd

    rewards = [0.1, 0.9, 0.4, 0.3, 2.0, -1.0]
    got, _ = group_advantages(rewards, [0, 0, 0, 1, 1, 1], "group")
    r = torch.tensor(rewards, dtype=torch.float64).view(2, 3)
    std = nanstd(r, dim=1).repeat_interleave(3)
    expected = (r.flatten() - r.mean(1).repeat_interleave(3)) / (std + 1e-4)
    torch.testing.assert_close(torch.tensor(got), expected, rtol=0, atol=1e-12)


def test_settings_refuse_bad_values():
    with pytest.raises(ValueError, match="--grpo-loss 'bnpo'"):
        GRPOSettings("bnpo")
    with pytest.raises(ValueError, match="--importance-sampling 'seq'"):
        GRPOSettings(importance_sampling="seq")
    with pytest.raises(ValueError, match="--grpo-epsilon=1.5"):
        GRPOSettings(epsilon=1.5)
    with pytest.raises(ValueError, match="--grpo-beta=-1"):
        GRPOSettings(beta=-1)
