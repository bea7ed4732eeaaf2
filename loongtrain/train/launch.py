"""Process launch for ``loongtrain train``: validate in the parent, then run under torchrun or spawn workers.

- Under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` in the environment) this process is one rank: it joins
  the launcher's process group (NCCL on GPUs, gloo otherwise) and trains.
- Otherwise ``--nproc N`` (default: CUDA device count, or ``hp*cp`` without GPUs) local workers are
  spawned; they meet through a file store in a temporary directory (no port to race for). With
  one worker the run stays in this process without torch.distributed.
Every user error is raised as ValueError by :func:`validate_run` before any process is started.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from loongtrain.attn.api import validate_attention_inputs
from loongtrain.model.config import ModelConfig
from loongtrain.parallel.layout import Layout
from loongtrain.parallel.mesh import Mesh, default_backend, default_device, init_mesh
from loongtrain.parallel.sharding import check_sequence_length
from loongtrain.train.autoplan import apply_plan
from loongtrain.train.checkpoint import resolve_checkpoint
from loongtrain.train.config import TrainConfig
from loongtrain.train.loop import fit, model_config_for
from loongtrain.train.parallelize import memory_config

log = logging.getLogger("loongtrain.train")


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def world_size_for(cfg: TrainConfig) -> int:
    """Ranks of the run: the launcher's WORLD_SIZE, else --nproc, else GPUs or hp*cp."""
    if under_torchrun():
        return int(os.environ["WORLD_SIZE"])
    if cfg.nproc:
        return cfg.nproc
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return cfg.hp * cfg.cp


def validate_run(cfg: TrainConfig, world: int) -> ModelConfig:
    """Raise ValueError naming the offending values if ``cfg`` cannot run on ``world`` ranks."""
    cfg.validate()
    model_config = model_config_for(cfg)
    try:
        layout = Layout(world, cfg.hp, cfg.cp, cfg.window, cfg.placement, cfg.interleaved)
    except ValueError as exc:
        raise ValueError(f"--nproc/world size {world} with --hp {cfg.hp} --cp {cfg.cp}: {exc}") from exc
    try:
        check_sequence_length(cfg.seq_len, cfg.hp, cfg.cp)
    except ValueError as exc:
        raise ValueError(f"--seq-len {cfg.seq_len}: {exc}") from exc
    shape = (cfg.batch_size, cfg.seq_len // layout.sp)
    q = torch.empty(*shape, model_config.num_heads, model_config.head_dim, device="meta")
    kv = torch.empty(*shape, model_config.num_kv_heads, model_config.head_dim, device="meta")
    try:
        validate_attention_inputs(q, kv, kv, Mesh(layout=layout, rank=0))
    except ValueError as exc:
        raise ValueError(f"model {cfg.model!r} with --hp {cfg.hp} --cp {cfg.cp}: {exc}") from exc
    memory_config(cfg).shard_size(world)  # ValueError for bad --zero/--ac-* values
    if cfg.resume:
        resolve_checkpoint(cfg.resume, Path(cfg.out_dir))  # ValueError when there is nothing to resume
    if cfg.dtype == "bf16" and not torch.cuda.is_available():
        log.warning("--dtype bf16 on CPU: autocast to bf16 on CPU is slow on most machines")
    return model_config


def setup_logging(rank: int, log_all_ranks: bool) -> None:
    """INFO from rank 0 (or every rank with --log-all-ranks), warnings only from the others."""
    level = logging.INFO if rank == 0 or log_all_ranks else logging.WARNING
    logger = logging.getLogger("loongtrain")
    logger.setLevel(level)
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"%(asctime)s [rank {rank}] %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
        logger.propagate = False


def _threads(cfg: TrainConfig, world_local: int) -> int:
    if cfg.threads:
        return cfg.threads
    if torch.cuda.is_available():
        return max(1, (os.cpu_count() or 1) // max(1, world_local))
    return 1 if world_local > 1 else (os.cpu_count() or 1)


def run_worker(cfg: TrainConfig, model_config: ModelConfig, rank: int, world: int,
               init_method: str | None = None) -> list[dict]:
    """One rank: join the process group, build the mesh, train, leave."""
    setup_logging(rank, cfg.log_all_ranks)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    torch.set_num_threads(_threads(cfg, local_world))
    device = default_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    owns_group = False
    if world > 1 and not dist.is_initialized():
        kwargs = {"init_method": init_method} if init_method else {}
        dist.init_process_group(default_backend(), rank=rank, world_size=world, **kwargs)
        owns_group = True
    try:
        mesh = init_mesh(cfg.hp, cfg.cp, window=cfg.window, placement=cfg.placement,
                         interleaved=cfg.interleaved)
        return fit(cfg, mesh, device, model_config=model_config)
    finally:
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()


def _spawned(local_rank: int, cfg: TrainConfig, model_config: ModelConfig, world: int,
             init_method: str) -> None:
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world))
    run_worker(cfg, model_config, local_rank, world, init_method)


def launch(cfg: TrainConfig) -> None:
    """Validate ``cfg`` here, then train (torchrun rank, in-process single worker, or spawned workers)."""
    setup_logging(int(os.environ.get("RANK", 0)), cfg.log_all_ranks)
    world = world_size_for(cfg)
    cfg = apply_plan(cfg, world, under_launcher=under_torchrun())
    model_config = validate_run(cfg, world)
    if under_torchrun():
        run_worker(cfg, model_config, int(os.environ["RANK"]), world)
        return
    if world == 1:
        run_worker(cfg, model_config, 0, 1)
        return
    import torch.multiprocessing as mp

    log.info("spawning %d local workers (hp=%d, cp=%d, dp=%d)", world, cfg.hp, cfg.cp,
             world // (cfg.hp * cfg.cp))
    with tempfile.TemporaryDirectory(prefix="loongtrain-") as tmp:
        init_method = Path(tmp, "store").resolve().as_uri()
        # forkserver: torch is imported once in the server and every worker forks from it (a fresh
        # interpreter per worker, like spawn, without paying the import N times; safe with CUDA).
        mp.get_context("forkserver").set_forkserver_preload(["torch", "loongtrain.train.launch"])
        mp.start_processes(_spawned, args=(cfg, model_config, world, init_method), nprocs=world,
                           join=True, start_method="forkserver")
