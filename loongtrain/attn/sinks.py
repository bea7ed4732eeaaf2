"""Attention sinks (gpt-oss): a learned logit per head in every row's softmax denominator, folded into a finished
ring pass once, and its gradient (docs/attention.md#attention-sinks)."""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def fold_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """Attention sinks folded into a finished softmax (docs/attention.md#attention-sinks): ``out [B, H, S, D]``
    and ``lse [B, H, S]`` of the real keys, ``sinks [H]`` a logit per head in every row's denominator (a key
    of value zero). Returns ``(out * exp(lse - lse'), lse')`` with ``lse' = logaddexp(lse, sink)``, in the
    accumulators' dtype: once, after the last merge, so no block pays for it."""
    acc = lse.dtype  # the accumulators' (fp32, fp64 for fp64 inputs)
    folded = torch.logaddexp(lse, sinks.to(acc).view(1, -1, 1))
    return out.to(acc) * torch.exp(lse - folded).unsqueeze(-1), folded


def sinks_grad(dout: Tensor, out: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """d loss / d sinks ``[H]`` of :func:`fold_sinks` over the rows held here (``dout``, ``out [B, H, S, D]``,
    ``lse [B, H, S]`` the folded ones): ``-sum_rows exp(sink - lse') * <dout, out>``. A sum over this rank's
    query rows; the ranks of a sequence hold the other rows, and their sum is the gradient (every
    replicated weight's convention, loongtrain/train/sync.py)."""
    acc = lse.dtype
    delta = (dout.to(acc) * out.to(acc)).sum(-1)  # [B, H, S]
    share = torch.exp(sinks.to(acc).view(1, -1, 1) - lse)
    return -(share * delta).sum(dim=(0, 2)).to(sinks.dtype)
