"""Ranks whose later attention calls disagree (documents, their type, dtype) all raise, naming the field and
the ranks, however many agreed calls came before."""

from __future__ import annotations

import pytest
import torch

def _attention_changes_later(rank: int, world_size: int) -> list[str]:
    """Agreed calls, then one rank changes its document boundaries (and, later, its dtype): every rank
    must raise, naming the field, however many calls came before."""
    from loongtrain import attention, shard_sequence
    from loongtrain.parallel.mesh import init_mesh

    mesh = init_mesh(1, 2)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (shard_sequence(torch.randn(1, 16, 2, 4, generator=gen, dtype=torch.float64), mesh, dim=1)
               for _ in range(3))
    cu = torch.tensor([0, 8, 16])
    for _ in range(3):
        attention(q, k, v, mesh, cu_seqlens=cu)
    errors = []
    for bad in (lambda: attention(q, k, v, mesh, cu_seqlens=torch.tensor([0, 4 if rank else 8, 16])),
                lambda: attention(q, k, v, mesh, cu_seqlens=[0.0, 8.0, 16.0] if rank else [0, 8, 16]),
                lambda: attention(q.float() if rank else q, k, v, mesh, cu_seqlens=cu)):
        try:
            bad()
        except ValueError as exc:
            errors.append(str(exc))
    attention(q, k, v, mesh, cu_seqlens=cu)  # agreed again: runs
    return errors


@pytest.mark.distributed
def test_a_later_disagreement_raises_on_every_rank():
    from loongtrain.parallel.workers import run_local

    for errors in run_local(_attention_changes_later, 2, backend="gloo", timeout=120, collective_timeout=20):
        assert len(errors) == 3, errors
        assert "documents: (0, 8, 16) on ranks [0], (0, 4, 16) on ranks [1]" in errors[0], errors[0]
        assert "documents" in errors[1] and "(0.0, 8.0, 16.0) on ranks [1]" in errors[1], errors[1]
        assert "dtype: 'torch.float64' on ranks [0], 'torch.float32' on ranks [1]" in errors[2], errors[2]
