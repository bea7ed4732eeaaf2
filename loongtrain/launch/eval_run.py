"""``loongtrain eval``'s processes, on ``train``'s launcher (docs/launching.md, docs/evaluation.md): under torchrun this
process is one rank; otherwise ``--nproc`` local workers (:func:`~loongtrain.parallel.workers.run_local`),
or this process alone for one rank. Everything is checked by :func:`prepare` first.

:func:`~loongtrain.eval.config.evaluate` is one rank's evaluation of an already built model (tests call it
with their own models); :func:`run_rank` builds the mesh and the model, evaluates, and rank 0 writes the outputs.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from loongtrain.eval.config import EvalConfig, Job, eval_run_config, evaluate, resolve_job
from loongtrain.eval.report import plot, table, write_results
from loongtrain.eval.source import build_model
from loongtrain.launch.autoplan import apply_plan
from loongtrain.launch.torchrun import under_torchrun
from loongtrain.launch.train_run import rank_mesh, world_size_for
from loongtrain.parallel.mesh import Mesh
from loongtrain.parallel.workers import resolve_backend, run_local

log = logging.getLogger("loongtrain.eval")


def prepare(options: EvalConfig) -> Job:
    """Check ``options`` and resolve them into a :class:`~loongtrain.eval.config.Job` in the launcher, before
    any worker starts: the evaluation's run config, then the world size and ``--plan`` as training
    resolves them (ValueError on bad input)."""
    source, lengths, run = eval_run_config(options)
    world = world_size_for(run)
    run = apply_plan(run, world, under_launcher=under_torchrun())
    return resolve_job(options, source, lengths, run, world)


def run_rank(job: Job, rank: int, world: int) -> list[dict]:
    """One rank: the training's own set-up (:func:`~loongtrain.launch.train_run.rank_mesh`), then build the
    model and evaluate; rank 0 writes results.json, the table and the plot."""
    with rank_mesh(rank, world, job.run) as (mesh, device):
        model = build_model(job.source, job.run, mesh, device)
        rows = evaluate(job, model, mesh, device)
        if rank == 0:
            _write(job, rows, mesh)
        return rows


def _write(job: Job, rows: list[dict], mesh: Mesh) -> None:
    out = Path(job.options.out)
    meta = {"model": str(job.source.path), "kind": job.source.kind, "lengths": list(job.lengths),
            "layout": {"world": mesh.world_size, "dp": mesh.dp, "hp": mesh.hp, "cp": mesh.cp,
                       "inner_ring": mesh.inner_ring},
            "chunk_order": job.run.data.chunk_order, "dtype": job.run.model.dtype, "doc_mask": job.run.data.doc_mask,
            "seed": job.options.seed}
    path = write_results(out, job.options.task, rows, meta)
    print(table(job.options.task, rows), flush=True)
    picture = plot(out, job.options.task, rows)
    log.info("wrote %s%s", path, f" and {picture}" if picture else "")


def _local_worker(rank: int, world: int, job: Job) -> list[dict]:
    return run_rank(job, rank, world)


def launch(job: Job) -> list[dict]:
    """Run ``job`` (torchrun rank, in-process single rank, or local workers); rank 0's rows."""
    if under_torchrun():
        return run_rank(job, int(os.environ["RANK"]), job.world)
    if job.world == 1:
        return run_rank(job, 0, 1)
    p = job.run.parallel
    log.info("starting %d local workers (hp=%d, cp=%d, dp=%d)", job.world, p.hp, p.cp, job.world // p.sp)
    return run_local(_local_worker, job.world, job, backend=resolve_backend(None, job.world), threads=None,
                     timeout=None, collective_timeout=job.run.runtime.timeout,
                     heartbeat_timeout=job.run.runtime.heartbeat_timeout,
                     preload=["loongtrain.launch.eval_run"])[0]
