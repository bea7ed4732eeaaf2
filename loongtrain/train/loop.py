"""The training run of one rank: seeds, data, resume, the step loop, metrics, checkpoints, final plot."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from loongtrain.model.config import ModelConfig, flops_per_token, get_preset, num_params
from loongtrain.parallel.mesh import Mesh
from loongtrain.train.checkpoint import load_checkpoint, remove_stale_tmp, resolve_checkpoint, save_checkpoint
from loongtrain.train.config import TrainConfig
from loongtrain.train.memory import metrics_fields, startup_memory_report
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
    """The model preset of ``cfg``, widened to the tokenizer's vocabulary if that is larger."""
    config = get_preset(cfg.model)
    vocab = tokenizer_vocab_size(cfg)
    if vocab is not None and vocab > config.vocab_size:
        config = get_preset(cfg.model, vocab_size=vocab)
    return config


def tokenizer_vocab_size(cfg: TrainConfig) -> int | None:
    from loongtrain import data

    return int(data.build_tokenizer(cfg.tokenizer).vocab_size)


def data_batches(cfg: TrainConfig, mesh: Mesh, start_micro_step: int) -> Iterator[Batch]:
    """Batches from ``loongtrain.data`` for this rank's dp replica, resuming at ``start_micro_step``."""
    from loongtrain import data

    tokenizer = data.build_tokenizer(cfg.tokenizer)
    return data.build_batches(
        cfg.corpus, tokenizer, cfg.seq_len, cfg.batch_size, mesh.dp_rank, mesh.dp, cfg.seed,
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
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fit(cfg: TrainConfig, mesh: Mesh, device: torch.device, *, model_config: ModelConfig | None = None,
        batch_source: BatchSource | None = None) -> list[dict[str, Any]]:
    """Train for ``cfg.steps`` optimizer steps (or resume and finish them); return the step records.

    Every rank calls this (collective). Rank 0 writes ``metrics.jsonl``, TensorBoard events, the
    checkpoints' shared files and ``loss_curve.png`` into ``cfg.out_dir``.
    """
    rank = mesh.rank
    torch.manual_seed(cfg.seed)
    if device.type == "cuda":
        torch.cuda.manual_seed_all(cfg.seed)
    model_config = model_config or model_config_for(cfg)
    batch_source = batch_source or data_batches
    out_dir = Path(cfg.out_dir)
    trainer = Trainer(cfg, mesh, device, model_config)
    start_step, state = 0, {}
    if cfg.resume:
        path = resolve_checkpoint(cfg.resume, out_dir)
        state = load_checkpoint(path, trainer.model, trainer.optimizer, trainer.scheduler)
        start_step = int(state["step"])
        log.info("resumed from %s at step %d", path, start_step)
    if rank == 0:  # saves that died half-way (their ranks are gone: this run has not saved yet)
        for stale in remove_stale_tmp(out_dir / "checkpoints"):
            log.warning("removed the incomplete checkpoint %s", stale)
    end_step = cfg.steps if not cfg.stop_after else min(cfg.steps, start_step + cfg.stop_after)
    tokens_per_step = mesh.dp * cfg.batch_size * cfg.grad_accum * cfg.seq_len
    flops_per_step = flops_per_token(model_config, cfg.seq_len) * tokens_per_step
    _barrier()  # rank 0 measures the CPU peak while the other ranks wait idle
    peak = peak_flops_total(cfg, device, mesh.world_size) if rank == 0 else None
    _barrier()
    if rank == 0:
        log.info("model %s: %.2fM parameters; %s; %d tokens per step", cfg.model,
                 num_params(model_config) / 1e6, mesh, tokens_per_step)
    logger = None
    if rank == 0:
        logger = MetricsLogger(out_dir, total_steps=cfg.steps, start_step=start_step,
                               tensorboard=cfg.tensorboard, progress=cfg.progress, append=start_step > 0)
    batches = batch_source(cfg, mesh, start_step * cfg.grad_accum)
    if cfg.resume and state.get("data") is not None and hasattr(batches, "load_state_dict"):
        batches.load_state_dict(state["data"])  # checks the global batch and seed did not change
    mem_fields: dict[str, float] = {}
    if cfg.memory_report:  # collective; a fresh batch iterator, so the training stream is unchanged
        memory = startup_memory_report(trainer, next(batch_source(cfg, mesh, start_step * cfg.grad_accum)))
        mem_fields = metrics_fields(memory)
    records: list[dict[str, Any]] = []
    ckpt_root = out_dir / "checkpoints"
    try:
        for step in range(start_step, end_step):
            _sync(device)
            t0 = time.perf_counter()
            micro = [next(batches) for _ in range(cfg.grad_accum)]
            result = trainer.step(micro)
            _sync(device)
            dt = time.perf_counter() - t0
            record = {
                "step": step + 1, "total_steps": cfg.steps, **result, "step_time_s": dt,
                "tokens_per_s": tokens_per_step / dt, "tflops": flops_per_step / dt / 1e12,
                "mfu": (flops_per_step / dt / peak) if peak else float("nan"),
                "peak_mem_gib": peak_memory_bytes(device) / 2**30, **mem_fields,
            }
            records.append(record)
            if logger is not None and ((step + 1) % cfg.log_interval == 0 or step + 1 == end_step):
                logger.log(record)
            done = step + 1
            if (cfg.ckpt_interval and done % cfg.ckpt_interval == 0) or done == end_step:
                data_state = batches.state_dict() if hasattr(batches, "state_dict") else None
                save_checkpoint(ckpt_root, done, trainer.model, trainer.optimizer, trainer.scheduler,
                                {"micro_step": done * cfg.grad_accum, "data": data_state,
                                 "config": cfg.to_dict(),
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
