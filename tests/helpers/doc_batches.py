"""Packed-document batches for training tests (documents of length 1 and unaligned ones)."""

from __future__ import annotations

import torch
import torch._dynamo

from tests.helpers.fixtures import tiny_model

MODEL = tiny_model()


SEQ, ROWS = 32, 2


def packed_batch() -> dict[str, torch.Tensor]:
    """Two packed rows as the data pipeline gives them (documents of length 1 and unaligned ones)."""
    gen = torch.Generator().manual_seed(4)
    tokens = torch.randint(1, MODEL.vocab_size, (ROWS, SEQ + 1), generator=gen)
    starts = torch.zeros(ROWS, SEQ, dtype=torch.bool)
    starts[:, 0] = True
    starts[0, [3, 4, 13, 29]] = True
    starts[1, [17]] = True
    return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:],
            "position_ids": torch.arange(SEQ).expand(ROWS, SEQ).contiguous(), "doc_starts": starts}


def doc_batch(step: int, rows: int = 1) -> dict[str, torch.Tensor]:
    """Random tokens with a different document mix at every step (1 to 5 documents per row)."""
    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, MODEL.vocab_size, (rows, SEQ + 1), generator=gen)
    starts = torch.zeros(rows, SEQ, dtype=torch.bool)
    starts[:, 0] = True
    for r in range(rows):
        starts[r, torch.randperm(SEQ - 1, generator=gen)[: (step + r) % 5].add(1)] = True
    return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:],
            "position_ids": torch.arange(SEQ).expand(rows, SEQ).contiguous(), "doc_starts": starts}
