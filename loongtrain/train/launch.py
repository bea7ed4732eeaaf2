"""Process launch for ``loongtrain train``: validate in the parent, then run under torchrun or spawn workers.

- Under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` in the environment) this process is one rank: it joins
  the launcher's process group (NCCL on GPUs, gloo otherwise) and trains.
- Otherwise ``--nproc N`` (default: CUDA device count, or ``hp*cp`` without GPUs) local workers are
  started by :func:`loongtrain.parallel.workers.run_local` (NCCL with one GPU per worker, else gloo on
  CPU; workers die with this process). With one worker the run stays in this process without
  torch.distributed.
Every user error is raised as ValueError by :func:`validate_run` (options) and
:func:`loongtrain.train.preflight.preflight` (corpus, output directory, resume) before any process is
started. Collectives time out after ``--timeout`` seconds. ``--max-restarts N`` restarts local workers
after a failure from the newest checkpoint (``--resume auto``); under torchrun, its own
``--max-restarts`` does that (a restarted attempt defaults to ``--resume auto``: :func:`torchrun_restart`).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from loongtrain.model.config import ModelConfig
from loongtrain.parallel.config import validate_parallel
from loongtrain.parallel.mesh import destroy_all_meshes, init_mesh
from loongtrain.parallel.runtime import default_backend, default_device
from loongtrain.parallel.workers import WorkerError, resolve_backend, run_local
from loongtrain.train.autoplan import apply_plan
from loongtrain.train.checkpoint import AUTO
from loongtrain.train.compile import check_compile_backend
from loongtrain.train.config import TrainConfig
from loongtrain.train.loop import fit, model_config_for
from loongtrain.train.preflight import RunComplete, preflight

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
    return cfg.parallel.sp


def validate_run(cfg: TrainConfig, world: int) -> ModelConfig:
    """Raise ValueError naming the offending values if ``cfg`` cannot run on ``world`` ranks."""
    cfg.validate()
    model_config = model_config_for(cfg)
    p = cfg.parallel
    try:
        validate_parallel(p, world, seq_len=cfg.seq_len, num_heads=model_config.num_heads,
                          num_kv_heads=model_config.num_kv_heads)
    except ValueError as exc:
        raise ValueError(f"--nproc/world size {world}, --hp {p.hp} --cp {p.cp}, --seq-len {cfg.seq_len}, "
                         f"model {cfg.model!r}: {exc}") from exc
    unbuilt = [name for name, off in (("offload_activations", False), ("offload_params", False), ("mlp_tiles", "1"))
               if getattr(p, name) != off]
    if unbuilt:  # the planner knows these modes; the trainer does not run them yet
        raise ValueError(f"--{unbuilt[0].replace('_', '-')} is not supported by the trainer yet")
    check_compile_backend(cfg.compile, default_device().type)  # --compile on without a working compiler: exit 2
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


RUN_ID_FILE = "torchrun_run_id"


def torchrun_restart(cfg: TrainConfig) -> bool:
    """True in a restarted attempt (``TORCHELASTIC_RESTART_COUNT > 0``) of the torchrun job whose first
    attempt passed the checks (it wrote its ``TORCHELASTIC_RUN_ID`` into ``--out-dir``). An attempt that
    follows a user error (exit 2) is not a restart: it fails the same way instead of resuming."""
    if not under_torchrun() or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) == 0:
        return False
    marker = Path(cfg.out_dir, RUN_ID_FILE)
    return marker.is_file() and marker.read_text().strip() == os.environ.get("TORCHELASTIC_RUN_ID")


def torchrun_store(timeout: datetime.timedelta) -> dist.Store | None:
    """The rendezvous store for this torchrun attempt, with keys of its own; None: torch's default.

    torchrun (c10d rendezvous, torch >= 2.4) hands every attempt the same TCPStore server (its agent's,
    ``TORCHELASTIC_USE_AGENT_STORE=True``), and ``env://`` adds no per-attempt prefix. After a restart,
    ranks can then read their peers' gloo addresses of the dead attempt and fail with ``connectFullMesh
    ... Connection refused``. Prefixing the keys with ``TORCHELASTIC_RESTART_COUNT`` keeps attempts apart
    (torchrun's own switch, ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, does the same by using a new store)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_ADDR" not in os.environ:
        return None
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                           timeout=timeout)
    return dist.PrefixStore(f"loongtrain/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", client)


def _threads(cfg: TrainConfig, world_local: int) -> int:
    if cfg.threads:
        return cfg.threads
    if torch.cuda.is_available():
        return max(1, (os.cpu_count() or 1) // max(1, world_local))
    return 1 if world_local > 1 else (os.cpu_count() or 1)


def run_worker(cfg: TrainConfig, model_config: ModelConfig, rank: int, world: int) -> list[dict]:
    """One rank: join the process group (unless the launcher already did), build the mesh, train, leave."""
    setup_logging(rank, cfg.log_all_ranks)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    torch.set_num_threads(_threads(cfg, local_world))
    device = default_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    owns_group = False
    if world > 1 and not dist.is_initialized():
        timeout = datetime.timedelta(seconds=cfg.timeout)
        dist.init_process_group(default_backend(), rank=rank, world_size=world, timeout=timeout,
                                store=torchrun_store(timeout))
        owns_group = True
    try:
        p = cfg.parallel
        mesh = init_mesh(p.hp, p.cp, window=p.window, placement=p.placement, interleaved=p.interleaved,
                         timeout=cfg.timeout)
        return fit(cfg, mesh, device, model_config=model_config)
    finally:
        if owns_group and dist.is_initialized():
            destroy_all_meshes()
            dist.destroy_process_group()


def _local_worker(rank: int, world: int, cfg: TrainConfig, model_config: ModelConfig) -> None:
    """A worker started by :func:`~loongtrain.parallel.workers.run_local` (inside its process group)."""
    run_worker(cfg, model_config, rank, world)


def launch(cfg: TrainConfig) -> None:
    """Validate ``cfg`` here, then train (torchrun rank, in-process single worker, or spawned workers)."""
    setup_logging(int(os.environ.get("RANK", 0)), cfg.log_all_ranks)
    world = world_size_for(cfg)
    cfg = apply_plan(cfg, world, under_launcher=under_torchrun())
    model_config = validate_run(cfg, world)
    try:
        cfg = preflight(cfg, world, restarted=torchrun_restart(cfg))
    except RunComplete as exc:
        log.info("restart %s: the run is complete (%s)", os.environ["TORCHELASTIC_RESTART_COUNT"], exc)
        return
    if under_torchrun() and int(os.environ["RANK"]) == 0 and "TORCHELASTIC_RUN_ID" in os.environ:
        Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)  # this torchrun job owns the directory now
        Path(cfg.out_dir, RUN_ID_FILE).write_text(os.environ["TORCHELASTIC_RUN_ID"] + "\n")
    if under_torchrun():
        run_worker(cfg, model_config, int(os.environ["RANK"]), world)
        return
    if world == 1:
        run_worker(cfg, model_config, 0, 1)
        return
    backend = resolve_backend(None, world)
    if backend == "gloo" and torch.cuda.is_available():
        log.warning("%d workers but %d GPUs: training on CPU with gloo (run at most one worker per GPU "
                    "to use them)", world, torch.cuda.device_count())
    log.info("starting %d local workers (hp=%d, cp=%d, dp=%d)", world, cfg.parallel.hp, cfg.parallel.cp,
             world // cfg.parallel.sp)
    _run_local_with_restarts(cfg, model_config, world, backend)


def _run_local_with_restarts(cfg: TrainConfig, model_config: ModelConfig, world: int, backend: str) -> None:
    """Local workers; after a worker failure, up to ``--max-restarts`` new attempts resume from the newest
    checkpoint (a deterministic failure, e.g. too many NaN steps, fails every attempt alike)."""
    for attempt in range(cfg.max_restarts + 1):
        try:
            # the training stack is imported once, by the fork server (docs/design.md §10)
            run_local(_local_worker, world, cfg, model_config, backend=backend, threads=None, timeout=None,
                      collective_timeout=cfg.timeout, heartbeat_timeout=cfg.heartbeat_timeout,
                      preload=["loongtrain.train.launch"])
            return
        except WorkerError as exc:
            if attempt == cfg.max_restarts:
                raise
            log.warning("attempt %d of %d failed (%s); restarting from the newest checkpoint",
                        attempt + 1, cfg.max_restarts + 1, str(exc).splitlines()[0])
            try:
                cfg = preflight(dataclasses.replace(cfg, resume=AUTO, overwrite=False), world, restarted=True)
            except RunComplete:
                return  # the failure came after the last checkpoint: nothing left to train
