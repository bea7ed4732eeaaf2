"""The GRPO family's policy loss on sequence-sharded completions (``--objective grpo``, docs/rl.md).

A row of a GRPO batch packs whole documents ``prompt + completion``; ``segment [B, S]`` names, for every label
that is a completion token (EOS included), the row's sequence it belongs to (-1 for prompts, padding and the
last token of a document). Each rank holds its shard of the row's tokens. Per completion token ``t`` of
sequence ``i`` (TRL's ``GRPOTrainer._compute_loss``):

    log_ratio = logp - old_logp                 (old: the rollout's, else the policy's own, detached)
    coef      = exp(log_ratio)                  (--importance-sampling token)
              = exp(mean of log_ratio over i)   (sequence: GSPO; one all-reduce of the sums over the sp ranks)
    loss_t    = -min(coef * A_i, clamp(coef, 1 - eps_low, 1 + eps_high) * A_i) + beta * kl_t
    kl_t      = exp(ref - logp) - (ref - logp) - 1      (k3, with beta > 0)

and the step's loss is ``sum_t w_t * loss_t`` over every completion token of the optimizer step (all ranks,
micro-batches and replicas) with the normalisation ``--grpo-loss`` names, known on the host before the
forward from the step's own batches (:class:`StepCounts`), so it is the same at any layout:

- ``dapo``: ``w_t = 1 / T`` (``T`` the step's completion tokens);
- ``grpo``: ``w_t = 1 / (len_i * N)`` (each sequence's mean, then the mean over the step's ``N`` sequences);
- ``dr_grpo``: ``w_t = 1 / (N * max_completion_length)``.

Each micro-batch returns ``sum over its tokens of w_t * loss_t * scale`` with ``scale = dp * micro_batches``,
which the trainer's averaging over micro-batches and replicas turns into the step's sum. The metrics (TRL's
names, :data:`LOSS_METRICS`) are detached sums the objective divides by the step's tokens (or sequences, for
the clip ratios under sequence-level importance sampling).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loongtrain.loss.dpo import sequence_logps
from loongtrain.loss.sft import replica_sum
from loongtrain.parallel.mesh import Mesh

Tensor = torch.Tensor

#: each ``--grpo-loss`` (TRL's ``loss_type``) and the normaliser of its token sum (module docstring)
NORMALISERS = (("dapo", "tokens"), ("grpo", "sequence means"), ("dr_grpo", "constant"))
LOSS_TYPES = tuple(name for name, _ in NORMALISERS)
IMPORTANCE_SAMPLING = ("token", "sequence")
#: the detached sums :func:`grpo_loss` returns, in order: kl, entropy, and the clip indicators; TRL's names
LOSS_METRICS = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


@dataclass(frozen=True)
class GRPOSettings:
    """The loss's options (TRL's names in brackets): ``loss_type`` [loss_type], ``epsilon`` [epsilon] and
    ``epsilon_high`` [epsilon_high], ``beta`` [beta], ``importance_sampling`` [importance_sampling_level],
    ``max_completion_length`` (dr_grpo's constant)."""

    loss_type: str = "dapo"
    epsilon: float = 0.2
    epsilon_high: float = 0.2
    beta: float = 0.0
    importance_sampling: str = "token"
    max_completion_length: int = 256

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"--grpo-loss {self.loss_type!r}: choose one of {', '.join(LOSS_TYPES)}")
        if self.importance_sampling not in IMPORTANCE_SAMPLING:
            raise ValueError(f"--importance-sampling {self.importance_sampling!r}: choose one of "
                             f"{', '.join(IMPORTANCE_SAMPLING)}")
        for name, value in (("--grpo-epsilon", self.epsilon), ("--grpo-epsilon-high", self.epsilon_high)):
            if not (0 <= value < float("inf")):
                raise ValueError(f"{name}={value} must be finite and >= 0")
        if self.epsilon >= 1:
            raise ValueError(f"--grpo-epsilon={self.epsilon} must be < 1 (the ratio's lower bound is 1 - epsilon)")
        if not (0 <= self.beta < float("inf")):
            raise ValueError(f"--grpo-beta={self.beta} must be finite and >= 0")
        if self.max_completion_length < 1:
            raise ValueError(f"--max-completion-length={self.max_completion_length} must be >= 1")


@dataclass(frozen=True)
class StepCounts:
    """The optimizer step's completion tokens and sequences (all replicas), counted before the forward."""

    tokens: float
    sequences: float


def sequence_weights(settings: GRPOSettings, lengths: Tensor, counts: StepCounts) -> Tensor:
    """``w [B, n]``: each sequence's per-token weight (module docstring) from its completion length
    ``lengths [B, n]`` (0 for an empty slot, whose weight is 0). Float64."""
    lengths = lengths.to(torch.float64)
    if not counts.tokens:
        return torch.zeros_like(lengths)
    rule = dict(NORMALISERS)[settings.loss_type]
    if rule == "tokens":
        w = torch.full_like(lengths, 1.0 / counts.tokens)
    elif rule == "sequence means":
        w = 1.0 / (lengths.clamp(min=1) * counts.sequences)
    else:
        w = torch.full_like(lengths, 1.0 / (counts.sequences * settings.max_completion_length))
    return torch.where(lengths > 0, w, 0)


def per_token(values: Tensor, segment: Tensor) -> Tensor:
    """``values [B, n]`` spread to the tokens of this rank's shard ``segment [B, s]`` (0 outside sequences)."""
    inside = segment >= 0
    out = values.gather(1, segment.clamp(min=0))
    return torch.where(inside, out, torch.zeros((), dtype=out.dtype, device=out.device))


@dataclass(frozen=True)
class Completions:
    """This rank's shard of one micro-batch's completions. Per token ``[B, s]``: ``logps`` (the policy's at the
    sampling temperature, differentiable), ``segment`` (the row's sequence of each completion label, -1 for the
    rest), ``old_logps`` (the behaviour policy's; None: the policy's own, detached), ``ref_logps`` (the
    reference's, with beta > 0), ``entropy`` (for the metric); per sequence of the row ``[B, n]``: ``advantages``
    and ``lengths`` (its completion tokens over the whole row)."""

    logps: Tensor
    segment: Tensor
    advantages: Tensor
    lengths: Tensor
    old_logps: Tensor | None = None
    ref_logps: Tensor | None = None
    entropy: Tensor | None = None


def grpo_loss(settings: GRPOSettings, c: Completions, counts: StepCounts, scale: float,
              mesh: Mesh | None) -> tuple[Tensor, Tensor, Tensor]:
    """``(loss_for_backward, value, stats)`` of this rank's shard of one micro-batch (:class:`Completions`).

    ``value`` is the detached sum over the replica (identical on its sp ranks) times ``scale``; ``stats`` the
    detached sums of :data:`LOSS_METRICS` over this rank's tokens (each clip indicator weighted by ``1 / len_i``
    under sequence-level importance sampling: a sum over sequences once the ranks' sums are added).
    Communication: with ``importance_sampling == "sequence"`` and ``sp > 1``, one all-reduce of ``[B, n]``
    values over ``mesh.sp_group`` (forward; backward none); the value: one all-reduce of one scalar."""
    logps, segment, advantages, lengths = c.logps, c.segment, c.advantages, c.lengths
    old_logps, ref_logps, entropy = c.old_logps, c.ref_logps, c.entropy
    mask = segment >= 0
    dtype = logps.dtype
    zero = torch.zeros((), dtype=dtype, device=logps.device)
    old = logps.detach() if old_logps is None else old_logps.to(dtype)
    log_ratio = torch.where(mask, logps - old, zero)
    inv_len = per_token(1.0 / lengths.to(dtype).clamp(min=1), segment)
    if settings.importance_sampling == "sequence":
        seq = sequence_logps(log_ratio * inv_len, segment, lengths.shape[1], mesh)
        log_ratio = per_token(seq, segment)
    coef = torch.exp(log_ratio)
    adv = per_token(advantages.to(dtype), segment)
    clipped = coef.clamp(1 - settings.epsilon, 1 + settings.epsilon_high)
    token_loss = -torch.minimum(coef * adv, clipped * adv)
    kl = None
    if settings.beta:
        assert ref_logps is not None, "grpo_loss: beta > 0 needs the reference's log-probabilities"
        delta = torch.where(mask, ref_logps.to(dtype) - logps, zero)
        kl = torch.exp(delta) - delta - 1
        token_loss = token_loss + settings.beta * kl
    weights = per_token(sequence_weights(settings, lengths, counts).to(dtype), segment)
    total = torch.where(mask, token_loss * weights, zero).sum()
    with torch.no_grad():
        low = (coef < 1 - settings.epsilon) & (adv < 0) & mask
        high = (coef > 1 + settings.epsilon_high) & (adv > 0) & mask
        unit = inv_len if settings.importance_sampling == "sequence" else mask.to(dtype)
        stats = torch.stack([
            torch.where(mask, kl, zero).sum() if kl is not None else zero,
            torch.where(mask, entropy.to(dtype), zero).sum() if entropy is not None else zero,
            (low * unit).sum(), (high * unit).sum(), ((low | high) * unit).sum()]).to(torch.float64)
    return total * scale, replica_sum(total, mesh) * scale, stats
