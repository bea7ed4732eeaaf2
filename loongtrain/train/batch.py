"""Batch sharding: how one full-sequence micro-batch is laid on this rank (docs/attention.md#zigzag-sharding): its
packed documents, the
chunk order it is sharded with, this rank's shard of tokens, labels and positions, and the attention
work its rows compute (for FLOP counts)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from loongtrain.model.config import ModelConfig
from loongtrain.parallel.documents import Documents, cu_seqlens_from_starts, document_position_ids, visible_pairs
from loongtrain.parallel.mesh import Mesh
from loongtrain.parallel.runtime import to_device
from loongtrain.parallel.sharding import shard_sequence
from loongtrain.sections.data import DataSection

Batch = dict[str, torch.Tensor]
ChunkOrder = tuple[int, ...]
#: the fields every batch has (``doc_starts``: packed corpora's), laid out by :meth:`BatchSharding.local` itself
_SHARDED_FIELDS = ("input_ids", "labels", "position_ids", "doc_starts")


@dataclass(frozen=True)
class LocalBatch:
    """This rank's shard of a micro-batch, with what attention needs to mask it. ``extras``: the batch's other
    fields (post-training's, e.g. DPO's ``segment``): a per-token one ``[batch, seq_len]`` sharded like the
    tokens, the others as they are."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: list[torch.Tensor] | None
    chunk_order: ChunkOrder | None
    extras: dict[str, torch.Tensor] = field(default_factory=dict)


def batch_documents(batch: Batch, doc_mask: str, position_reset: bool) -> tuple[list[torch.Tensor] | None,
                                                                              torch.Tensor]:
    """``(cu_seqlens, full position_ids)`` of a full-sequence batch: with ``doc_mask == "on"`` and a batch
    that marks its documents (``doc_starts``, packed corpora) the documents' boundaries and, with
    ``position_reset``, positions restarting per document; else ``(None, batch["position_ids"])``. The one
    document rule of training, validation and ``loongtrain eval``."""
    if doc_mask != "on" or "doc_starts" not in batch:
        return None, batch["position_ids"]
    cu_seqlens = cu_seqlens_from_starts(batch["doc_starts"])
    if not position_reset:
        return cu_seqlens, batch["position_ids"]
    return cu_seqlens, document_position_ids(cu_seqlens, batch["input_ids"].shape[1])


def batch_chunk_order(cu_seqlens: list[torch.Tensor] | None, seq_len: int, mesh: Mesh, chunk_order: str,
                sliding_window: int | None) -> ChunkOrder | None:
    """The chunk order a full-sequence batch is sharded with: ``None`` (zigzag), or with ``chunk_order ==
    "balanced"``, documents (``cu_seqlens``) and ``cp > 1`` the
    :func:`~loongtrain.parallel.documents.balanced_chunk_order` of its documents (every rank of the replica
    computes the same one from the same batch). The one chunk-order rule of training, validation and
    ``loongtrain eval``."""
    if cu_seqlens is None or mesh.cp == 1:
        return None
    documents = Documents(tuple(tuple(cu.tolist()) for cu in cu_seqlens), chunk_order)
    return documents.order(seq_len, mesh.cp, mesh.hp, sliding_window)


class BatchSharding:
    """The run's rules for laying a full-sequence batch (``input_ids``, ``labels``, ``position_ids`` of
    shape ``[batch, seq_len]``, and ``doc_starts`` for packed corpora) on ``mesh``."""

    def __init__(self, cfg: DataSection, mesh: Mesh, model_config: ModelConfig, device: torch.device) -> None:
        self.cfg, self.mesh, self.device = cfg, mesh, device
        self.sliding_window = getattr(model_config, "sliding_window", None)

    def documents(self, batch: Batch) -> tuple[list[torch.Tensor] | None, torch.Tensor]:
        """:func:`batch_documents` under ``--doc-mask`` and ``--position-reset``."""
        return batch_documents(batch, self.cfg.doc_mask, self.cfg.position_reset)

    def chunk_order(self, cu_seqlens: list[torch.Tensor] | None, seq_len: int) -> ChunkOrder | None:
        """:func:`batch_chunk_order` under ``--chunk-order``."""
        return batch_chunk_order(cu_seqlens, seq_len, self.mesh, self.cfg.chunk_order, self.sliding_window)

    def local(self, batch: Batch) -> LocalBatch:
        """This rank's shard: tokens, labels and positions sharded with one chunk order (:meth:`chunk_order`),
        on the device without blocking the host (pinned memory on CUDA)."""
        cu_seqlens, positions = self.documents(batch)
        order = self.chunk_order(cu_seqlens, batch["input_ids"].shape[1])

        def shard(x: torch.Tensor) -> torch.Tensor:
            return to_device(shard_sequence(x, self.mesh, dim=1, chunk_order=order), self.device)

        extras = {key: shard(value) if value.shape == batch["input_ids"].shape else value
                  for key, value in batch.items() if key not in _SHARDED_FIELDS}
        return LocalBatch(shard(batch["input_ids"]), shard(batch["labels"]), shard(positions), cu_seqlens, order,
                          extras)

    def visible_pairs(self, batch: Batch) -> int:
        """Attention (query, key) pairs the batch's rows compute (per layer and head), for FLOP counts."""
        cu_seqlens, _ = self.documents(batch)
        rows, seq = batch["input_ids"].shape
        return sum(visible_pairs(cu_seqlens[b] if cu_seqlens is not None else None, seq,
                                 sliding_window=self.sliding_window) for b in range(rows))


def sharding_fields(batches: Sequence[LocalBatch]) -> dict[str, Any]:
    """What the ranks of a replica must agree on before attention runs on ``batches`` (this rank's shards of
    one step's micro-batches), because it decides the shapes of attention's collectives or which of them
    run: the shards' sizes, the documents and the chunk order (docs/launching.md). Host values only."""
    return {
        "micro_batches": len(batches),
        "input_ids": tuple(tuple(b.input_ids.shape) for b in batches),
        "documents": tuple(None if b.cu_seqlens is None else tuple(tuple(cu.tolist()) for cu in b.cu_seqlens)
                           for b in batches),
        "chunk_order": tuple(b.chunk_order for b in batches),
    }
