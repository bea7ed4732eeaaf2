"""Validation during training (``--val-interval N --val-batches K``, docs/evaluation.md).

- :func:`validation_loss`: the mean loss of K full-sequence batches, forward only under
  ``torch.no_grad()`` (no activations kept, no checkpoint recompute), with the run's own layout and loss
  (the trainer's ``loss``: sharding, documents, chunk order, autocast, the chunked cross-entropy), averaged
  over the dp replicas. It touches no optimizer or scheduler state, no gradient, no data position of the
  training stream, and restores the torch RNG states afterwards, so a run with validation trains bit for
  bit like one without (tests/unit/test_validation.py).
- :func:`validation_batches` (pretraining's; an objective reads its own: ``Objective.validation_batches``):
  with ``--val-fraction`` or ``--val-corpus``, the first K batches of the
  held-out data (:func:`loongtrain.data.validation.build_val_batches`: documents the training stream never
  contains); without either, :func:`tail_batches`: the LAST ``K * dp * batch_size`` packed samples of the
  corpus (of each corpus of a mixture, its share), replica ``d`` taking its own rows. The training stream
  samples the whole corpus, so that tail is held out of nothing: it measures the same distribution, not
  unseen text (a corpus shorter than the tail wraps around; the launcher's preflight warns once:
  :func:`check_validation`).
- :class:`Validation`: the training loop's hook, ``record.update(validation.after_step(step, stage_cfg))``:
  the validation loss and the in-loop evaluations (:class:`Evaluation`: callables the launch path builds
  from ``loongtrain.eval``'s tasks, ``--eval-tasks``; run under :func:`forward_only` like the loss).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from loongtrain.data.tokenizer import Tokenizer
from loongtrain.parallel.mesh import Mesh
from loongtrain.sections.stages import run_stages
from loongtrain.train import model_setup
from loongtrain.train.checkpoint import rng_state, set_rng_state
from loongtrain.train.config import TrainSections
from loongtrain.train.step_context import StepContext

Batch = dict[str, torch.Tensor]
#: ``batch -> (loss_for_backward, replica loss value)``, e.g. ``Trainer.loss``
LossFn = Callable[[Batch], tuple[torch.Tensor, torch.Tensor]]


def validation_batches(cfg: TrainSections, mesh: Mesh, count: int) -> list[Batch]:
    """This replica's ``count`` validation batches of a text corpus (fewer when the held-out data has fewer): the
    held-out split when the run has one, else the corpus's tail (module docstring)."""
    data = cfg.data
    if not (data.val_fraction or data.val_corpus):
        return tail_batches(cfg, mesh, count)
    from loongtrain.data.validation import build_val_batches

    held_out = build_val_batches(data, model_setup.tokenizer_spec(cfg.model), cfg.optim.seed, dp_rank=mesh.dp_rank,
                                 dp=mesh.dp)
    return list(itertools.islice(held_out, count))


def validation_warnings(cfg: TrainSections) -> list[str]:
    """The launcher's checks of ``--val-interval`` and ``--val-corpus`` that need no data, whatever the objective:
    validation that never runs, ``--val-corpus`` equal to ``--corpus``."""
    evaluation, data = cfg.evaluation, cfg.data
    warnings = []
    if data.val_corpus and not evaluation.val_interval:
        warnings.append(f"--val-corpus {data.val_corpus!r} without --val-interval: the run never validates")
    if not evaluation.val_interval:
        return warnings
    if evaluation.val_interval > cfg.optim.steps:
        warnings.append(f"--val-interval {evaluation.val_interval} is longer than the run (--steps "
                        f"{cfg.optim.steps}): the run never validates")
    if data.val_corpus and _same_corpus(data.val_corpus, data.corpus):
        warnings.append(f"--val-corpus {data.val_corpus!r} is the training corpus: val_loss measures data the run "
                        f"trains on, not held-out text (--val-fraction holds documents out)")
    return warnings


def check_validation(cfg: TrainSections, world: int, tokenizer: Tokenizer) -> list[str]:
    """The launcher's checks of a text corpus's validation before any worker starts, at every stage's length and
    batch (``--seq-len-stages``): :func:`validation_warnings`, then a ValueError where the run cannot validate as
    asked (held-out data smaller than one global batch), else the one-line warnings where it can:
    ``--val-batches`` more than the held-out data holds (then fewer are used) or than the corpus's tail (then
    samples repeat). Reads at most ``--val-batches`` global batches of each corpus's validation stream (a
    prepared corpus: its document index only)."""
    warnings = validation_warnings(cfg)
    if not cfg.evaluation.val_interval:
        return warnings
    shapes = dict.fromkeys((s.seq_len, s.batch_size) for s in run_stages(cfg.data, cfg.optim.steps))
    for seq_len, batch_size in shapes:
        warnings += _check_sizes(cfg.replace(seq_len=seq_len, batch_size=batch_size), world, tokenizer)
    return warnings


def _check_sizes(cfg: TrainSections, world: int, tokenizer: Tokenizer) -> list[str]:
    """:func:`check_validation`'s size checks at ``cfg``'s ``seq_len`` and ``batch_size``."""
    data = cfg.data
    dp, want = max(1, world // cfg.parallel.sp), cfg.evaluation.val_batches
    if data.val_fraction or data.val_corpus:
        from loongtrain.data.validation import count_val_batches

        have = count_val_batches(data, tokenizer, dp, want, seed=cfg.optim.seed)
        if have >= want:
            return []
        return [f"--val-batches {want}: the held-out data holds {have} batch(es) of dp {dp} x --batch-size "
                f"{data.batch_size} sequences of --seq-len {data.seq_len}; validating on {have}"]
    from loongtrain.data.sources import open_stream, parse_corpus_spec

    warnings = []
    parts = [name for name, _ in parse_corpus_spec(data.corpus)]
    for c, name in enumerate(parts):
        need = (want // len(parts) + (c < want % len(parts))) * dp * data.batch_size
        stream = open_stream(name, tokenizer, decode_errors=data.decode_errors)
        have = max(stream.ensure(need * data.seq_len + 1) - 1, 0) // data.seq_len
        if need > have:
            warnings.append(f"--val-batches {want} x dp {dp} x --batch-size {data.batch_size}: {need} validation "
                            f"sequences from the tail of {name!r}, which holds {have} of --seq-len {data.seq_len}: "
                            f"the validation set repeats samples")
    return warnings


def _same_corpus(a: str, b: str) -> bool:
    from loongtrain.data.sources import corpus_key, parse_corpus_spec

    def paths(spec: str) -> set[str]:
        return {corpus_key(n) for n, _ in parse_corpus_spec(spec)}

    return bool(paths(a) & paths(b))


def tail_batches(cfg: TrainSections, mesh: Mesh, count: int) -> list[Batch]:
    """This replica's ``count`` validation batches (``[batch_size, seq_len]`` each) from the corpus's tail,
    read like the training data (:func:`loongtrain.data.sources.open_stream`: raw or prepared).

    The last ``count * dp * batch_size`` packed samples; batch ``k`` of replica ``d`` holds samples
    ``first + (k * dp + d) * batch_size + b``. A mixture's corpora each give their share of the ``count``
    batches, in the order given (``count // n`` each, the first ``count % n`` one more). A raw corpus is
    tokenized whole (once, at start-up)."""
    from loongtrain import data
    from loongtrain.data.sources import open_stream, parse_corpus_spec

    options = cfg.data
    tokenizer = data.build_tokenizer(model_setup.tokenizer_spec(cfg.model))
    parts = [name for name, _ in parse_corpus_spec(options.corpus)]
    batches = []
    for c, name in enumerate(parts):
        share = count // len(parts) + (c < count % len(parts))
        if not share:
            continue
        stream = open_stream(name, tokenizer, decode_errors=options.decode_errors)
        dataset = data.PackedDataset(stream, options.seq_len)
        available = dataset.num_samples()
        first = available - share * mesh.dp * options.batch_size
        for k in range(share):
            lo = first + (k * mesh.dp + mesh.dp_rank) * options.batch_size
            rows = [dataset[(lo + b) % available] for b in range(options.batch_size)]
            batches.append({key: torch.stack([row[key] for row in rows]) for key in rows[0]})
    return batches


def validation_loss(loss_fn: LossFn, model: nn.Module, batches: Sequence[Batch], mesh: Mesh) -> float:
    """Mean replica loss of ``batches`` (this replica's), averaged over the dp replicas; identical on every
    rank. Forward only (:func:`forward_only`). Collective over the replica (the loss's all-reduce) and over
    ``mesh.dp_group`` (one all-reduce of one scalar)."""
    if not batches:
        raise ValueError("validation_loss needs at least one batch")
    with forward_only(model):
        total = sum(loss_fn(batch)[1].detach().to(torch.float64) for batch in batches)
    mean = total / len(batches)
    if mesh.dp > 1:
        dist.all_reduce(mean, group=mesh.dp_group)
        mean = mean / mesh.dp
    return float(mean)


@contextlib.contextmanager
def forward_only(model: nn.Module) -> Iterator[None]:
    """A forward that leaves no trace on training: ``torch.no_grad()``, the model in eval mode (its mode
    restored after), the torch RNG states saved and restored, and FSDP2's gathered root weights freed."""
    saved_rng, training = rng_state(), model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(training)
        set_rng_state(saved_rng)
        _reshard(model)


def _reshard(model: nn.Module) -> None:
    """FSDP2 keeps the root's weights gathered after a forward (freed by the backward): free them now, so
    the next training step starts from the state it would have without validation."""
    reshard = getattr(model, "reshard", None)
    if callable(reshard):
        reshard()


class Evaluation(Protocol):
    """An in-loop evaluation (``--eval-tasks``): called on every rank with the training model, its mesh and
    device and the trainer's autocast dtype, forward only (collective); returns the metrics it adds to the
    step's record (e.g. ``{"eval/passkey/4K": 0.8}``). ``train`` defines the call; the launch path builds
    the evaluations from ``loongtrain.eval``'s tasks and hands them in (``Run.evaluations``)."""

    def __call__(self, model: nn.Module, mesh: Mesh, device: torch.device,
                 amp_dtype: torch.dtype | None) -> dict[str, float]: ...


class Validation:
    """The loop's hook: every ``cfg.evaluation.val_interval`` optimizer steps, ``{"val_loss": measure(batches)}``
    and the in-loop evaluations' metrics (else ``{}``), on the step context ``ctx``'s model, mesh, device and
    autocast. The validation batches are those of the stage being trained (``--seq-len-stages``: its length and
    batch), read by ``read(stage_cfg, count)`` (the objective's reader; default: :func:`validation_batches` of a
    text corpus): built once per stage, the first stage's at construction, and only when ``val_interval > 0``;
    ``batches`` replaces the first stage's (tests)."""

    def __init__(self, cfg: TrainSections, ctx: StepContext, measure: Callable[[Sequence[Batch]], float],
                 batches: Sequence[Batch] | None = None, *, evaluations: Sequence[Evaluation] = (),
                 read: Callable[[TrainSections, int], list[Batch]] | None = None) -> None:
        self.interval, self.count = cfg.evaluation.val_interval, cfg.evaluation.val_batches
        self.ctx, self.measure, self.evaluations = ctx, measure, tuple(evaluations)
        self.read = read or (lambda stage_cfg, count: validation_batches(stage_cfg, ctx.mesh, count))
        self._batches: dict[tuple[int, int], list[Batch]] = {}
        if batches is not None:
            self._batches[_shape(cfg)] = list(batches)
        elif self.interval:
            self.batches(cfg)

    def batches(self, cfg: TrainSections) -> list[Batch]:
        """This replica's validation batches at ``cfg``'s ``seq_len`` and ``batch_size`` (built once)."""
        if _shape(cfg) not in self._batches:
            self._batches[_shape(cfg)] = self.read(cfg, self.count)
        return self._batches[_shape(cfg)]

    def due(self, step: int) -> bool:
        """Whether validation runs after optimizer step ``step`` (1-based)."""
        return bool(self.interval) and step % self.interval == 0

    def after_step(self, step: int, cfg: TrainSections) -> dict[str, float]:
        """After optimizer step ``step`` (1-based) of a stage run with ``cfg``: ``{"val_loss": loss, ...}``
        and every evaluation's metrics when it is due, else ``{}``."""
        if not self.due(step):
            return {}
        out = {"val_loss": self.measure(self.batches(cfg))}
        ctx = self.ctx
        for evaluation in self.evaluations:
            with forward_only(ctx.model):
                out.update(evaluation(ctx.model, ctx.mesh, ctx.device, ctx.amp_dtype))
        return out


def _shape(cfg: TrainSections) -> tuple[int, int]:
    return cfg.data.seq_len, cfg.data.batch_size
