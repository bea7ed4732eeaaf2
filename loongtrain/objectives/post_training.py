"""What the post-training objectives share (``--objective sft``, ``--objective dpo``; docs/post-training.md): the
chat options, rows of whole units packed as documents (their reader: a
:class:`~loongtrain.data.post_training.PostTrainingReader`), the mean over the step's targets, and the checks
that go with them.

:class:`TargetsObjective` keeps the trainer's step (micro-batches, backward of ``loss / micro_batches``, the
gradients averaged over dp, the loss values averaged over micro-batches and dp replicas) and changes what a
micro-batch's loss is: :meth:`~TargetsObjective.count_targets` counts the step's targets (SFT: target tokens, DPO:
pairs) from its full-sequence micro-batches on the host and, with ``dp > 1``, all-reduces the count over the
data-parallel ranks (one all-reduce of one value per step) before any forward, False for a step without targets
(the trainer skips it with a message); the loss of a micro-batch is scaled so that the trainer's averaging yields
the mean over the step's targets (loongtrain/loss/sft.py, loongtrain/loss/dpo.py); ``metrics`` adds ``targets``;
``validation_loss`` is the same mean over every target of the validation batches.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from loongtrain.data.post_training import PostTrainingReader
from loongtrain.data.tokenizer import Tokenizer
from loongtrain.loss.sft import step_scale, target_count
from loongtrain.objectives.base import LossObjective, ObjectiveSpec, TrainConfig
from loongtrain.parallel.mesh import Mesh
from loongtrain.parallel.runtime import to_device
from loongtrain.train.batch import Batch
from loongtrain.train.config import TrainSections
from loongtrain.train.model_setup import tokenizer_spec
from loongtrain.train.validation import forward_only, validation_warnings

Tensor = torch.Tensor


def dp_sum(values: Sequence[float], mesh: Mesh, device: torch.device) -> list[float]:
    """``values`` summed over the data-parallel replicas (host numbers). Communication: one all-reduce (sum)
    of ``len(values)`` float64 values over ``mesh.dp_group`` when ``dp > 1``, read back to the host."""
    if mesh.dp == 1:
        return [float(v) for v in values]
    both = to_device(torch.tensor(list(values), dtype=torch.float64), device)
    dist.all_reduce(both, group=mesh.dp_group)
    return both.tolist()


class TargetsObjective(LossObjective):
    """An objective of rows of whole units, averaged over the step's targets (module docstring). ``reader``: the
    :class:`~loongtrain.data.post_training.PostTrainingReader` of a run's options at a stage's length."""

    unit = "target tokens"

    def __init__(self, ctx: Any, run: Any, reader: Any) -> None:
        super().__init__(ctx, run)
        self.reader = reader
        self.scale, self.count = 0.0, 0.0

    def _reader(self, cfg: TrainSections) -> PostTrainingReader:
        tokenizer = self.run.tokenizer
        if tokenizer is None:
            from loongtrain.data import build_tokenizer

            tokenizer = build_tokenizer(tokenizer_spec(cfg.model))
        return self.reader(cfg, tokenizer)

    def batches(self, cfg: TrainSections, start_micro_step: int) -> Iterator[Batch]:
        mesh, data = self.ctx.mesh, cfg.data
        return self._reader(cfg).batches(data.corpus, data.batch_size, mesh.dp_rank, mesh.dp, start_micro_step,
                                         val_fraction=data.val_fraction)

    def validation_batches(self, cfg: TrainSections, count: int) -> list[Batch]:
        mesh, data = self.ctx.mesh, cfg.data
        return self._reader(cfg).validation_batches(data.corpus, data.val_corpus, data.val_fraction, data.batch_size,
                                                    mesh.dp_rank, mesh.dp, count)

    def targets(self, batches: Sequence[Batch]) -> int:
        """The targets of full-sequence batches (this replica's; host values)."""
        return target_count([b["labels"] for b in batches])

    def count_targets(self, micro_batches: Sequence[Batch], *, dp_reduce: bool) -> bool:
        """Count the step's targets (all replicas with ``dp_reduce``, else this replica's: a batch on its own) and
        set the micro-batches' scale; False when there are none."""
        local = self.targets(micro_batches)
        mesh = self.ctx.mesh
        self.count = dp_sum([local], mesh, self.ctx.device)[0] if dp_reduce else float(local)
        self.scale = step_scale(self.count, len(micro_batches), mesh.dp if dp_reduce else 1)
        self.begin_counted()
        return self.count > 0

    def begin_counted(self) -> None:
        """After the step's targets are counted (DPO: its statistics start afresh)."""

    def metrics(self) -> dict[str, float]:
        return {"targets": int(self.count)}

    def validation_loss(self, batches: Sequence[Batch]) -> float:
        """The mean over every target of ``batches`` (this replica's; all replicas' together), forward only under
        the run's layout and loss; identical on every rank (collective). NaN with a warning when the validation
        batches hold no target."""
        import logging

        ctx = self.ctx
        with forward_only(ctx.model):
            if not self.begin_step(batches):
                logging.getLogger("loongtrain.train").warning("the validation batches hold no %s: val_loss is NaN",
                                                              self.unit)
                return float("nan")
            total = sum(self.loss(ctx.local(b))[1].detach().to(torch.float64) for b in batches)
        return dp_sum([float(total) / len(batches)], ctx.mesh, ctx.device)[0] / ctx.mesh.dp


class RowsSpec(ObjectiveSpec):
    """The registry entry of an objective of rows of whole units: documents need ``--doc-mask on
    --position-reset``; no seq-len stages; no position-loss evaluation (it measures plain text)."""

    counts_on_host = True

    def reader(self, cfg: Any, tokenizer: Tokenizer) -> PostTrainingReader:
        """The run's reader at ``cfg``'s length (its chat format, ``--on-long``, seed and decode rule)."""
        raise NotImplementedError

    def validate(self, cfg: TrainConfig) -> None:
        data = cfg.data
        if data.doc_mask != "on" or not data.position_reset:
            raise ValueError(f"--objective {self.name} packs conversations and pairs as documents: it needs "
                             f"--doc-mask on and --position-reset (got --doc-mask {data.doc_mask}, --position-reset "
                             f"{data.position_reset})")
        if data.seq_len_stages:
            raise ValueError(f"--seq-len-stages applies to --objective pretrain, not --objective {self.name}")
        if "position-loss" in cfg.evaluation.tasks():
            raise ValueError(f"--eval-tasks position-loss measures plain text; with --objective {self.name} "
                             f"use --eval-tasks passkey (and val_loss: --val-interval)")

    def check_data(self, cfg: TrainConfig, tokenizer: Tokenizer, world: int) -> tuple[list[str], list[str]]:
        """Its rows parse, encode and pack (:meth:`~loongtrain.data.post_training.PostTrainingReader.check`, the
        lines to log); the validation checks that need no data."""
        data = cfg.data
        try:
            lines = self.reader(cfg, tokenizer).check(data.corpus, data.val_corpus, data.val_fraction,
                                                      max(1, world // cfg.parallel.sp) * data.batch_size)
        except (OSError, ValueError) as exc:
            raise ValueError(f"--corpus {data.corpus!r}: {exc}" if data.corpus not in str(exc) else str(exc)) from None
        return lines, validation_warnings(cfg)

    def identity(self, cfg: TrainConfig, tokenizer: Tokenizer) -> dict[str, Any]:
        """``"chat"``: the chat format's identity (its template's digest and target rule)."""
        chat = self.chat_format(tokenizer, cfg.objective)
        return {"chat": chat.identity() if chat is not None else None}
