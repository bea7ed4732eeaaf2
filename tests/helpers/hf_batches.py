"""A batch of token ids and positions for the Hugging Face model tests."""

from __future__ import annotations

import torch

from tests.helpers.hf_models import SEQ, VOCAB

BATCH = 2


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    inputs, labels = tokens[:, :-1], tokens[:, 1:].clone()  # labels pre-shifted: never passed to HF
    labels[0, 3:7] = -100
    labels[1, -5:] = -100
    return inputs, labels, torch.arange(SEQ).expand(BATCH, SEQ)
