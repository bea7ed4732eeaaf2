"""One sharded, forward-only pass of an evaluation sequence (docs/evaluation.md).

:func:`sharded_forward` shards a full-sequence batch over the replica in the run's layout
(:func:`~loongtrain.parallel.sharding.shard_sequence`: zigzag, or with ``--chunk-order balanced`` and
documents the trainer's balanced chunk order, :func:`loongtrain.train.batch.batch_chunk_order`), runs the model
to its final hidden states under ``torch.no_grad()`` (nothing kept for a backward) and returns this
rank's hidden states, the LM head, its labels, and the *global* position of each of its tokens
(:func:`~loongtrain.parallel.zigzag.shard_indices` of that layout), so that the tasks score tokens where
they live and reduce only counts and sums. ``--doc-mask`` follows training: with ``doc_mask == "on"`` and
a batch that marks its documents, attention stays inside each document and, with ``position_reset``,
positions restart per document (the trainer's own rule, :func:`loongtrain.train.batch.batch_documents`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from loongtrain.parallel.mesh import Mesh
from loongtrain.parallel.runtime import is_distributed
from loongtrain.parallel.sharding import shard_sequence
from loongtrain.parallel.zigzag import shard_indices
from loongtrain.train.batch import batch_chunk_order, batch_documents
from loongtrain.train.model_setup import hidden_and_head

Batch = dict[str, torch.Tensor]


@dataclass
class LocalTokens:
    """This rank's tokens of one forward: ``hidden [B, S/sp, d]``, ``head [V, d]``, ``labels [B, S/sp]``,
    ``index [S/sp]`` (global sequence index of each local token) and ``positions [B, S/sp]`` (their
    position ids: the index, or the position inside its document with ``--position-reset``)."""

    hidden: torch.Tensor
    head: torch.Tensor
    labels: torch.Tensor
    index: torch.Tensor
    positions: torch.Tensor


@torch.no_grad()
def sharded_forward(model: nn.Module, batch: Batch, mesh: Mesh, device: torch.device, *,
                    amp_dtype: torch.dtype | None = None, doc_mask: str = "off",
                    position_reset: bool = True, chunk_order: str = "zigzag",
                    sliding_window: int | None = None) -> LocalTokens:
    """Forward ``batch`` (full sequences ``[B, S]``) on this rank's shard; see the module docstring.
    ``chunk_order`` and ``sliding_window``: the run's ``--chunk-order`` and the model's window (they choose
    the balanced order). Collective over the replica (the model's attention communication)."""
    seq_len = batch["input_ids"].shape[1]
    cu_seqlens, positions = batch_documents(batch, doc_mask, position_reset)
    order = batch_chunk_order(cu_seqlens, seq_len, mesh, chunk_order, sliding_window)

    def local(x: torch.Tensor) -> torch.Tensor:
        return shard_sequence(x, mesh, dim=1, chunk_order=order).to(device)

    input_ids, labels, position_ids = local(batch["input_ids"]), local(batch["labels"]), local(positions)
    autocast = (torch.autocast(device.type, dtype=amp_dtype) if amp_dtype is not None
                else contextlib.nullcontext())
    with autocast:
        hidden, head = hidden_and_head(model, input_ids, position_ids, cu_seqlens, order)
    index = shard_indices(seq_len, mesh.hp, mesh.cp, mesh.cp_rank, mesh.hp_rank, order).to(device)
    return LocalTokens(hidden, head, labels, index, position_ids)


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """``x`` summed over every rank (in place; identity without torch.distributed). Forward only:
    one all-reduce (sum) over the default group."""
    if is_distributed() and dist.get_world_size() > 1:
        dist.all_reduce(x)
    return x


def replica_items(count: int, mesh: Mesh) -> list[int | None]:
    """The work items (prompts, documents) of this dp replica: ``i`` with ``i % dp == dp_rank``, padded
    with None so every replica runs the same number of forwards (FSDP2 gathers over all ranks)."""
    return [group[0] if group else None for group in replica_batches(list(range(count)), 1, mesh)]


def replica_batches(items: list[int], rows: int, mesh: Mesh) -> list[list[int]]:
    """This dp replica's share of ``items`` (every ``dp``-th, as :func:`replica_items`) in batches of at most
    ``rows``; every replica gets the same number of batches, an empty one where it has run out (it runs a
    padding forward: FSDP2 gathers over all ranks)."""
    if rows < 1:
        raise ValueError(f"rows={rows} must be a positive integer")
    mine = items[mesh.dp_rank::mesh.dp]
    per_replica = -(-len(items) // mesh.dp)
    rounds = -(-per_replica // rows)
    return [mine[r * rows:(r + 1) * rows] for r in range(rounds)]
