"""The post-training objectives' hooks in the trainer (``--objective sft|dpo``, docs/post-training.md).

The trainer keeps its step (micro-batches, backward of ``loss / micro_batches``, the gradients averaged
over dp, the loss values averaged over micro-batches and dp replicas); an :class:`Objective` changes only
what one micro-batch's loss is:

- :meth:`Objective.begin_step` counts the step's targets (SFT: target tokens, DPO: pairs) from its
  full-sequence micro-batches on the host and, with ``dp > 1``, all-reduces the count over the data-parallel
  ranks (one all-reduce of one value per step), before any forward; it returns False for a step without
  targets (the trainer skips it with a message);
- :meth:`Objective.loss` is the micro-batch's ``(loss_for_backward, value)`` scaled so that the trainer's
  averaging yields the mean over the step's targets (loongtrain/loss/sft.py, loongtrain/loss/dpo.py);
- :meth:`Objective.metrics` adds the step's own metrics to its record (``targets``; DPO: ``pairs`` and
  TRL's ``rewards/*``);
- :meth:`Objective.validation_loss`: the same mean over every target of the validation batches.

Pretraining (``--objective pretrain``) has no objective: the trainer's own chunked cross-entropy, as always.
The objective does not depend on how parameters are made trainable: it only differentiates the loss.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from loongtrain.data.conversations import SFT
from loongtrain.data.post_training import PostTrainingBatches, PostTrainingReader
from loongtrain.data.preference import DPO
from loongtrain.data.tokenizer import Tokenizer
from loongtrain.loss.chunked import FinalNorm
from loongtrain.loss.dpo import REWARD_METRICS, dpo_loss, sequence_logps
from loongtrain.loss.sft import sft_loss, step_scale, target_count
from loongtrain.loss.token_logprobs import chunked_token_logprobs
from loongtrain.parallel.mesh import Mesh
from loongtrain.parallel.runtime import to_device
from loongtrain.train.batch import Batch, LocalBatch
from loongtrain.train.validation import forward_only

log = logging.getLogger("loongtrain.train")
Tensor = torch.Tensor


def dp_sum(values: Sequence[float], mesh: Mesh, device: torch.device) -> list[float]:
    """``values`` summed over the data-parallel replicas (host numbers). Communication: one all-reduce (sum)
    of ``len(values)`` float64 values over ``mesh.dp_group`` when ``dp > 1``, read back to the host."""
    if mesh.dp == 1:
        return [float(v) for v in values]
    both = to_device(torch.tensor(list(values), dtype=torch.float64), device)
    dist.all_reduce(both, group=mesh.dp_group)
    return both.tolist()


class Objective:
    """SFT (this class) and DPO (:class:`DPOObjective`): module docstring."""

    name = SFT
    unit = "target tokens"

    def __init__(self, mesh: Mesh, device: torch.device) -> None:
        self.mesh, self.device = mesh, device
        self.scale, self.count = 0.0, 0.0

    def targets(self, batches: Sequence[Batch]) -> int:
        """The targets of full-sequence batches (this replica's; host values)."""
        return target_count([b["labels"] for b in batches])

    def begin_step(self, micro_batches: Sequence[Batch], *, dp_reduce: bool = True) -> bool:
        """Count the step's targets (all replicas with ``dp_reduce``, else this replica's: a batch on its
        own) and set the micro-batches' scale; False when there are none."""
        local = self.targets(micro_batches)
        self.count = dp_sum([local], self.mesh, self.device)[0] if dp_reduce else float(local)
        dp = self.mesh.dp if dp_reduce else 1
        self.scale = step_scale(self.count, len(micro_batches), dp)
        self._begin()
        return self.count > 0

    def _begin(self) -> None:
        pass

    def prepare(self, stream: Any, start: int, end: int) -> None:
        """Before the first step of ``[start, end)`` (DPO: the reference's log-probabilities)."""

    def loss(self, local: LocalBatch, hidden: Tensor, head: Tensor, norm: FinalNorm | None) -> tuple[Tensor, Tensor]:
        """``(loss_for_backward, value)`` of this rank's shard of one micro-batch (module docstring)."""
        return sft_loss(hidden, head, local.labels, self.mesh, self.scale, norm=norm)

    def metrics(self) -> dict[str, float]:
        """The step's own metrics (collective for DPO: one all-reduce over dp)."""
        return {"targets": int(self.count)}

    def no_targets_message(self, step: int) -> str:
        return (f"step {step}: no {self.unit} in any of its sequences (every label is a prompt or padding); the "
                f"step is skipped (no update; the learning-rate schedule advances)")

    def validation_loss(self, trainer: Any, batches: Sequence[Batch]) -> float:
        """The mean over every target of ``batches`` (this replica's; all replicas' together), forward only
        under the run's layout and loss; identical on every rank (collective). NaN with a warning when the
        validation batches hold no target."""
        with forward_only(trainer.model):
            if not self.begin_step(batches):
                log.warning("the validation batches hold no %s: val_loss is NaN", self.unit)
                return float("nan")
            total = sum(trainer.local_loss(trainer.sharding.local(b))[1].detach().to(torch.float64) for b in batches)
        return dp_sum([float(total) / len(batches)], self.mesh, self.device)[0] / self.mesh.dp


class DPOObjective(Objective):
    """``--objective dpo``: the reference's log-probabilities come from :class:`~loongtrain.train.reference.
    Reference` (computed before training and cached), or from a batch's own ``ref_logps [B, 2 * max_pairs]``."""

    name = DPO
    unit = "preference pairs"

    def __init__(self, mesh: Mesh, device: torch.device, beta: float, reference: Any = None) -> None:
        super().__init__(mesh, device)
        self.beta, self.reference = beta, reference
        self._stats: Tensor | None = None

    def targets(self, batches: Sequence[Batch]) -> int:
        return sum(sum(b["num_pairs"].tolist()) for b in batches)

    def begin_step(self, micro_batches: Sequence[Batch], *, dp_reduce: bool = True) -> bool:
        if self.reference is not None:
            self.reference.ensure(list(micro_batches))
        return super().begin_step(micro_batches, dp_reduce=dp_reduce)

    def _begin(self) -> None:
        self._stats = None

    def prepare(self, stream: Any, start: int, end: int) -> None:
        if self.reference is not None:
            self.reference.prepare(stream, start, end)

    def loss(self, local: LocalBatch, hidden: Tensor, head: Tensor, norm: FinalNorm | None) -> tuple[Tensor, Tensor]:
        num_pairs = local.extras["num_pairs"]
        sequences = 2 * max(num_pairs.tolist())  # host values (tolist: also under fake tensors)
        token_logps = chunked_token_logprobs(hidden, head, local.labels, norm=norm)
        policy = sequence_logps(token_logps, local.extras["segment"], sequences, self.mesh)
        reference = self.reference_logps(local.extras, sequences).to(policy.device)
        loss, value, stats = dpo_loss(policy, reference, num_pairs, self.beta, self.scale)
        self._stats = stats if self._stats is None else self._stats + stats
        return loss, value

    def reference_logps(self, extras: dict[str, Tensor], sequences: int) -> Tensor:
        """``[B, sequences]``: the batch's own ``ref_logps``, else the reference's cached values by ``ref_key``."""
        if "ref_logps" in extras:
            return extras["ref_logps"][:, :sequences]
        assert self.reference is not None, "a DPO batch without ref_logps needs the run's reference"
        return self.reference.lookup(extras["ref_key"], extras["num_pairs"], sequences)

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {"pairs": int(self.count)}
        if self._stats is None or not self.count:
            return out
        sums = dp_sum(self._stats.tolist(), self.mesh, self.device)
        out.update({name: value / self.count for name, value in zip(REWARD_METRICS, sums)})
        return out


def post_training_batches(cfg: Any, tokenizer: Tokenizer, mesh: Mesh, start_micro_step: int) -> PostTrainingBatches:
    """This replica's batches of the run's conversations or pairs (:class:`~loongtrain.data.post_training.
    PostTrainingReader`)."""
    return PostTrainingReader.of(cfg, tokenizer).batches(cfg.corpus, cfg.batch_size, mesh.dp_rank, mesh.dp,
                                                         start_micro_step, val_fraction=cfg.val_fraction)


def build_objective(trainer: Any) -> Objective | None:
    """The run's objective (None for ``--objective pretrain``); DPO's reference is built by
    :meth:`~loongtrain.train.reference.Reference.prepare` when the run starts."""
    cfg = trainer.cfg
    if cfg.objective == SFT:
        return Objective(trainer.mesh, trainer.device)
    if cfg.objective == DPO:
        from loongtrain.train.reference import Reference

        return DPOObjective(trainer.mesh, trainer.device, cfg.dpo_beta, Reference(trainer))
    return None
