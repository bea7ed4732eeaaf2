"""A deterministic synthetic batch source (tests and benchmarks): no corpus, no tokenizer.

The source takes the run's sections (``data.batch_size``, ``data.seq_len``, ``optim.seed``) and ``Mesh`` (``dp``,
``dp_rank``) duck-typed: this module sits below both.

Micro-step ``i`` draws a *global* batch of ``dp * batch_size`` random sequences from a generator
seeded with ``(seed, i)``; replica ``d`` takes rows ``[d * batch_size, (d + 1) * batch_size)``. A single
process with ``batch_size * dp`` rows therefore sees exactly the union of the replicas' samples,
and resuming at any micro-step reproduces the same stream.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

Batch = dict[str, torch.Tensor]


def global_batch(step: int, rows: int, seq_len: int, vocab: int, seed: int) -> Batch:
    """Micro-step ``step``'s global batch of ``rows`` sequences (labels = inputs shifted by one)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    tokens = torch.randint(0, vocab, (rows, seq_len + 1), generator=gen)
    positions = torch.arange(seq_len).expand(rows, seq_len).contiguous()
    return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:], "position_ids": positions}


def synthetic_source(vocab: int):
    """A ``BatchSource`` (``(cfg, mesh, start_micro_step) -> iterator``) over random tokens < ``vocab``.

    The global batch has ``cfg.data.batch_size * mesh.dp`` rows, so a one-process reference run with
    ``batch_size = dp * per_replica`` sees exactly the rows of all replicas of a parallel run.
    """

    def source(cfg: Any, mesh: Any, start: int) -> Iterator[Batch]:
        size, seq_len, seed = cfg.data.batch_size, cfg.data.seq_len, cfg.optim.seed
        rows = size * mesh.dp
        lo = mesh.dp_rank * size
        step = start
        while True:
            batch = global_batch(step, rows, seq_len, vocab, seed)
            yield {k: v[lo : lo + size] for k, v in batch.items()}
            step += 1

    return source
