"""``loongtrain eval``'s processes, on ``train``'s launcher (docs/design.md §10, §14): under torchrun this
process is one rank; otherwise ``--nproc`` local workers (:func:`~loongtrain.parallel.workers.run_local`),
or this process alone for one rank. Everything is checked by :func:`~loongtrain.eval.job.prepare` first.

:func:`evaluate` is one rank's evaluation of an already built model (tests call it with their own
models); :func:`run_rank` builds the mesh and the model, evaluates, and rank 0 writes the outputs.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from torch import nn

from loongtrain.eval.job import Job
from loongtrain.eval.passkey import passkey
from loongtrain.eval.position_loss import position_loss
from loongtrain.eval.report import plot, table, write_results
from loongtrain.eval.source import build_model, model_config
from loongtrain.parallel.mesh import Mesh
from loongtrain.parallel.workers import resolve_backend, run_local
from loongtrain.train.config import autocast_dtype
from loongtrain.train.launch import rank_mesh
from loongtrain.train.parallelize import uses_fsdp
from loongtrain.train.torchrun import under_torchrun

log = logging.getLogger("loongtrain.eval")


def evaluate(job: Job, model: nn.Module, mesh: Mesh, device: torch.device) -> list[dict]:
    """The task's rows (passkey cells or position buckets) for ``model`` on ``mesh`` (collective)."""
    o, run = job.options, job.run
    amp = None if uses_fsdp(run.parallel) else autocast_dtype(run, device)  # FSDP2 casts the weights itself
    if o.task == "passkey":
        assert job.tokens is not None
        return passkey(model, job.tokens, job.lengths, o.depths, o.trials, mesh, device, key_digits=o.key_digits,
                       seed=o.seed, amp_dtype=amp)
    return position_loss(model, job.batches, mesh, device, job.lengths[0], amp_dtype=amp, doc_mask=run.doc_mask,
                         position_reset=run.position_reset, chunk_layout=run.chunk_layout,
                         sliding_window=model_config(job.source).sliding_window)


def run_rank(job: Job, rank: int, world: int) -> list[dict]:
    """One rank: the training's own set-up (:func:`~loongtrain.train.launch.rank_mesh`), then build the
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
            "layout": {"world": mesh.world_size, "dp": mesh.dp, "hp": mesh.hp, "cp": mesh.cp, "window": mesh.window},
            "chunk_layout": job.run.chunk_layout, "dtype": job.run.dtype, "doc_mask": job.run.doc_mask,
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
                     timeout=None, collective_timeout=job.run.timeout, heartbeat_timeout=job.run.heartbeat_timeout,
                     preload=["loongtrain.eval.launch"])[0]
