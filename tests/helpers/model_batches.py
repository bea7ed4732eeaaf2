"""A small model config and a batch of token ids and positions for the native model tests."""

from __future__ import annotations

import torch

from loongtrain.loss.sharded import IGNORE_INDEX

SMALL = dict(vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=48)


SEQ, BATCH = 32, 2


def _batch(seed: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random tokens, shifted labels with some ignored, and positions offset by an arbitrary amount."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=gen)
    inputs, labels = tokens[:, :-1], tokens[:, 1:].clone()
    labels[0, 3:7] = IGNORE_INDEX
    labels[1, -5:] = IGNORE_INDEX
    positions = torch.arange(SEQ).expand(BATCH, SEQ) + 100
    return inputs, labels, positions
