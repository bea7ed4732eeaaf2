"""The training run of one rank: seeds, data, resume, the step loop, metrics, checkpoints, final plot."""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from loongtrain.model.config import ModelConfig, num_params, step_flops
from loongtrain.parallel.mesh import Mesh
from loongtrain.parallel.runtime import is_distributed
from loongtrain.train import models
from loongtrain.train.checkpoint import (
    NonFiniteError,
    load_checkpoint,
    remove_stale_tmp,
    resolve_checkpoint,
    save_checkpoint,
)
from loongtrain.train.config import TrainConfig
from loongtrain.train.memory_report import metrics_fields, startup_memory_report
from loongtrain.train.metrics import (
    MetricsLogger,
    cuda_peak_tflops,
    measure_cpu_tflops,
    peak_memory_bytes,
    plot_loss_curve,
)
from loongtrain.train.trainer import Batch, Trainer

log = logging.getLogger("loongtrain.train")

# (cfg, mesh, start_micro_step) -> iterator of this replica's full-sequence micro-batches
BatchSource = Callable[[TrainConfig, Mesh, int], Iterator[Batch]]


def model_config_for(cfg: TrainConfig) -> ModelConfig:
    """The shape of the model ``cfg`` trains (a preset or a Hugging Face directory):
    :func:`loongtrain.train.models.model_config_for`."""
    return models.model_config_for(cfg)


def data_batches(cfg: TrainConfig, mesh: Mesh, start_micro_step: int) -> Iterator[Batch]:
    """Batches from ``loongtrain.data`` for this rank's dp replica, resuming at ``start_micro_step``."""
    from loongtrain import data

    tokenizer = data.build_tokenizer(models.tokenizer_spec(cfg))
    corpus = data.build_corpus(cfg.corpus, decode_errors=cfg.decode_errors)  # --decode-errors (issue 23)
    return data.build_batches(
        corpus, tokenizer, cfg.seq_len, cfg.batch_size, mesh.dp_rank, mesh.dp, cfg.seed,
        start_micro_step,
    )


def peak_flops_total(cfg: TrainConfig, device: torch.device, world: int) -> float | None:
    """Peak FLOP/s of the whole job for MFU (see loongtrain.train.metrics); None when unknown."""
    if cfg.peak_tflops > 0:
        per_device = cfg.peak_tflops
    elif device.type == "cuda":
        per_device = cuda_peak_tflops(device)
        if per_device is None:
            log.warning("unknown CUDA device %r: pass --peak-tflops for MFU", torch.cuda.get_device_name())
            return None
    else:
        per_device = measure_cpu_tflops()
        log.info("CPU peak for MFU: measured %.4f TFLOP/s per single-thread worker", per_device)
    devices = world if device.type == "cuda" or cfg.peak_tflops > 0 else min(world, os.cpu_count() or 1)
    return per_device * 1e12 * devices


def _barrier() -> None:
    if is_distributed():
        dist.barrier()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def use_deterministic(device: torch.device) -> None:
    """``torch.use_deterministic_algorithms(True)`` (errors on ops without a deterministic version); on
    CUDA also cuBLAS's fixed workspace (``CUBLAS_WORKSPACE_CONFIG``, read when cuBLAS starts) and no
    cuDNN autotuning. The flash attention backward then takes its deterministic (slower) path."""
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True)


def reset_peak_memory(device: torch.device) -> None:
    """Start the peak-memory count afresh (CUDA), so ``peak_mem_gib`` excludes set-up (model build,
    checkpoint load, start-up report). CPU reports the process's peak RSS, which cannot be reset."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def _chosen_checkpoint(cfg: TrainConfig, out_dir: Path, rank: int) -> Path | None:
    """The checkpoint every rank loads: rank 0 resolves ``--resume`` and broadcasts its choice, so ranks
    never resume from different steps (``latest`` may move while they look). None: start fresh."""
    if not cfg.resume:
        return None
    choice = [""]
    if rank == 0:
        found = resolve_checkpoint(cfg.resume, out_dir)
        choice = [str(found) if found is not None else ""]
    if is_distributed() and dist.get_world_size() > 1:
        dist.broadcast_object_list(choice, src=0)
    return Path(choice[0]) if choice[0] else None


def _count_bad_step(cfg: TrainConfig, step: int, result: dict[str, Any], bad_steps: int) -> int:
    """Consecutive skipped (non-finite) steps after ``step``; logs each skip."""
    if not result["skipped"]:
        return 0
    log.warning("step %d skipped: loss %s, gradient norm %s (not finite); %d consecutive (--max-bad-steps=%d)",
                step, result["loss"], result["grad_norm"], bad_steps + 1, cfg.max_bad_steps)
    return bad_steps + 1


def fit(cfg: TrainConfig, mesh: Mesh, device: torch.device, *, model_config: ModelConfig | None = None,
        batch_source: BatchSource | None = None) -> list[dict[str, Any]]:
    """Train for ``cfg.steps`` optimizer steps (or resume and finish them); return the step records.

    Every rank calls this (collective). Rank 0 writes ``metrics.jsonl``, TensorBoard events, the
    checkpoints' shared files and ``loss_curve.png`` into ``cfg.out_dir``.
    """
    rank = mesh.rank
    if cfg.deterministic:
        use_deterministic(device)
    torch.manual_seed(cfg.seed)
    if device.type == "cuda":
        torch.cuda.manual_seed_all(cfg.seed)
    model_config = model_config or model_config_for(cfg)
    batch_source = batch_source or data_batches
    out_dir = Path(cfg.out_dir)
    trainer = Trainer(cfg, mesh, device, model_config)
    start_step, state = 0, {}
    path = _chosen_checkpoint(cfg, out_dir, rank)
    if path is not None:
        state = load_checkpoint(path, trainer.model, trainer.optimizer, trainer.scheduler)
        start_step = int(state["step"])
        log.info("resumed from %s at step %d", path, start_step)
    elif cfg.resume:
        log.info("--resume %s: no checkpoint in %s yet; starting fresh", cfg.resume, out_dir / "checkpoints")
    if rank == 0:
        if cfg.overwrite and path is None and (out_dir / "checkpoints").is_dir():
            log.warning("--overwrite: deleting the checkpoints in %s", out_dir / "checkpoints")
            shutil.rmtree(out_dir / "checkpoints")
        for stale in remove_stale_tmp(out_dir / "checkpoints"):  # saves that died half-way
            log.warning("removed the incomplete checkpoint %s", stale)
    end_step = cfg.steps if not cfg.stop_after else min(cfg.steps, start_step + cfg.stop_after)
    tokens_per_step = mesh.dp * cfg.batch_size * cfg.grad_accum * cfg.seq_len
    _barrier()  # rank 0 measures the CPU peak while the other ranks wait idle
    peak = peak_flops_total(cfg, device, mesh.world_size) if rank == 0 else None
    _barrier()
    if rank == 0:
        log.info("model %s: %.2fM parameters; %s; %d tokens per step", cfg.model,
                 num_params(model_config) / 1e6, mesh, tokens_per_step)
    logger = None
    if rank == 0:
        logger = MetricsLogger(out_dir, total_steps=cfg.steps, start_step=start_step,
                               tensorboard=cfg.tensorboard, progress=cfg.progress)
    batches = batch_source(cfg, mesh, start_step * cfg.grad_accum)
    if state.get("data") is not None and hasattr(batches, "load_state_dict"):
        batches.load_state_dict(state["data"])  # checks the global batch and seed did not change
    mem_fields: dict[str, float] = {}
    if cfg.memory_report:  # collective; a fresh batch iterator, so the training stream is unchanged
        memory = startup_memory_report(trainer, next(batch_source(cfg, mesh, start_step * cfg.grad_accum)))
        mem_fields = metrics_fields(memory)
    records: list[dict[str, Any]] = []
    ckpt_root = out_dir / "checkpoints"
    reset_peak_memory(device)
    bad_steps = 0
    try:
        for step in range(start_step, end_step):
            _sync(device)
            t0 = time.perf_counter()
            micro = [next(batches) for _ in range(cfg.grad_accum)]
            result = trainer.step(micro)
            _sync(device)
            bad_steps = _count_bad_step(cfg, step + 1, result, bad_steps)
            dt = time.perf_counter() - t0
            # attention FLOPs of the visible (query, key) pairs only (documents, sliding window)
            flops_per_step = step_flops(model_config, tokens_per_step, result["attention_pairs"])
            record = {
                "step": step + 1, "total_steps": cfg.steps, **result, "step_time_s": dt,
                "tokens_per_s": tokens_per_step / dt, "tflops": flops_per_step / dt / 1e12,
                "mfu": (flops_per_step / dt / peak) if peak else float("nan"),
                "peak_mem_gib": peak_memory_bytes(device) / 2**30, **mem_fields,
            }
            records.append(record)
            if logger is not None and ((step + 1) % cfg.log_interval == 0 or step + 1 == end_step
                                       or result["skipped"]):
                logger.log(record)
            if cfg.max_bad_steps and bad_steps >= cfg.max_bad_steps:
                raise NonFiniteError(
                    f"stopping at step {step + 1}: {bad_steps} consecutive steps had a NaN/inf loss or "
                    f"gradient norm (--max-bad-steps={cfg.max_bad_steps}); lower --lr or check the data; "
                    f"the checkpoints written so far are kept")
            done = step + 1
            if (cfg.ckpt_interval and done % cfg.ckpt_interval == 0) or done == end_step:
                data_state = batches.state_dict() if hasattr(batches, "state_dict") else None
                save_checkpoint(ckpt_root, done, trainer.model, trainer.optimizer, trainer.scheduler,
                                {"micro_step": done * cfg.grad_accum, "data": data_state,
                                 "config": cfg.to_dict(), **models.model_record(model_config, cfg),
                                 "layout": {"world": mesh.world_size, "dp": mesh.dp, "hp": mesh.hp,
                                            "cp": mesh.cp}},
                                keep=cfg.keep_checkpoints)
    finally:
        if logger is not None:
            logger.close()
    if rank == 0 and records:
        if cfg.plot:
            plot_loss_curve(logger.jsonl_path, out_dir / "loss_curve.png")
        tail = records[-min(10, len(records)):]
        timed = records[1:] or records
        log.info("done: steps %d-%d, loss %.4f -> %.4f (mean of the last %d: %.4f), %.0f tokens/s "
                 "(mean after the first step); metrics in %s", records[0]["step"], records[-1]["step"],
                 records[0]["loss"], records[-1]["loss"], len(tail), sum(r["loss"] for r in tail) / len(tail),
                 sum(r["tokens_per_s"] for r in timed) / len(timed), out_dir / "metrics.jsonl")
    _barrier()
    return records
