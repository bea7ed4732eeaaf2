"""DPO's reference model (``--ref-model``, docs/post-training.md#the-reference): its log-probabilities are
computed once, before training, and cached; the model is then released.

The reference is the policy's initial weights (the run's ``--model``, or ``--init-from``'s weights), or
``--ref-model``: a loongtrain run or checkpoint of the same model, or a Hugging Face directory of the
policy's architecture and vocabulary (:func:`check_reference`, before any worker starts). It is built and
sharded like the policy (the run's layout, ZeRO and compute dtype: :func:`~loongtrain.train.model_setup.
build_model`), frozen (it runs only forward, under ``torch.no_grad``), and :meth:`Reference.prepare` computes the summed
completion log-probabilities of every row the run trains on (its sampler's rows for its steps) and every
validation row, one row at a time (so a row's values do not depend on the rows it is batched with: a
resume recomputes them bit for bit), keyed by the row's ``ref_key``. On a fresh start with the default
reference the policy itself is the reference (it holds its initial weights then): no second model.

Why cached rather than kept beside the policy: during training the device holds no second model (its
weights and its forward are gone by the first step), and a step costs what an SFT step on the same rows
costs. The cost moves to the start: one forward per row (what a frozen reference would spend over an
epoch). A batch source without a sampler (tests, benchmarks) keeps the reference model and computes a
row when it is first asked for.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from loongtrain.loss.dpo import sequence_logps
from loongtrain.loss.token_logprobs import chunked_token_logprobs
from loongtrain.model.config import ModelConfig, first_difference
from loongtrain.parallelize.zero import uses_zero
from loongtrain.sections.model import autocast_dtype
from loongtrain.train.batch import Batch
from loongtrain.train.checkpoint import find_checkpoint, load_model_weights, read_trainer_state, verify_checkpoint
from loongtrain.train.config import Run, TrainSections
from loongtrain.train.lora_base import check_base
from loongtrain.train.model_setup import build_model, hf_model_dir, model_config_for
from loongtrain.train.step_context import StepContext
from loongtrain.train.validation import forward_only

log = logging.getLogger("loongtrain.train")
Tensor = torch.Tensor


def reference_config(cfg: TrainSections, ref_model: str) -> tuple[TrainSections, Path | None]:
    """``(options that build the reference, checkpoint to load into it)``: ``--ref-model``'s model (a Hugging
    Face directory's own, or a loongtrain run's ``--model`` with its checkpoint), else the policy's initial
    weights (``--init-from``'s checkpoint when given)."""
    plain = dict(rope_theta=0.0, rope_scaling="")
    if not ref_model:
        return cfg, Path(cfg.model.init_from) if cfg.model.init_from else None
    path = Path(ref_model)
    if (path / "config.json").is_file():
        return cfg.replace(model=str(path), init_from="", lora="", **plain), None
    try:
        checkpoint = find_checkpoint(ref_model)
        state = read_trainer_state(checkpoint)
    except ValueError as exc:
        raise ValueError(f"--ref-model {ref_model!r}: neither a Hugging Face model directory (config.json) nor "
                         f"a loongtrain run: {exc}") from None
    recorded = state.get("config") or {}
    # the reference run's own adapters (--lora; "" for full weights), not the policy's, on its own base: its model
    # and the seed of its initial weights (a LoRA checkpoint holds only the adapters)
    return cfg.replace(model=recorded.get("model", cfg.model.model), lora=recorded.get("lora", ""),
                       seed=recorded.get("seed", cfg.optim.seed), init_from=str(checkpoint), **plain), checkpoint


def check_reference(cfg: TrainSections, ref_model: str, model_config: ModelConfig, tokenizer: Any) -> None:
    """``--ref-model`` builds a model of the policy's architecture and vocabulary; ValueError naming the
    first field that differs (the launcher's check, before any worker)."""
    if not ref_model:
        return
    if not Path(ref_model).exists():
        raise ValueError(f"--ref-model {ref_model!r}: no such directory (a loongtrain run or checkpoint, or a "
                         f"Hugging Face model directory)")
    ref_cfg, checkpoint = reference_config(cfg, ref_model)
    try:
        ref = model_config_for(ref_cfg.model, tokenizer)
        if checkpoint is not None:  # a checkpoint is its checksums (docs/files-and-checkpoints.md), read once here;
            # a LoRA run's adapters need the base they trained on, as its resume and its export check it
            state = verify_checkpoint(checkpoint)
            check_base(state, str(checkpoint), ref if hf_model_dir(ref_cfg.model.model) is None else None)
    except ValueError as exc:
        raise ValueError(f"--ref-model {ref_model!r}: {exc}") from None
    policy_kind, ref_kind = _architecture(cfg.model.model), _architecture(ref_cfg.model.model)
    if policy_kind != ref_kind:
        raise ValueError(f"--ref-model {ref_model!r} is a {ref_kind} model, the policy a {policy_kind} one: the "
                         f"reference must have the policy's architecture and vocabulary")
    name = first_difference(ref, model_config)
    if name is not None:
        raise ValueError(f"--ref-model {ref_model!r}: its model has {name}={getattr(ref, name)!r}, the "
                         f"policy's {getattr(model_config, name)!r}: the reference must have the policy's "
                         f"architecture and vocabulary")


def _architecture(model: str) -> str:
    from loongtrain.hf.load import read_hf_config

    directory = hf_model_dir(model)
    if directory is None:
        return "loongtrain preset"
    return ",".join(read_hf_config(directory).architectures or ["unknown"])


def build_reference_model(ctx: StepContext, run: Run, ref_model: str) -> nn.Module:
    """The reference (module docstring), built and sharded like the run's policy on the step context."""
    cfg = run.cfg
    ref_cfg, checkpoint = reference_config(cfg, ref_model)
    model_config = ctx.model_config if not ref_model else model_config_for(ref_cfg.model, run.tokenizer)
    compute = autocast_dtype(cfg.model.dtype, ctx.device)
    model = build_model(model_config, ref_cfg, ctx.mesh, ctx.device, compute if uses_zero(cfg.parallel) else None)
    if checkpoint is not None:
        load_model_weights(checkpoint, model)
    return model


class Reference:
    """The reference log-probabilities of a DPO run (module docstring), by ``ref_key``: computed on the step
    context ``ctx`` of ``run`` with ``ref_model`` (``""``: the policy's initial weights); ``validation``: the run's
    validation batches (``count -> batches``)."""

    def __init__(self, ctx: StepContext, run: Run, ref_model: str,
                 validation: Callable[[int], list[Batch]]) -> None:
        self.ctx, self.run, self.ref_model, self.validation = ctx, run, ref_model, validation
        self.values: dict[int, Tensor] = {}
        self.model: nn.Module | None = None

    def build(self) -> nn.Module:
        """A reference model (:func:`build_reference_model`)."""
        return build_reference_model(self.ctx, self.run, self.ref_model)

    def prepare(self, stream: Any, start: int, end: int) -> None:
        """Compute the rows of optimizer steps ``[start, end)`` of ``stream`` (the trainer's
        :class:`~loongtrain.train.stages.StageStream`) and the validation rows; release the model. Without a
        sampler, keep a reference model for the rows asked for later. Collective."""
        t0 = time.perf_counter()
        source = stream.batches
        rows = self._rows(source, stream.stage.grad_accum, start, end)
        if rows is None:
            self.model = self.build()
            log.info("DPO reference: %s, computed for each row as it comes (the batch source has no sampler)",
                     self._describe())
            return
        model = self.ctx.model if start == 0 and not self.ref_model else self.build()
        for index in rows:
            self._fill(model, {k: v[None] for k, v in source.dataset[index].items()})
        evaluation = self.run.cfg.evaluation
        if evaluation.val_interval:
            for batch in self.validation(evaluation.val_batches):
                self._fill(model, batch)
        del model
        log.info("DPO reference: %s; log-probabilities of %d rows computed in %.1f s and cached (the reference "
                 "model is released)", self._describe(), len(self.values), time.perf_counter() - t0)

    def _describe(self) -> str:
        return f"--ref-model {self.ref_model}" if self.ref_model else "the policy's initial weights"

    @staticmethod
    def _rows(source: Any, accum: int, start: int, end: int) -> list[int] | None:
        sampler, dataset = getattr(source, "sampler", None), getattr(source, "dataset", None)
        if sampler is None or dataset is None:
            return None
        found: dict[int, None] = {}
        for micro in range(start * accum, end * accum):
            found.update(dict.fromkeys(sampler.indices(micro)))
        return list(found)

    def ensure(self, batches: list[Batch]) -> None:
        """Without a sampler (:meth:`prepare`): compute the rows of ``batches`` not cached yet (collective)."""
        if self.model is not None:
            for batch in batches:
                if "ref_logps" not in batch:
                    self._fill(self.model, batch)

    def _fill(self, model: nn.Module, batch: Batch) -> None:
        """The values of ``batch``'s rows not cached yet, one row at a time."""
        for b in range(batch["input_ids"].shape[0]):
            key = int(batch["ref_key"][b])
            if key not in self.values:
                row = {k: v[b:b + 1] for k, v in batch.items()}
                self.values[key] = self.row_logps(model, row)[0, :2 * int(row["num_pairs"][0])].to(torch.float64).cpu()

    def row_logps(self, model: nn.Module, batch: Batch) -> Tensor:
        """``[B, 2 * max_pairs]``: ``model``'s summed completion log-probabilities of ``batch``'s sequences,
        forward only, on the run's layout, loss path and autocast (collective over the replica)."""
        return self.local_logps(model, self.ctx.local(batch))

    def local_logps(self, model: nn.Module, local: Any) -> Tensor:
        """:meth:`row_logps` of a batch already laid on this rank (``StepContext.local``)."""
        ctx = self.ctx
        with forward_only(model), ctx.autocast():
            hidden, head, norm = ctx.forward(local, model)
            token_logps = chunked_token_logprobs(hidden, head, local.labels, norm=norm)
            return sequence_logps(token_logps, local.extras["segment"], 2 * max(local.extras["num_pairs"].tolist()),
                                  ctx.mesh)

    def lookup(self, keys: Tensor, num_pairs: Tensor, sequences: int) -> Tensor:
        """``[B, sequences]`` cached values of the rows ``keys`` (zeros past each row's pairs)."""
        out = torch.zeros(len(keys), sequences, dtype=torch.float64)
        for b, key in enumerate(keys.tolist()):
            assert key in self.values, f"row {key}: no reference log-probabilities were computed for it"
            values = self.values[key]
            out[b, :len(values)] = values
        return out
