"""Validation during training (``--val-interval N --val-batches K``, docs/design.md §14).

- :func:`validation_loss`: the mean loss of K full-sequence batches, forward only under
  ``torch.no_grad()`` (no activations kept, no checkpoint recompute), with the run's own layout and loss
  (the trainer's ``loss``: sharding, documents, chunk order, autocast, the chunked cross-entropy), averaged
  over the dp replicas. It touches no optimizer or scheduler state, no gradient, no data position of the
  training stream, and restores the torch RNG states afterwards, so a run with validation trains bit for
  bit like one without (tests/test_validation.py).
- :func:`validation_batches`: with ``--val-fraction`` or ``--val-corpus``, the first K batches of the
  held-out data (:func:`loongtrain.data.validation.build_val_batches`: documents the training stream never
  contains); without either, :func:`tail_batches`: the LAST ``K * dp * batch_size`` packed samples of the
  corpus, replica ``d`` taking its own rows. The training stream samples the whole corpus, so that tail
  is held out of nothing: it measures the same distribution, not unseen text (a corpus shorter than the
  tail wraps around, with one warning).
- :class:`Validation`: the training loop's hook, ``record.update(validation.after_step(step))``.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from loongtrain.parallel.mesh import Mesh
from loongtrain.train import run_model
from loongtrain.train.checkpoint import rng_state, set_rng_state
from loongtrain.train.config import TrainConfig

log = logging.getLogger("loongtrain.train")

Batch = dict[str, torch.Tensor]
#: ``batch -> (loss_for_backward, replica loss value)``, e.g. ``Trainer.loss``
LossFn = Callable[[Batch], tuple[torch.Tensor, torch.Tensor]]


def validation_batches(cfg: TrainConfig, mesh: Mesh, count: int) -> list[Batch]:
    """This replica's ``count`` validation batches (fewer when the held-out data has fewer): the held-out
    split when the run has one, else the corpus's tail (module docstring)."""
    if not (cfg.val_fraction or cfg.val_corpus):
        return tail_batches(cfg, mesh, count)
    from loongtrain.data.validation import build_val_batches

    held_out = build_val_batches(cfg.corpus, run_model.tokenizer_spec(cfg), cfg.seq_len, cfg.batch_size, mesh.dp_rank,
                                 mesh.dp, seed=cfg.seed, val_fraction=cfg.val_fraction, val_corpus=cfg.val_corpus)
    return list(itertools.islice(held_out, count))


def tail_batches(cfg: TrainConfig, mesh: Mesh, count: int) -> list[Batch]:
    """This replica's ``count`` validation batches (``[batch_size, seq_len]`` each) from the corpus's tail.

    The last ``count * dp * batch_size`` packed samples; batch ``k`` of replica ``d`` holds samples
    ``first + (k * dp + d) * batch_size + b``. Tokenizes the whole corpus (once, at start-up)."""
    from loongtrain import data

    tokenizer = data.build_tokenizer(run_model.tokenizer_spec(cfg))
    dataset = data.PackedDataset(data.TokenStream(data.build_corpus(cfg.corpus), tokenizer), cfg.seq_len)
    available = dataset.num_samples()
    need = count * mesh.dp * cfg.batch_size
    if need > available:
        log.warning("--val-batches %d x dp %d x --batch-size %d = %d validation sequences, but the corpus %r "
                    "holds %d of --seq-len %d: the validation set repeats samples", count, mesh.dp,
                    cfg.batch_size, need, cfg.corpus, available, cfg.seq_len)
    first = available - need
    batches = []
    for k in range(count):
        lo = first + (k * mesh.dp + mesh.dp_rank) * cfg.batch_size
        rows = [dataset[(lo + b) % available] for b in range(cfg.batch_size)]
        batches.append({key: torch.stack([row[key] for row in rows]) for key in rows[0]})
    return batches


def validation_loss(loss_fn: LossFn, model: nn.Module, batches: Sequence[Batch], mesh: Mesh) -> float:
    """Mean replica loss of ``batches`` (this replica's), averaged over the dp replicas; identical on every
    rank. Forward only: ``torch.no_grad()``, the model in eval mode for the call (then its mode restored),
    the torch RNG states saved and restored. Collective over the replica (the loss's all-reduce) and over
    ``mesh.dp_group`` (one all-reduce of one scalar)."""
    if not batches:
        raise ValueError("validation_loss needs at least one batch")
    saved_rng, training = rng_state(), model.training
    model.eval()
    try:
        with torch.no_grad():
            total = sum(loss_fn(batch)[1].detach().to(torch.float64) for batch in batches)
    finally:
        model.train(training)
        set_rng_state(saved_rng)
        _reshard(model)
    mean = total / len(batches)
    if mesh.dp > 1:
        dist.all_reduce(mean, group=mesh.dp_group)
        mean = mean / mesh.dp
    return float(mean)


def _reshard(model: nn.Module) -> None:
    """FSDP2 keeps the root's weights gathered after a forward (freed by the backward): free them now, so
    the next training step starts from the state it would have without validation."""
    reshard = getattr(model, "reshard", None)
    if callable(reshard):
        reshard()


class Validation:
    """The loop's hook: every ``cfg.val_interval`` optimizer steps, ``{"val_loss": ...}`` (else ``{}``).
    The batches are built once, at construction, and only when ``val_interval > 0``."""

    def __init__(self, cfg: TrainConfig, mesh: Mesh, loss_fn: LossFn, model: nn.Module,
                 batches: Sequence[Batch] | None = None) -> None:
        self.interval, self.mesh, self.loss_fn, self.model = cfg.val_interval, mesh, loss_fn, model
        self.batches = list(batches) if batches is not None else (
            validation_batches(cfg, mesh, cfg.val_batches) if self.interval else [])

    def after_step(self, step: int) -> dict[str, float]:
        """``{"val_loss": loss}`` after optimizer step ``step`` (1-based) when it is due, else ``{}``."""
        if not self.interval or step % self.interval:
            return {}
        return {"val_loss": validation_loss(self.loss_fn, self.model, self.batches, self.mesh)}
