"""Per-token log-probabilities of the labels from the final hidden states and the LM head, a chunk of tokens
at a time, differentiable for any upstream gradient per token (what a sequence-level loss such as DPO's
needs: its weight for a token is known only once every token's log-probability is).

:func:`chunked_token_logprobs` returns ``logp [...] = logit[label] - logsumexp(logits)`` (0 where the
label is ``IGNORE_INDEX``) for this rank's ``hidden [..., d]`` through the head ``weight [V, d]``, and, like
:func:`~loongtrain.loss.chunked.chunked_cross_entropy`, never holds the logits of more than one chunk:
the forward keeps the per-token log-sum-exp (4 bytes a token), the backward recomputes each chunk's
logits and pushes ``g * (onehot - softmax)`` through the head (four matmuls a chunk instead of the fused
cross-entropy's three: the gradient weights arrive only with the backward). ``norm``: the final RMSNorm,
applied a chunk at a time to ``hidden`` (then its input), its backward too. ``temperature``: the
log-probabilities of ``logits / temperature`` (what a policy sampled at that temperature assigns, TRL's
GRPO rule). :func:`chunked_logprobs_and_entropy` also returns each token's entropy of that distribution,
``lse - sum(p * z)``, from the same chunk (no gradient: a metric). Precision as the chunked
cross-entropy's: logits in the compute dtype, statistics in float32 (float64 for float64 inputs).
Communication: none.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from loongtrain.loss.chunked import (
    FinalNorm,
    _accumulate,
    _chunk_logits,
    _chunks,
    _compute_dtype,
    _stats_dtype,
    _targets,
    default_chunk_tokens,
)
from loongtrain.model.rms_norm import rms_norm_backward, rms_norm_forward

Tensor = torch.Tensor


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """forward: per-token ``logit[label] / t - lse`` (0 for ignored labels), the lse of ``logits / t`` kept, and
    (``entropy``) each target's entropy, else an empty tensor; backward: per chunk, the logits recomputed and
    ``grad * (onehot - softmax) / t`` pushed through the head and the final norm."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, norm_weight: Tensor | None,
                labels: Tensor, config: tuple[int, torch.dtype, float, torch.dtype | None, float, bool]
                ) -> tuple[Tensor, Tensor]:
        """``config``: ``(chunk_tokens, compute dtype, norm eps, norm statistics dtype, temperature, entropy)``."""
        chunk_tokens, compute, eps, norm_stats, temperature, entropy = config
        stats = _stats_dtype(compute)
        out = torch.empty(hidden.shape[0], dtype=stats, device=hidden.device)
        lse = torch.empty(hidden.shape[0], dtype=stats, device=hidden.device)
        ent = torch.zeros(hidden.shape[0] if entropy else 0, dtype=stats, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(compute)
            for start, stop in _chunks(hidden.shape[0], chunk_tokens):
                valid, safe = _targets(labels[start:stop])
                x = hidden[start:stop]
                normed = rms_norm_forward(x, norm_weight, eps, norm_stats)[0] if norm_weight is not None else x
                z = _chunk_logits(normed.to(compute), w, bias, compute).to(stats)
                if temperature != 1.0:
                    z.div_(temperature)
                lse[start:stop] = torch.logsumexp(z, dim=1)
                out[start:stop] = torch.where(valid, z.gather(1, safe[:, None]).squeeze(1) - lse[start:stop], 0)
                if entropy:  # H = lse - sum(p * z), p = exp(z - lse)
                    mean_z = (torch.exp(z - lse[start:stop, None]) * z).sum(dim=1)
                    ent[start:stop] = torch.where(valid, lse[start:stop] - mean_z, 0)
                del z
        ctx.save_for_backward(hidden, weight, bias, norm_weight, labels, lse)
        ctx.config = config
        ctx.mark_non_differentiable(ent)
        return out, ent

    @staticmethod
    def backward(ctx, grad_out: Tensor, _grad_entropy: Tensor | None):
        hidden, weight, bias, norm_weight, labels, lse = ctx.saved_tensors
        chunk_tokens, compute, eps, norm_stats, temperature, _ = ctx.config
        need_h, need_w, need_b, need_n = ctx.needs_input_grad[:4]
        stats = lse.dtype
        grad_hidden = torch.empty_like(hidden) if need_h else None
        grad_weight = torch.zeros_like(weight) if need_w else None
        grad_bias = torch.zeros_like(bias) if need_b else None
        grad_norm = (torch.zeros(norm_weight.shape, dtype=_stats_dtype(norm_weight.dtype), device=norm_weight.device)
                     if need_n else None)
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(compute)
            for start, stop in _chunks(hidden.shape[0], chunk_tokens):
                valid, safe = _targets(labels[start:stop])
                x = hidden[start:stop]
                normed, rstd = rms_norm_forward(x, norm_weight, eps, norm_stats) if norm_weight is not None \
                    else (x, None)
                h = normed.to(compute)
                z = _chunk_logits(h, w, bias, compute).to(stats)
                if temperature != 1.0:
                    z.div_(temperature)
                # in place: z becomes g * (onehot - softmax) / t, 0 for ignored tokens
                z.sub_(lse[start:stop, None]).exp_().neg_()
                z[torch.arange(stop - start, device=z.device), safe] += 1
                z.mul_((grad_out[start:stop].to(stats) * valid / temperature)[:, None])
                grad_z = z.to(compute)
                del z
                if rstd is not None and (need_h or need_n):
                    gx, gn = rms_norm_backward((grad_z @ w).to(normed.dtype), x, norm_weight, rstd, need_h, need_n,
                                               weight_grad_dtype=None if grad_norm is None else grad_norm.dtype)
                    if need_h:
                        grad_hidden[start:stop] = gx
                    if need_n:
                        grad_norm += gn
                elif need_h:
                    grad_hidden[start:stop] = (grad_z @ w).to(hidden.dtype)
                if need_w:
                    _accumulate(grad_weight, grad_z.T, h)
                if need_b:
                    grad_bias += grad_z.sum(dim=0, dtype=stats).to(grad_bias.dtype)
                del grad_z
        if grad_norm is not None:
            grad_norm = grad_norm.to(norm_weight.dtype)
        return grad_hidden, grad_weight, grad_bias, grad_norm, None, None


def chunked_token_logprobs(hidden: Tensor, weight: Tensor, labels: Tensor, *, chunk_tokens: int | None = None,
                           bias: Tensor | None = None, norm: FinalNorm | None = None,
                           temperature: float = 1.0) -> Tensor:
    """``logp [...]`` of every label of this rank's ``hidden [..., d]`` through the head ``weight [V, d]``
    (0 where the label is ``IGNORE_INDEX``), in the statistics dtype; differentiable (module docstring).
    Communication: none."""
    return chunked_logprobs_and_entropy(hidden, weight, labels, chunk_tokens=chunk_tokens, bias=bias, norm=norm,
                                        temperature=temperature, entropy=False)[0]


def chunked_logprobs_and_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, *, chunk_tokens: int | None = None,
                                 bias: Tensor | None = None, norm: FinalNorm | None = None,
                                 temperature: float = 1.0, entropy: bool = True) -> tuple[Tensor, Tensor | None]:
    """``(logp [...], entropy [...] or None)``: :func:`chunked_token_logprobs` and, with ``entropy``, each
    label's entropy of ``softmax(logits / temperature)`` (0 where ignored; detached). Communication: none."""
    if hidden.shape[:-1] != labels.shape or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"hidden {tuple(hidden.shape)}, labels {tuple(labels.shape)} and weight "
                         f"{tuple(weight.shape)} must be [..., d], [...] and (vocab, d)")
    if isinstance(weight, DTensor) or (norm is not None and isinstance(norm.weight, DTensor)):
        raise ValueError("chunked_token_logprobs needs the gathered LM head and norm weights, got a sharded "
                         "DTensor (see loongtrain/loss/chunked.py: FSDP2's root kept unsharded)")
    chunk_tokens = chunk_tokens or default_chunk_tokens(weight.shape[0])
    norm_weight, eps, stats = (norm.weight, norm.eps, norm.stats_dtype) if norm is not None else (None, 0.0, None)
    if not (temperature > 0 and temperature != float("inf")):
        raise ValueError(f"temperature={temperature} must be finite and > 0")
    out, ent = _ChunkedTokenLogprobs.apply(hidden.reshape(-1, hidden.shape[-1]), weight, bias, norm_weight,
                                           labels.reshape(-1), (chunk_tokens, _compute_dtype(hidden, weight), eps,
                                                                stats, float(temperature), entropy))
    return out.reshape(labels.shape), ent.reshape(labels.shape) if entropy else None
