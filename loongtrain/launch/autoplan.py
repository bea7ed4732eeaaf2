"""``loongtrain train --plan auto``: the planner's best :class:`~loongtrain.parallel.config.ParallelConfig`
becomes the run's ``cfg.parallel`` (hp, cp, inner_ring, placement, ZeRO and recompute, and the
offload and tiling modes when nothing fits without them). A plan that fits nowhere, on the device or in
the host memory the cluster file states, is a ValueError here, before any worker starts. The
model planned is the one the run trains (:func:`loongtrain.train.model_setup.model_config_for`: a preset, or a
Hugging Face directory's shape).

A ``--seq-len-stages`` is planned for its longest stage; every stage must then suit the chosen layout
and fit by the planner's prediction (:func:`check_stage_memory`, also without ``--plan auto`` where the
cluster is known: :func:`stage_memory_cluster`)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import torch

from loongtrain.model.config import ModelConfig
from loongtrain.model.memory import MemoryTerm
from loongtrain.parallel.runtime import default_device
from loongtrain.plan.calibrate import calibrate
from loongtrain.plan.cluster import Cluster, builtin_clusters, cluster_for_device, load_cluster
from loongtrain.plan.cost import Workload, step_cost
from loongtrain.plan.search import best_fitting
from loongtrain.sections.model import compute_dtype
from loongtrain.sections.stages import run_stages
from loongtrain.train.config import TrainSections
from loongtrain.train.model_setup import model_config_for
from loongtrain.train.stages import check_stage_layouts

log = logging.getLogger("loongtrain.train")

PLAN_CHOICES = ("", "auto")


def planning_cluster(cfg: TrainSections, world: int, under_launcher: bool) -> Cluster:
    """The cluster description for planning: --cluster, else the CUDA device's preset, else this
    machine measured (``loongtrain plan --calibrate``), which only a single launching process may do."""
    if cfg.runtime.cluster != "auto":
        return load_cluster(cfg.runtime.cluster)
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        cluster = cluster_for_device(name)
        if cluster is None:
            raise ValueError(f"--plan auto: no cluster preset for CUDA device {name!r} (presets: "
                             f"{builtin_clusters()}); pass --cluster NAME or a TOML path")
        return cluster
    if under_launcher:
        raise ValueError("--plan auto on CPU under torchrun: every rank would measure on its own and might "
                         "choose differently; pass --cluster (e.g. a file from `loongtrain plan --calibrate`)")
    return calibrate(world=world, threads=1)


def apply_plan(cfg: TrainSections, world: int, *, under_launcher: bool, model_config: ModelConfig | None = None,
               phases: Sequence[MemoryTerm] = ()) -> TrainSections:
    """``cfg`` with ``parallel`` = the planner's best fitting configuration for ``world`` ranks (all of
    it: what the cost model predicted, so --reshard-after-forward and --recompute-fraction take the planner's
    values too); unchanged without --plan. ``model_config``: the run's shape when the caller has it; ``phases``:
    its objective's memory phases (its registry entry's: DPO's reference pass)."""
    if cfg.runtime.plan not in PLAN_CHOICES:
        raise ValueError(f"--plan={cfg.runtime.plan!r} is not one of {PLAN_CHOICES} ('' = use the options as given)")
    if not cfg.runtime.plan:
        return cfg
    cluster = planning_cluster(cfg, world, under_launcher)
    if world > cluster.gpus_per_node and world % cluster.gpus_per_node != 0:
        raise ValueError(f"--plan auto: world size {world} is neither part of one {cluster.name} node nor a whole "
                         f"number of them ({cluster.gpus_per_node} devices each)")
    model = model_config or model_config_for(cfg.model)
    stages = run_stages(cfg.data, cfg.optim.steps)
    longest = stages[-1]  # a --seq-len-stages is planned for its longest stage
    try:
        best = best_fitting(model, cluster, gpus=world, seq_len=longest.seq_len, batch=longest.batch_size,
                            dtype_bytes=_compute_bytes(cfg), modes="auto",
                            workload=Workload(cfg.model.lora_config(), phases=tuple(phases),
                                              deterministic=cfg.optim.deterministic))
    except ValueError as exc:
        raise ValueError(f"--plan auto on {cluster.name}: {exc}") from None
    log.info("--plan auto on %s: %s (predicted step %.3f s, MFU %.1f%%, %.2f GiB per device, %.1f GiB host "
             "per node, bottleneck %s)", cluster.name, best.config.label(), best.step_time, 100 * best.mfu,
             best.memory["total"] / 2**30, best.host_per_node / 2**30, best.bottleneck)
    planned = dataclasses.replace(cfg.replace(plan=""), parallel=best.config)
    if cfg.data.seq_len_stages:  # the other stages on the layout chosen for the longest
        check_stage_layouts(stages, True, planned.parallel, world, model.num_heads, model.num_kv_heads,
                            cfg.model.model)
        check_stage_memory(planned, world, model, cluster)
    return planned


def _compute_bytes(cfg: TrainSections) -> int:
    return compute_dtype(cfg.model.dtype, default_device()).itemsize  # what the trainer will use


def stage_memory_cluster(cfg: TrainSections) -> Cluster | None:
    """The cluster a ``--seq-len-stages``'s stages are checked against without ``--plan auto``:
    ``--cluster`` when given, else the CUDA device's preset; None (no check, logged) on CPU, or on a
    CUDA device without a preset, with ``--cluster auto`` (measuring this machine is ``--plan auto``'s)."""
    if not cfg.data.seq_len_stages:
        return None
    if cfg.runtime.cluster != "auto":
        return load_cluster(cfg.runtime.cluster)
    cluster = cluster_for_device(torch.cuda.get_device_name()) if torch.cuda.is_available() else None
    if cluster is None:
        log.info("--seq-len-stages: the stages' memory is not checked (no cluster preset for this device; "
                 "pass --cluster NAME or a TOML path to check it)")
    return cluster


def check_stage_memory(cfg: TrainSections, world: int, model: ModelConfig, cluster: Cluster | None) -> None:
    """With a ``--seq-len-stages``: every stage fits in device and host memory on ``cluster`` by the
    planner's prediction (:func:`~loongtrain.plan.cost.step_cost` of the run's own layout at the stage's
    length and micro-batch); ValueError naming the stage and the numbers. Nothing without a schedule or a
    cluster."""
    if not cfg.data.seq_len_stages or cluster is None:
        return
    nodes = -(-world // cluster.gpus_per_node)
    for stage in run_stages(cfg.data, cfg.optim.steps):
        cost = step_cost(model, cfg.parallel, cluster, nodes=nodes, world=world, seq_len=stage.seq_len,
                         batch=stage.batch_size, dtype_bytes=_compute_bytes(cfg),
                         workload=Workload(cfg.model.lora_config(), deterministic=cfg.optim.deterministic))
        if cost.fits:
            continue
        device, host = cost.memory["total"] / 2**30, cost.host_per_node / 2**30
        raise ValueError(
            f"--seq-len-stages stage {stage.index + 1} ({stage.seq_len} tokens, batch {stage.batch_size}) does "
            f"not fit on {cluster.name} with {cfg.parallel.label()} on {world} devices: the planner predicts "
            f"{device:.3g} GiB per device ({cluster.usable_memory / 2**30:.3g} usable) and {host:.3g} GiB of host "
            f"memory per node ({cluster.usable_host_memory / 2**30:.3g} usable); shorten the stage, raise hp*cp, "
            f"or try --plan auto")
