"""Data, gradients and the unchunked reference of the chunked-loss tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loongtrain.loss.chunked import (
    IGNORE_INDEX,
)
from loongtrain.loss.sharded import sharded_cross_entropy


def _data(batch: int, seq: int, dim: int, vocab: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, seq, dim, dtype=dtype, generator=gen)
    weight = torch.randn(vocab, dim, dtype=dtype, generator=gen) * 0.5
    bias = torch.randn(vocab, dtype=dtype, generator=gen)
    labels = torch.randint(0, vocab, (batch, seq), generator=gen)
    labels[0, 2:9] = IGNORE_INDEX
    labels[-1, -3:] = IGNORE_INDEX
    return hidden, weight, bias, labels


def _grads(loss_fn, *tensors):
    leaves = [t.detach().clone().requires_grad_(True) if t is not None else None for t in tensors]
    loss, value = loss_fn(*leaves)
    loss.backward()
    return loss.detach(), value, [t.grad if t is not None else None for t in leaves]


def _reference(hidden, weight, bias, labels, mesh=None):
    return sharded_cross_entropy(F.linear(hidden, weight, bias), labels, mesh)
