"""Process launch for ``loongtrain train``: validate in the parent, then run under torchrun or spawn workers.

- Under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` in the environment) this process is one rank: it joins
  the launcher's process group (NCCL on GPUs, gloo otherwise) and trains.
- Otherwise ``--nproc N`` (default: CUDA device count, or ``hp*cp`` without GPUs) local workers are
  started by :func:`loongtrain.parallel.workers.run_local` (NCCL with one GPU per worker, else gloo on
  CPU; workers die with this process). With one worker the run stays in this process without
  torch.distributed.
Every user error is raised as ValueError by :func:`validate_run` (options) and
:func:`loongtrain.launch.preflight.preflight` (corpus, output directory, resume) before any process is
started; then the launcher locks ``--out-dir`` for the run (:class:`loongtrain._files.OutputLock`: a
second run into it exits 2 naming this one). Collectives time out after ``--timeout`` seconds.
``--max-restarts N`` restarts local workers after a failure from the newest checkpoint (``--resume
auto``); under torchrun, its own ``--max-restarts`` does that: rank 0 decides once for the attempt, on
every node, whether it is a restart and which checkpoint every rank resumes from
(:mod:`loongtrain.launch.torchrun`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
import sys
from collections.abc import Iterator

import torch
import torch.distributed as dist

from loongtrain._files import OutputLock
from loongtrain.launch.autoplan import apply_plan, check_stage_memory, stage_memory_cluster
from loongtrain.launch.config import TrainConfig, run_of
from loongtrain.launch.preflight import RunComplete, data_identity, preflight
from loongtrain.launch.torchrun import agree_on_start, lost_nodes_named, process_group_store, under_torchrun
from loongtrain.model.config import ModelConfig
from loongtrain.parallel.mesh import Mesh, destroy_all_meshes, init_mesh
from loongtrain.parallel.runtime import configure_cuda_allocator, default_backend, default_device
from loongtrain.parallel.workers import WorkerError, resolve_backend, run_local
from loongtrain.parallelize.compile import check_compile_run
from loongtrain.parallelize.compile_errors import named_compile_failures
from loongtrain.parallelize.offload import offloaded_blocks
from loongtrain.parallelize.recompute import recomputed_layers
from loongtrain.sections.stages import run_stages
from loongtrain.train.checkpoint import AUTO, RUN_OUTPUT
from loongtrain.train.config import Run, TrainSections
from loongtrain.train.model_setup import build_run_tokenizer, lora_targets, model_config_for
from loongtrain.train.stages import check_stage_layouts
from loongtrain.train.trainer import Trainer

log = logging.getLogger("loongtrain.train")


def world_size_for(cfg: TrainSections) -> int:
    """Ranks of the run: the launcher's WORLD_SIZE, else --nproc, else GPUs or hp*cp."""
    if under_torchrun():
        return int(os.environ["WORLD_SIZE"])
    if cfg.runtime.nproc:
        return cfg.runtime.nproc
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return cfg.parallel.sp


def validate_run(cfg: TrainConfig, world: int, model_config: ModelConfig | None = None) -> ModelConfig:
    """Raise ValueError naming the offending values if ``cfg`` cannot run on ``world`` ranks; returns the
    model's shape (``model_config`` when given, else derived)."""
    cfg.validate()
    model_config = model_config or model_config_for(cfg.model)
    p = cfg.parallel
    # one layout serves every stage of a --seq-len-stages (without one: the run's --seq-len)
    check_stage_layouts(run_stages(cfg.data, cfg.optim.steps), bool(cfg.data.seq_len_stages), p, world,
                        model_config.num_heads, model_config.num_kv_heads, cfg.model.model)
    if p.offload_activations:  # --offload-keep must leave a block to offload (the rule of parallelize's step)
        offloaded_blocks(recomputed_layers(model_config.num_layers, p.recompute_fraction), p.offload_keep)
    check_compile_run(cfg.model.compile, p, default_device().type)  # --compile: a working compiler, composable modes
    lora_targets(cfg.model, model_config)  # --lora: its targets name modules of this model (docs/lora.md)
    if model_config.moe_layers and str(p.mlp_tiles) != "1":  # TiledMLP tiles a dense MLP (docs/moe-and-gpt-oss.md)
        raise ValueError(f"--mlp-tiles {p.mlp_tiles}: {cfg.model.model!r} has experts, whose MLPs run untiled; use "
                         f"--mlp-tiles 1")
    if cfg.model.dtype == "bf16" and not torch.cuda.is_available():
        log.warning("--dtype bf16 on CPU: autocast to bf16 on CPU is slow on most machines")
    return model_config


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record is emitted (not the stream of the first call,
    which may since have been closed or replaced, e.g. by a test's capture)."""

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def setup_logging(rank: int, log_all_ranks: bool) -> None:
    """INFO from rank 0 (or every rank with --log-all-ranks), warnings only from the others; lines carry
    the rank."""
    level = logging.INFO if rank == 0 or log_all_ranks else logging.WARNING
    logger = logging.getLogger("loongtrain")
    logger.setLevel(level)
    handler = next((h for h in logger.handlers if isinstance(h, _StderrHandler)), None)
    if handler is None:
        handler = _StderrHandler()
        logger.addHandler(handler)
        logger.propagate = False
    handler.setFormatter(logging.Formatter(f"%(asctime)s [rank {rank}] %(message)s", "%H:%M:%S"))


def _threads(cfg: TrainSections, world_local: int) -> int:
    if cfg.runtime.threads:
        return cfg.runtime.threads
    if torch.cuda.is_available():
        return max(1, (os.cpu_count() or 1) // max(1, world_local))
    return 1 if world_local > 1 else (os.cpu_count() or 1)


def resolve_run(cfg: TrainConfig, world: int, *, restarted: bool = False) -> Run:
    """Everything the workers need, derived once here before any worker starts: the planned layout, the
    tokenizer, the model's shape, the in-loop evaluations, and the checkpoint to resume
    (:func:`~loongtrain.launch.preflight.preflight`). ValueError for a user error;
    :class:`~loongtrain.launch.preflight.RunComplete` when a restarted job has nothing left to train."""
    run = prepare_run(cfg, world)
    cfg = preflight(run.cfg, world, run.tokenizer, restarted=restarted)
    return dataclasses.replace(run, cfg=cfg, resume=cfg.output.resume, data_identity=data_identity(cfg, run.tokenizer))


def prepare_run(cfg: TrainConfig, world: int) -> Run:
    """:func:`resolve_run` before its file checks: the planned layout, the tokenizer and the model's shape,
    validated for ``world`` ranks, and the in-loop evaluations of ``--eval-tasks``
    (:func:`loongtrain.eval.in_loop.in_loop_evaluations`, checked here). Under torchrun, rank 0 makes the
    file checks and the resume choice for every rank: :func:`loongtrain.launch.torchrun.agree_on_start`."""
    tokenizer = build_run_tokenizer(cfg.model)
    model_config = model_config_for(cfg.model, tokenizer)
    planned = bool(cfg.runtime.plan)
    cfg = apply_plan(cfg, world, under_launcher=under_torchrun(), model_config=model_config,
                     phases=cfg.spec().recipe(cfg).memory())  # the run's own
    validate_run(cfg, world, model_config)
    cfg.spec().check_model(cfg, model_config, tokenizer)  # --objective dpo --ref-model: the policy's architecture
    if not planned:  # --plan auto checked every stage on the cluster it planned for
        check_stage_memory(cfg, world, model_config, stage_memory_cluster(cfg))
    evaluations: tuple = ()
    if cfg.evaluation.tasks():  # built here, above both: train/ cannot import eval/ (imported only when asked for)
        from loongtrain.eval.in_loop import in_loop_evaluations

        evaluations = in_loop_evaluations(cfg, model_config, tokenizer, world)
    return run_of(cfg, model_config, tokenizer=tokenizer, evaluations=evaluations)


@contextlib.contextmanager
def rank_mesh(rank: int, world: int, cfg: TrainSections) -> Iterator[tuple[Mesh, torch.device]]:
    """One rank's set-up for ``cfg``'s layout, shared by training and ``loongtrain eval``: logging, threads,
    the device, the process group (joined here unless the launcher already did; one rank gets its own
    with ``--offload-params``, which FSDP2 needs) and the mesh; yields ``(mesh, device)`` and leaves the
    group it joined and the caller's torch thread count (a one-rank run in the caller's process) on exit."""
    setup_logging(rank, cfg.output.log_all_ranks)
    threads = torch.get_num_threads()
    torch.set_num_threads(_threads(cfg, int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    device = default_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    owns_group = False
    offload_params = cfg.parallel.offload_params
    if (world > 1 or offload_params) and not dist.is_initialized():
        timeout = datetime.timedelta(seconds=cfg.runtime.timeout)
        store = process_group_store(timeout) if under_torchrun() else None  # run_local's workers have a group
        if world == 1 and store is None and "MASTER_ADDR" not in os.environ:
            store = dist.HashStore()  # one rank in this process: nothing to rendezvous with
        dist.init_process_group(default_backend(host_collectives=offload_params), rank=rank, world_size=world,
                                timeout=timeout, store=store)
        owns_group = True
    try:
        p = cfg.parallel
        yield init_mesh(p.hp, p.cp, inner_ring=p.inner_ring, placement=p.placement, interleaved=p.interleaved,
                        timeout=cfg.runtime.timeout), device
    finally:
        if owns_group and dist.is_initialized():
            destroy_all_meshes()
            dist.destroy_process_group()
        torch.set_num_threads(threads)


def run_worker(rank: int, world: int, run: Run) -> list[dict]:
    """One rank: :func:`rank_mesh`, then train. (The worker function of
    :func:`~loongtrain.parallel.workers.run_local`, and the torchrun rank's.)"""
    with rank_mesh(rank, world, run.cfg) as (mesh, device), named_compile_failures():  # --compile: docs/compile.md
        return Trainer(run, mesh, device).train()


def launch(cfg: TrainConfig) -> None:
    """Validate ``cfg`` here, then train (torchrun rank, in-process single worker, or spawned workers)."""
    setup_logging(int(os.environ.get("RANK", 0)), cfg.output.log_all_ranks)
    if configure_cuda_allocator():
        log.info("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (set it yourself to choose otherwise)")
    world = world_size_for(cfg)
    if under_torchrun():  # one start decision for every rank of the attempt, on every node (launch/torchrun.py)
        run = agree_on_start(prepare_run(cfg, world), world)
        if run is not None:
            with lost_nodes_named():
                run_worker(int(os.environ["RANK"]), world, run)
        return
    run = resolve_run(cfg, world)
    with OutputLock(RUN_OUTPUT, run.cfg.output.out_dir):  # one writer of --out-dir (loongtrain._files)
        _launch_local(run, world)


def _launch_local(run: Run, world: int) -> None:
    """The resolved run in this process (one rank) or in local workers."""
    cfg = run.cfg
    if world == 1:
        run_worker(0, 1, run)
        return
    backend = resolve_backend(None, world)
    if backend == "nccl" and cfg.parallel.offload_params:
        backend = default_backend(host_collectives=True)  # FSDP2's CPU shards reduce over gloo
    if backend == "gloo" and torch.cuda.is_available():
        log.warning("%d workers but %d GPUs: training on CPU with gloo (run at most one worker per GPU "
                    "to use them)", world, torch.cuda.device_count())
    log.info("starting %d local workers (hp=%d, cp=%d, dp=%d)", world, cfg.parallel.hp, cfg.parallel.cp,
             world // cfg.parallel.sp)
    _run_local_with_restarts(run, world, backend)


def _run_local_with_restarts(run: Run, world: int, backend: str) -> None:
    """Local workers; after a worker failure, up to ``--max-restarts`` new attempts resume from the newest
    checkpoint (a deterministic failure, e.g. too many NaN steps, fails every attempt alike)."""
    cfg = run.cfg
    for attempt in range(cfg.runtime.max_restarts + 1):
        try:
            # the training stack is imported once, by the fork server (docs/launching.md)
            run_local(run_worker, world, run, backend=backend, threads=None, timeout=None,
                      collective_timeout=cfg.runtime.timeout, heartbeat_timeout=cfg.runtime.heartbeat_timeout,
                      preload=["loongtrain.launch.train_run"])
            return
        except WorkerError as exc:
            if attempt == cfg.runtime.max_restarts:
                raise
            if not exc.restartable:  # a user error, a full disk, NaN training: every attempt fails alike
                log.warning("not restarting: rank %d failed with %s, which a restart cannot fix", exc.rank, exc.error)
                raise
            log.warning("attempt %d of %d failed (%s); restarting from the newest checkpoint",
                        attempt + 1, cfg.runtime.max_restarts + 1, str(exc).splitlines()[0])
            try:
                cfg = preflight(cfg.replace(resume=AUTO, overwrite=False), world, run.tokenizer,
                                restarted=True)
                run = dataclasses.replace(run, cfg=cfg, resume=cfg.output.resume)
            except RunComplete:
                return  # the failure came after the last checkpoint: nothing left to train
