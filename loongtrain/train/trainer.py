"""The training run of one rank (docs/launching.md): ``Trainer(run, mesh, device).train()``.

:meth:`Trainer.train` is the whole run in named steps: :meth:`~Trainer.resume` (load the checkpoint the
launcher chose), :meth:`~Trainer.open_data`, the optional start-up memory report, then per optimizer
step :meth:`~Trainer.step` (forward/backward of every micro-batch, gradient sync, clip, AdamW),
:meth:`~Trainer.log` and :meth:`~Trainer.save`, and :meth:`~Trainer.finish` (plot and summary).

What a step costs the host (docs/launching.md): two small host-side exchanges among the replica's
ranks whatever the depth (the micro-batches' sharding agreed before any attention call, the digest of every
attention call's arguments checked before the optimizer; gloo under NCCL), the gradient all-reduces
overlapped with the backward (``train/sync.py``), and ONE device-to-host read: the bad-step guard's
finiteness flag, together with the loss, gradient norm and attention pairs of this and the steps before
it only when they are logged (a log, last, validation, stage's first or skipped step).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from loongtrain._files import remove_owned
from loongtrain.attn.kernel_choice import chosen_kernels, refused_kernels
from loongtrain.model.config import ModelConfig, num_params, step_flops
from loongtrain.model.lora import adapter_params, lora_flops_saved
from loongtrain.parallel.agreement import attention_check_group, check_agreement, deferred_attention_checks
from loongtrain.parallel.failures import kill_point
from loongtrain.parallel.mesh import Mesh
from loongtrain.parallel.runtime import is_distributed, to_device
from loongtrain.parallelize.zero import uses_zero
from loongtrain.sections.model import autocast_dtype
from loongtrain.sections.stages import Stage, describe, run_stages
from loongtrain.train.batch import Batch, BatchSharding, LocalBatch, sharding_fields
from loongtrain.train.checkpoint import (
    CHECKPOINTS_FOLDER,
    NonFiniteError,
    load_checkpoint,
    load_model_weights,
    remove_stale_tmp,
    save_checkpoint,
)
from loongtrain.train.config import Run, TrainSections
from loongtrain.train.lora_base import base_record
from loongtrain.train.memory_report import (
    MemoryPlan,
    metrics_fields,
    predicted_memory,
    startup_memory_report,
    step_memory_report,
)
from loongtrain.train.metrics import (
    MetricsLogger,
    peak_flops_total,
    peak_memory_bytes,
    plot_evaluations,
    plot_loss_curve,
    read_device_values,
)
from loongtrain.train.model_setup import build_model, init_checkpoint, model_record
from loongtrain.train.objective import Objective
from loongtrain.train.optim import build_optimizer, clip_grad_norm, fill_missing_grads
from loongtrain.train.stages import StageStream, stage_config
from loongtrain.train.step_context import StepContext
from loongtrain.train.sync import GradientSync, needs_grad_sync
from loongtrain.train.validation import Validation

log = logging.getLogger("loongtrain.train")

#: (cfg, mesh, start_micro_step) -> iterator of this replica's full-sequence micro-batches
BatchSource = Callable[[TrainSections, Mesh, int], Iterator[Batch]]


def use_deterministic(device: torch.device) -> None:
    """``torch.use_deterministic_algorithms(True)`` (errors on ops without a deterministic version); on
    CUDA also cuBLAS's fixed workspace (``CUBLAS_WORKSPACE_CONFIG``, read when cuBLAS starts) and no
    cuDNN autotuning. The flash attention backward then takes its deterministic (slower) path."""
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True)


def _barrier() -> None:
    if is_distributed():
        dist.barrier()


def rope_text(config: ModelConfig) -> str:
    """The RoPE a run trains with, for its log: ``RoPE theta 10000, no scaling`` / ``..., yarn:factor=4,...``."""
    scaling = config.rope_scaling
    return f"RoPE theta {config.rope_theta:g}, {scaling.spec() if scaling is not None else 'no scaling'}"


class Trainer:
    """Model, optimizer, schedule and data of one rank, and the run loop (:meth:`train`).

    :meth:`step` takes ``grad_accum`` micro-batches of this replica's *full* sequences; each rank keeps its
    2D zigzag shard (:class:`~loongtrain.train.batch.BatchSharding`), so the trainer is layout-agnostic.
    ``batches`` replaces the corpus (tests, benchmarks): a :data:`BatchSource`, called with each stage's
    options (``--seq-len-stages``: :mod:`~loongtrain.train.stages`). The in-loop evaluations are the
    run's (``run.evaluations``, built by the launch path), and so is the objective (``run.objective``, from
    :mod:`loongtrain.objectives`' registry), built here on the rank's :class:`~loongtrain.train.step_context.
    StepContext`: pretraining is an objective like the others. ``per_call_checks``: agree on every attention
    call's arguments in its own exchange, as direct library use does, instead of once per step
    (benchmarks/agreement.py compares the two).
    """

    def __init__(self, run: Run, mesh: Mesh, device: torch.device, batches: BatchSource | None = None, *,
                 per_call_checks: bool = False) -> None:
        cfg = run.cfg
        self.run, self.cfg, self.mesh, self.device = run, cfg, mesh, device
        self.model_config = run.model_config  # the shape (FLOPs, memory prediction); HF models keep their own
        if cfg.optim.deterministic:
            use_deterministic(device)
        torch.manual_seed(cfg.optim.seed)
        if device.type == "cuda":
            torch.cuda.manual_seed_all(cfg.optim.seed)
        compute = autocast_dtype(cfg.model.dtype, device)
        sharded = uses_zero(cfg.parallel)
        self.model: nn.Module = build_model(self.model_config, cfg, mesh, device, compute if sharded else None)
        self.params = [p for _, p in sorted(self.model.named_parameters(), key=lambda kv: kv[0])]
        self.grad_sync = GradientSync(self.model, mesh.dp) if needs_grad_sync(self.model) else None
        self.per_call_checks = per_call_checks
        self._peak: float | None = None  # the MFU's peak FLOP/s (train)
        self._tokens: dict[int, int] = {}  # step -> its tokens, for records whose FLOP rates wait for a read
        self.optimizer, self.scheduler = build_optimizer(self.model, cfg.optim, cfg.parallel.offload_params)
        # FSDP2 casts the weights: no autocast (sections/model.py's autocast_dtype)
        self.ctx = StepContext(self.model, self.model_config, mesh, device,
                               BatchSharding(cfg.data, mesh, self.model_config, device), None if sharded else compute)
        self.out_dir = Path(cfg.output.out_dir)
        self.stages = run_stages(cfg.data, cfg.optim.steps)
        self._lora_base: dict[str, Any] | None = None  # --lora: the checkpoints' record of the base (on first save)
        self.objective: Objective = run.objective.build(self.ctx, run)  # loongtrain/objectives/
        self.batch_source = batches or (lambda cfg, _mesh, start: self.objective.batches(cfg, start))

    # -- the run ---------------------------------------------------------------------------------------

    def train(self) -> list[dict[str, Any]]:
        """Train for ``cfg.steps`` optimizer steps (or resume and finish them); return the step records.

        Every rank calls this (collective). Rank 0 writes ``metrics.jsonl``, TensorBoard events, the
        checkpoints' shared files and ``loss_curve.png`` into ``cfg.out_dir``."""
        cfg = self.cfg
        start, state = self.resume()
        self._tidy_out_dir(resumed=bool(state))
        batches = self.open_data(start, state)
        steps, stop_after = cfg.optim.steps, cfg.runtime.stop_after
        end = steps if not stop_after else min(steps, start + stop_after)
        self.objective.prepare(batches, start, end)  # DPO: the reference's log-probabilities, before the first forward
        mem_fields = self._memory_report(batches, start) if cfg.runtime.memory_report else {}
        self._peak = self._peak_flops()
        logger = self._logger(start)
        records: list[dict[str, Any]] = []
        # --val-interval: the validation loss and the in-loop evaluations (train/validation.py)
        validation = Validation(stage_config(cfg, batches.stage), self.ctx, self.objective.validation_loss,
                                read=self.objective.validation_batches, evaluations=self.run.evaluations)
        reset_peak_memory(self.device)
        bad_steps = 0
        unread: list[dict[str, Any]] = []  # records whose DEVICE_VALUES (metrics.py) are still on the device
        try:
            for step in range(start, end):
                kill_point(step + 1, start)  # test hook: LOONGTRAIN_KILL_AT (parallel/failures.py)
                stage = self._enter_stage(batches, step)
                read = self._logs(step + 1, last=step + 1 == end) or validation.due(step + 1)
                record = self._timed_step(step, stage, batches, mem_fields, unread if read else None)
                if read:  # read by the step, in its one transfer, with the earlier unread records
                    unread.clear()
                else:
                    unread.append(record)
                    if record["skipped"]:  # logged and warned about: one more transfer, on bad steps only
                        self._read(unread)
                        unread.clear()
                # {"val_loss": ..., "eval/...": ...} when due, else {}
                record.update(validation.after_step(step + 1, stage_config(cfg, stage)))
                records.append(record)
                bad_steps = self._count_bad_step(record, bad_steps)
                self.log(logger, record, last=step + 1 == end)
                self._stop_after_bad_steps(record, bad_steps)
                self.save(step + 1, batches, last=step + 1 == end)
            self._read(unread)
            unread.clear()
        finally:
            if logger is not None:
                logger.close()
        self.finish(records, logger)
        return records

    def resume(self) -> tuple[int, dict[str, Any]]:
        """Load the checkpoint the launcher chose (``run.resume``; rank 0's choice on every rank, so ranks
        never continue from different steps); ``(start_step, trainer_state)``, ``(0, {})`` when fresh."""
        choice = [self.run.resume]
        if is_distributed() and dist.get_world_size() > 1:
            dist.broadcast_object_list(choice, src=0)
        if not choice[0]:
            if self.cfg.output.resume:
                log.info("--resume %s: no checkpoint in %s yet; starting fresh", self.cfg.output.resume,
                         self.out_dir / "checkpoints")
            if self.cfg.model.init_from:  # weights only: optimizer, schedule and data start fresh
                found = init_checkpoint(self.cfg.model)
                assert found is not None
                load_model_weights(found[0], self.model)
                log.info("initialised the weights from %s (step %d of its run)", found[0], int(found[1]["step"]))
            return 0, {}
        state = load_checkpoint(Path(choice[0]), self.model, self.optimizer, self.scheduler)
        log.info("resumed from %s at step %d%s", choice[0], int(state["step"]),
                 f" (--init-from {self.cfg.model.init_from} applies to a fresh start only)" if self.cfg.model.init_from
                 else "")
        return int(state["step"]), state

    def open_data(self, start_step: int, state: dict[str, Any]) -> StageStream:
        """This replica's batch stream from ``start_step``, in that step's stage (its saved position checked
        and restored)."""
        stream = StageStream(self.cfg, self.stages, lambda cfg, micro: self.batch_source(cfg, self.mesh, micro))
        stream.start(start_step, state)
        return stream

    def step(self, micro_batches: list[Batch], *, read: list[dict[str, Any]] | bool = True) -> dict[str, Any]:
        """Forward/backward every micro-batch, synchronise and clip gradients, apply AdamW.

        Returns ``loss`` (mean over micro-batches and dp replicas, identical on every rank), ``grad_norm``
        (before clipping), ``lr`` (the rate used for this step), ``skipped`` (1 when the loss or gradient
        norm was NaN/inf: the optimizer did not update, every rank alike) and ``attention_pairs`` (visible
        (query, key) pairs of all replicas' rows, per layer and head: the work that FLOP counts use).

        One device-to-host read (the bad-step guard's). ``read``: also read ``loss``, ``grad_norm`` and
        ``attention_pairs`` in it (True), or leave them device tensors (False; ``metrics.DEVICE_VALUES``); a list
        of earlier such records: read theirs in the same transfer too (filled in place).
        """
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        if not self.objective.begin_step(micro_batches):
            return self._no_targets(read)
        local = [self.ctx.local(b) for b in micro_batches]
        loss_value = self._forward_backward(local)
        fill_missing_grads(self.params)  # the same update at every world size for a parameter without one
        grad_norm = clip_grad_norm(self.params, self.cfg.optim.clip)
        lr = self.optimizer.param_groups[0]["lr"]
        pairs: torch.Tensor | int = sum(self.ctx.sharding.visible_pairs(b) for b in micro_batches)
        values = self.objective.step_values()  # e.g. MoE's aux_loss
        if self.mesh.dp > 1:  # one all-reduce for the loss, the replicas' attention pairs (and the step's values)
            both = torch.stack([loss_value, to_device(torch.tensor(float(pairs), dtype=torch.float64), self.device),
                                *values.values()])
            dist.all_reduce(both, group=self.mesh.dp_group)
            loss_value, pairs = both[0] / self.mesh.dp, both[1]
            values = {name: both[2 + i] / self.mesh.dp for i, name in enumerate(values)}
        # the loss is dp-reduced and the norm is of synchronised gradients: every rank decides alike
        finite = torch.isfinite(loss_value) & torch.isfinite(grad_norm)
        record = {"loss": loss_value, "grad_norm": grad_norm, "attention_pairs": pairs, **values}
        earlier = read if isinstance(read, list) else []
        skipped = not self._read([record, *earlier] if read is not False else [], guard=finite)
        if skipped:
            self.optimizer.zero_grad(set_to_none=True)  # no update; the schedule still advances
        else:
            self.optimizer.step()
        self.scheduler.step()
        return {"loss": record["loss"], "grad_norm": record["grad_norm"], "lr": float(lr), "skipped": int(skipped),
                "attention_pairs": record["attention_pairs"], **{name: record[name] for name in values},
                **self.objective.metrics()}

    def _no_targets(self, read: list[dict[str, Any]] | bool) -> dict[str, Any]:
        """A post-training step whose sequences hold no target at all: no forward, no update (every rank
        alike: the count is the step's, all-reduced); the schedule advances as for a skipped step."""
        lr = self.optimizer.param_groups[0]["lr"]
        if isinstance(read, list):
            self._read(read)
        self.scheduler.step()
        return {"loss": 0.0, "grad_norm": 0.0, "lr": float(lr), "skipped": 1, "no_targets": 1, "attention_pairs": 0,
                **self.objective.metrics()}

    def _forward_backward(self, local: list[LocalBatch]) -> torch.Tensor:
        """Forward and backward of this rank's shards of the micro-batches, the gradients synchronised while
        the last backward runs; the mean loss (a device scalar). Unless ``per_call_checks``, the replica's
        ranks agree on how the micro-batches are sharded before the first attention call and on every call's arguments
        after the last (two host-side exchanges, however deep the model: docs/launching.md)."""
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        checks = self.mesh.sp_group is not None and not self.per_call_checks
        if checks:  # what shapes attention's collectives: agreed before any of them runs
            check_agreement("training step", sharding_fields(local), attention_check_group(self.mesh))
        with deferred_attention_checks(self.mesh) if checks else contextlib.nullcontext() as calls:
            for i, batch in enumerate(local):
                last = i == len(local) - 1
                with self.grad_sync.overlapped() if self.grad_sync and last else contextlib.nullcontext():
                    loss, value = self.objective.loss(batch)
                    (loss / len(local)).backward()
                loss_sum += value.detach().to(torch.float64)
        if calls is not None:
            calls.check()  # ValueError on every rank of the replica, naming the field, before the optimizer
        return loss_sum / len(local)

    def _read(self, records: list[dict[str, Any]], guard: torch.Tensor | None = None) -> bool:
        """:func:`~loongtrain.train.metrics.read_device_values` (one transfer), then the FLOP rates of the
        finished records it completed."""
        flag = read_device_values(records, guard)
        for r in records:
            if "tflops" in r and r["tflops"] is None:  # a finished record: its FLOP rates need the pairs
                self._add_rates(r)
        return flag

    def loss(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss_for_backward, loss_value)`` of one full-sequence micro-batch on this rank's shard, on its own:
        the objective's (pretraining: the forward to the final norm's input, then the chunked cross-entropy through
        the final norm and the LM head; no rank holds its logits)."""
        self.objective.begin_step([batch], dp_reduce=False)
        return self.objective.loss(self.ctx.local(batch))

    def log(self, logger: MetricsLogger | None, record: dict[str, Any], *, last: bool) -> None:
        """Write ``record`` (rank 0) every ``--log-interval`` steps, at the end, for every skipped or validated
        step and for the first step of each stage of --seq-len-stages."""
        if logger is not None and (self._logs(record["step"], last=last) or record["skipped"] or "val_loss" in record):
            logger.log(record)

    def _logs(self, step: int, *, last: bool) -> bool:
        """Whether step ``step`` (1-based) is logged whatever its values: every ``--log-interval``, the last, and
        the first of each stage of --seq-len-stages."""
        return step % self.cfg.output.log_interval == 0 or last or self._stage_begins(step - 1)

    def save(self, done: int, batches: StageStream, *, last: bool) -> None:
        """Checkpoint after step ``done`` every ``--ckpt-interval`` steps and at the end (collective)."""
        cfg, mesh, output = self.cfg, self.mesh, self.cfg.output
        if not ((output.ckpt_interval and done % output.ckpt_interval == 0) or last):
            return
        record = model_record(self.model_config, cfg.model)
        if cfg.model.lora and self._lora_base is None:  # --lora: the base the adapters belong to (train/lora_base.py)
            self._lora_base = base_record(cfg.model, cfg.optim.seed, record)
        save_checkpoint(self.out_dir / "checkpoints", done, self.model, self.optimizer, self.scheduler,
                        {"micro_step": done * batches.stage.grad_accum, **batches.state(), "config": cfg.to_dict(),
                         "data_identity": self.run.data_identity, **record,
                         **({"lora": self._lora_base} if cfg.model.lora else {}),
                         "layout": {"world": mesh.world_size, "dp": mesh.dp, "hp": mesh.hp, "cp": mesh.cp},
                         "attention_kernels": chosen_kernels(), "refused_kernels": refused_kernels()},
                        keep=output.keep_checkpoints)

    def finish(self, records: list[dict[str, Any]], logger: MetricsLogger | None) -> None:
        """Rank 0: the loss plot and the closing summary line; then every rank waits for the others."""
        if logger is not None and records:
            if self.cfg.output.plot:
                stages = [(s.first_step, s.seq_len) for s in self.stages] if len(self.stages) > 1 else []
                plot_loss_curve(logger.jsonl_path, self.out_dir / "loss_curve.png", stages=stages)
                plot_evaluations(logger.jsonl_path, self.out_dir / "eval_curve.png")
            tail = records[-min(10, len(records)):]
            timed = records[1:] or records
            log.info("done: steps %d-%d, loss %.4f -> %.4f (mean of the last %d: %.4f), %.0f tokens/s "
                     "(mean after the first step); metrics in %s", records[0]["step"], records[-1]["step"],
                     records[0]["loss"], records[-1]["loss"], len(tail), sum(r["loss"] for r in tail) / len(tail),
                     sum(r["tokens_per_s"] for r in timed) / len(timed), self.out_dir / "metrics.jsonl")
        _barrier()

    # -- pieces of the run -----------------------------------------------------------------------------

    def _tidy_out_dir(self, *, resumed: bool) -> None:
        """Rank 0: ``--overwrite`` deletes old checkpoints of a fresh start; saves that died half-way go."""
        if self.mesh.rank != 0:
            return
        root = self.out_dir / "checkpoints"
        if self.cfg.output.overwrite and not resumed and root.is_dir():  # only what the trainer wrote there
            log.warning("--overwrite: deleting the checkpoints in %s", root)
            remove_owned(CHECKPOINTS_FOLDER, root)
        for stale in remove_stale_tmp(root):
            log.warning("removed the incomplete checkpoint %s", stale)

    def _memory_report(self, batches: StageStream, start: int) -> dict[str, float]:
        """The start-up memory report (collective) on the first batch this run trains: a pure peek
        (``Batches.batch``) where the source has one, so the training stream is unchanged and the corpus
        is not read twice; else the first batch of a fresh source."""
        first = batches.peek(start)
        if first is None:
            stage = batches.stage
            first = next(self.batch_source(stage_config(self.cfg, stage), self.mesh, start * stage.grad_accum))
        return metrics_fields(self.startup_memory_report(first))

    def memory_plan(self) -> MemoryPlan:
        """What the planner needs to predict this run's memory (:class:`~loongtrain.train.memory_report.MemoryPlan`:
        its layout, dtype, ZeRO shard group, adapters, kernels' scratch and its objective's memory phases)."""
        return MemoryPlan.of(self.cfg, self.ctx, self.run.objective.memory())

    def memory_report(self, batch: Batch) -> dict[str, int]:
        """This rank's memory of one step on the full-sequence micro-batch ``batch``
        (:func:`~loongtrain.train.memory_report.step_memory_report`)."""
        return step_memory_report(self.ctx, self.optimizer, lambda: self.loss(batch)[0], self.memory_plan())

    def startup_memory_report(self, batch: Batch) -> dict[str, int]:
        """:meth:`memory_report` logged for every rank, with the planner's prediction beside rank 0's (collective;
        :func:`~loongtrain.train.memory_report.startup_memory_report`)."""
        return startup_memory_report(self.ctx, self.optimizer, lambda: self.loss(batch)[0], self.memory_plan(),
                                     batch["input_ids"].shape)

    def predicted_memory(self, *, seq_len: int, batch: int) -> dict[str, float]:
        """The planner's prediction of this run's memory (:func:`~loongtrain.train.memory_report.predicted_memory`)."""
        return predicted_memory(self.ctx, self.memory_plan(), seq_len=seq_len, batch=batch)

    def _peak_flops(self) -> float | None:
        _barrier()  # rank 0 measures the CPU peak while the other ranks wait idle
        peak = peak_flops_total(self.cfg.output.peak_tflops, self.device, self.mesh.world_size) \
            if self.mesh.rank == 0 else None
        _barrier()
        if self.mesh.rank == 0:
            log.info("model %s: %.2fM parameters; %s; %d tokens per step; %s", self.cfg.model.model,
                     num_params(self.model_config) / 1e6, self.mesh, self.tokens_per_step(self.stages[0]),
                     rope_text(self.model_config))
            lora = self.cfg.model.lora_config()
            if lora is not None:
                log.info("--lora %s: %.3fM adapter parameters train (%.3f%% of the model), the base is frozen",
                         lora.to_text(), adapter_params(self.model_config, lora) / 1e6,
                         100 * adapter_params(self.model_config, lora) / num_params(self.model_config))
            if len(self.stages) > 1:
                log.info("--seq-len-stages: %s", describe(self.stages, self.mesh.dp))
        return peak

    def tokens_per_step(self, stage: Stage) -> int:
        """Tokens of all replicas in one optimizer step of ``stage``."""
        return self.mesh.dp * stage.tokens_per_replica_step()

    def _stage_begins(self, step: int) -> bool:
        return len(self.stages) > 1 and any(s.first_step == step for s in self.stages)

    def _enter_stage(self, batches: StageStream, step: int) -> Stage:
        """The stage of ``step``, its stream opened; logs where a stage begins."""
        stage = batches.at(step)
        if stage.index and self._stage_begins(step):
            log.info("step %d: stage %d of %d begins: %d tokens per sequence, batch %d x grad-accum %d",
                     step + 1, stage.index + 1, len(self.stages), stage.seq_len, stage.batch_size, stage.grad_accum)
        return stage

    def _logger(self, start: int) -> MetricsLogger | None:
        if self.mesh.rank != 0:
            return None
        output = self.cfg.output
        return MetricsLogger(self.out_dir, total_steps=self.cfg.optim.steps, start_step=start,
                             tensorboard=output.tensorboard, progress=output.progress)

    def _timed_step(self, step: int, stage: Stage, batches: StageStream, mem_fields: dict[str, float],
                    read: list[dict[str, Any]] | None) -> dict[str, Any]:
        """:meth:`step` and its record. The step time is the host's, without a device synchronisation: from
        the step's start to its end, whose one read waits for its forward and backward (the optimizer's
        kernels queued after it run into the next step's time, so steady-state steps are timed right)."""
        t0 = time.perf_counter()
        result = self.step(batches.micro_batches(), read=read if read is not None else False)
        dt = time.perf_counter() - t0
        tokens = self.tokens_per_step(stage)
        seen = batches.tokens_seen()  # data: tokens each corpus supplied (all replicas)
        record = {"step": step + 1, "total_steps": self.cfg.optim.steps, "seq_len": stage.seq_len, **result,
                  "step_time_s": dt, "tokens_per_s": tokens / dt, "tflops": None, "mfu": None,
                  "peak_mem_gib": peak_memory_bytes(self.device) / 2**30, **mem_fields,
                  "attention_kernels": ",".join(sorted(set(chosen_kernels().values()))),
                  **({f"tokens_seen/{name}": n for name, n in seen.items()} if seen is not None else {})}
        self._tokens[step + 1] = tokens
        if not isinstance(record["attention_pairs"], torch.Tensor):
            self._add_rates(record)
        return record

    def _add_rates(self, record: dict[str, Any]) -> None:
        """``tflops`` and ``mfu`` of a record whose attention pairs are known: attention FLOPs of the visible
        (query, key) pairs only (documents, sliding window)."""
        tokens = self._tokens.pop(record["step"])
        flops = (step_flops(self.model_config, tokens, record["attention_pairs"])  # --lora: the FLOPs that run
                 - lora_flops_saved(self.model_config, self.cfg.model.lora_config(), tokens))
        record["tflops"] = flops / record["step_time_s"] / 1e12
        record["mfu"] = (flops / record["step_time_s"] / self._peak) if self._peak else float("nan")

    def _count_bad_step(self, record: dict[str, Any], bad_steps: int) -> int:
        """Consecutive skipped (non-finite) steps after this one; logs each skip."""
        if record.get("no_targets"):  # a step without targets: skipped, not a bad step
            log.warning("%s", self.objective.no_targets_message(record["step"]))
            return 0
        if not record["skipped"]:
            return 0
        log.warning("step %d skipped: loss %s, gradient norm %s (not finite); %d consecutive (--max-bad-steps=%d)",
                    record["step"], record["loss"], record["grad_norm"], bad_steps + 1, self.cfg.runtime.max_bad_steps)
        return bad_steps + 1

    def _stop_after_bad_steps(self, record: dict[str, Any], bad_steps: int) -> None:
        limit = self.cfg.runtime.max_bad_steps
        if limit and bad_steps >= limit:
            raise NonFiniteError(
                f"stopping at step {record['step']}: {bad_steps} consecutive steps had a NaN/inf loss or "
                f"gradient norm (--max-bad-steps={limit}); lower --lr or check the data; "
                f"the checkpoints written so far are kept")


def reset_peak_memory(device: torch.device) -> None:
    """Start the peak-memory count afresh (CUDA), so ``peak_mem_gib`` excludes set-up (model build,
    checkpoint load, start-up report). CPU reports the process's peak RSS, which cannot be reset."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
