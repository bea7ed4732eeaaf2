"""One optimizer step of a 2D-Attention model: sharded forward/backward, gradient sync, clip, AdamW."""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from loongtrain.hf.build import (
    build_hf_model,
    build_hf_model_on_meta,
    hf_initial_weights,
    hf_weight_files,
    restore_hf_buffers,
)
from loongtrain.loss.chunked import chunked_cross_entropy
from loongtrain.model.config import ModelConfig
from loongtrain.model.llama import Transformer, initial_weight
from loongtrain.parallel.documents import (
    Documents,
    cu_seqlens_from_starts,
    document_position_ids,
    visible_pairs,
)
from loongtrain.parallel.mesh import Mesh
from loongtrain.parallel.sharding import shard_sequence
from loongtrain.train.compile import compile_enabled
from loongtrain.train.config import TrainConfig, autocast_dtype, param_dtype
from loongtrain.train.models import hf_model_dir, hidden_and_head
from loongtrain.train.optim import build_optimizer, clip_grad_norm
from loongtrain.train.parallelize import materialize_params, parallelize, uses_fsdp
from loongtrain.train.sync import all_reduce_gradients, needs_grad_sync

Batch = dict[str, torch.Tensor]


def build_model(model_config: ModelConfig, cfg: TrainConfig, mesh: Mesh, device: torch.device,
                fsdp_param_dtype: torch.dtype | None = None) -> nn.Module:
    """The seeded :class:`Transformer`, parallelized. Under FSDP2 it is built on the meta device,
    sharded, and each rank fills its shards from the parameters' full initial values (one parameter at
    a time, on CPU): no rank holds the whole model, and the weights equal ``Transformer(seed=cfg.seed)``
    bit for bit. ``fsdp_param_dtype``: FSDP2's gathered-weight dtype. A Hugging Face model directory
    (``--model DIR``) with weight files is sharded the same way, each shard read from the files one
    tensor at a time; without FSDP2, or without weight files (a seeded init from the config), it is
    built whole on CPU and then parallelized."""
    directory = hf_model_dir(cfg.model)
    compiled = compile_enabled(cfg.compile, device)  # --compile: docs/design.md §12
    if directory is not None:
        if not (uses_fsdp(cfg.parallel) and hf_weight_files(directory)):
            model = build_hf_model(directory, param_dtype(cfg), cfg.seed)
            return parallelize(model, mesh, cfg.parallel, device, compile=compiled)
        model = build_hf_model_on_meta(directory, param_dtype(cfg))
        model = parallelize(model, mesh, cfg.parallel, device, param_dtype=fsdp_param_dtype, compile=compiled)
        materialize_params(model, hf_initial_weights(directory))
        restore_hf_buffers(model)
        return model
    if not uses_fsdp(cfg.parallel):
        model = Transformer(model_config, seed=cfg.seed).to(param_dtype(cfg))
        return parallelize(model, mesh, cfg.parallel, device, compile=compiled)
    with torch.device("meta"):
        model = Transformer(model_config, seed=None).to(param_dtype(cfg))
    model = parallelize(model, mesh, cfg.parallel, device, param_dtype=fsdp_param_dtype, compile=compiled)
    materialize_params(model, lambda name, shape: initial_weight(name, shape, cfg.seed))
    return model


class Trainer:
    """Model, optimizer and schedule of one rank, and :meth:`step` (one optimizer step).

    ``step`` takes ``grad_accum`` micro-batches of this replica's *full* sequences
    (``input_ids``, ``labels``, ``position_ids`` of shape ``[batch, seq_len]``); each rank keeps its
    2D zigzag shard (:func:`loongtrain.shard_sequence`), so the trainer is layout-agnostic.
    """

    def __init__(self, cfg: TrainConfig, mesh: Mesh, device: torch.device,
                 model_config: ModelConfig) -> None:
        self.cfg, self.mesh, self.device = cfg, mesh, device
        self.model_config = model_config  # the shape (FLOPs, memory prediction); an HF model keeps its own config
        compute = autocast_dtype(cfg, device)
        sharded = uses_fsdp(cfg.parallel)
        self.model: nn.Module = build_model(model_config, cfg, mesh, device, compute if sharded else None)
        self.params = [p for _, p in sorted(self.model.named_parameters(), key=lambda kv: kv[0])]
        self.grad_sync = needs_grad_sync(self.model)
        self.optimizer, self.scheduler = build_optimizer(self.model, cfg)
        self.amp_dtype = None if sharded else compute  # FSDP2 casts the weights: no autocast (see above)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def _local(self, x: torch.Tensor, chunk_order: tuple[int, ...] | None) -> torch.Tensor:
        return shard_sequence(x, self.mesh, dim=1, chunk_order=chunk_order).to(self.device, non_blocking=True)

    def loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss_for_backward, loss_value)`` of one full-sequence micro-batch on this rank's shard: the
        forward to the final hidden states, then the chunked cross-entropy through the LM head (no rank
        holds its logits; :func:`~loongtrain.loss.chunked.chunked_cross_entropy`'s contract).
        Tokens, labels and positions are sharded with one layout (:meth:`chunk_order`)."""
        cu_seqlens, positions = self.documents(batch)
        order = self.chunk_order(cu_seqlens, batch["input_ids"].shape[1])
        input_ids, labels = self._local(batch["input_ids"], order), self._local(batch["labels"], order)
        position_ids = self._local(positions, order)
        with self._autocast():
            hidden, head = hidden_and_head(self.model, input_ids, position_ids, cu_seqlens, order)
            return chunked_cross_entropy(hidden, head, labels, self.mesh)

    def chunk_order(self, cu_seqlens: list[torch.Tensor] | None, seq_len: int) -> tuple[int, ...] | None:
        """The batch's sequence layout: ``None`` (zigzag), or with ``--chunk-layout balanced``, documents and
        ``cp > 1`` the :func:`~loongtrain.parallel.documents.balanced_chunk_order` of its documents (every
        rank of the replica computes the same one from the same batch)."""
        if cu_seqlens is None or self.mesh.cp == 1:
            return None
        documents = Documents(tuple(tuple(cu.tolist()) for cu in cu_seqlens), self.cfg.chunk_layout)
        window = getattr(self.model_config, "sliding_window", 0) or None
        return documents.chunk_order(seq_len, self.mesh.cp, self.mesh.hp, window)

    def documents(self, batch: Batch) -> tuple[list[torch.Tensor] | None, torch.Tensor]:
        """``(cu_seqlens, full position_ids)`` of a full-sequence batch: with ``--doc-mask on`` and a batch
        that marks its documents (``doc_starts``, packed corpora) the documents' boundaries and, with
        ``--position-reset``, positions restarting per document; else ``(None, batch["position_ids"])``."""
        if self.cfg.doc_mask != "on" or "doc_starts" not in batch:
            return None, batch["position_ids"]
        cu_seqlens = cu_seqlens_from_starts(batch["doc_starts"])
        if not self.cfg.position_reset:
            return cu_seqlens, batch["position_ids"]
        return cu_seqlens, document_position_ids(cu_seqlens, batch["input_ids"].shape[1])

    def visible_pairs(self, batch: Batch) -> int:
        """Attention (query, key) pairs the batch's rows compute (per layer and head), for FLOP counts."""
        cu_seqlens, _ = self.documents(batch)
        rows, seq = batch["input_ids"].shape
        window = getattr(self.model_config, "sliding_window", 0) or None
        return sum(visible_pairs(cu_seqlens[b] if cu_seqlens is not None else None, seq, sliding_window=window)
                   for b in range(rows))

    def step(self, micro_batches: list[Batch]) -> dict[str, Any]:
        """Forward/backward every micro-batch, synchronise and clip gradients, apply AdamW.

        Returns ``loss`` (mean over micro-batches and dp replicas, identical on every rank),
        ``grad_norm`` (before clipping), ``lr`` (the rate used for this step), ``skipped`` (1 when the
        loss or gradient norm was NaN/inf: the optimizer did not update, every rank alike) and
        ``attention_pairs`` (visible (query, key) pairs of all replicas' rows, per layer and head: the
        attention work that FLOP counts use).
        """
        assert len(micro_batches) == self.cfg.grad_accum
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for batch in micro_batches:
            loss, value = self.loss(batch)
            (loss / len(micro_batches)).backward()
            loss_sum += value.detach().to(torch.float64)
        if self.grad_sync:
            all_reduce_gradients(self.params, self.mesh.dp)
        grad_norm = clip_grad_norm(self.params, self.cfg.clip)
        lr = self.optimizer.param_groups[0]["lr"]
        loss_value = loss_sum / len(micro_batches)
        pairs = torch.tensor(float(sum(self.visible_pairs(b) for b in micro_batches)), dtype=torch.float64,
                             device=self.device)
        if self.mesh.dp > 1:  # one all-reduce for the loss and the replicas' attention pairs
            both = torch.stack([loss_value, pairs])
            dist.all_reduce(both, group=self.mesh.dp_group)
            loss_value, pairs = both[0] / self.mesh.dp, both[1]
        # the loss is dp-reduced and the norm is of synchronised gradients: every rank decides alike
        skipped = not (math.isfinite(float(loss_value)) and math.isfinite(grad_norm))
        if skipped:
            self.optimizer.zero_grad(set_to_none=True)  # no update; the schedule still advances
        else:
            self.optimizer.step()
        self.scheduler.step()
        return {"loss": float(loss_value), "grad_norm": grad_norm, "lr": float(lr), "skipped": int(skipped),
                "attention_pairs": int(pairs)}
