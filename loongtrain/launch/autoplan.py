"""``loongtrain train --plan auto``: the planner's best :class:`~loongtrain.parallel.config.ParallelConfig`
becomes the run's ``cfg.parallel`` (hp, cp, window, placement, ZeRO and activation checkpointing, and the
offload and tiling modes when nothing fits without them). A plan that fits nowhere, on the device or in
the host memory the cluster file states, is a ValueError here, before any worker starts. The
model planned is the one the run trains (:func:`loongtrain.train.run_model.model_config_for`: a preset, or a
Hugging Face directory's shape)."""

from __future__ import annotations

import dataclasses
import logging

import torch

from loongtrain.model.config import ModelConfig
from loongtrain.parallel.runtime import default_device
from loongtrain.plan.calibrate import calibrate
from loongtrain.plan.cluster import Cluster, builtin_clusters, cluster_for_device, load_cluster
from loongtrain.plan.search import best_fitting
from loongtrain.train.config import TrainConfig, autocast_dtype, param_dtype
from loongtrain.train.run_model import model_config_for

log = logging.getLogger("loongtrain.train")

PLAN_CHOICES = ("", "auto")


def plan_cluster(cfg: TrainConfig, world: int, under_launcher: bool) -> Cluster:
    """The cluster description for planning: --plan-cluster, else the CUDA device's preset, else this
    machine measured (``loongtrain plan --calibrate``), which only a single launching process may do."""
    if cfg.plan_cluster != "auto":
        return load_cluster(cfg.plan_cluster)
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        cluster = cluster_for_device(name)
        if cluster is None:
            raise ValueError(f"--plan auto: no cluster preset for CUDA device {name!r} (presets: "
                             f"{builtin_clusters()}); pass --plan-cluster NAME or a TOML path")
        return cluster
    if under_launcher:
        raise ValueError("--plan auto on CPU under torchrun: every rank would measure on its own and might "
                         "choose differently; pass --plan-cluster (e.g. a file from `loongtrain plan --calibrate`)")
    return calibrate(world=world, threads=1)


def apply_plan(cfg: TrainConfig, world: int, *, under_launcher: bool,
               model_config: ModelConfig | None = None) -> TrainConfig:
    """``cfg`` with ``parallel`` = the planner's best fitting configuration for ``world`` ranks (all of
    it: what the cost model predicted, so --reshard-after-forward and --ac-fraction take the planner's
    values too); unchanged without --plan. ``model_config``: the run's shape when the caller has it."""
    if cfg.plan not in PLAN_CHOICES:
        raise ValueError(f"--plan={cfg.plan!r} is not one of {PLAN_CHOICES} ('' = use the options as given)")
    if not cfg.plan:
        return cfg
    cluster = plan_cluster(cfg, world, under_launcher)
    if world > cluster.gpus_per_node and world % cluster.gpus_per_node != 0:
        raise ValueError(f"--plan auto: world size {world} is neither part of one {cluster.name} node nor a whole "
                         f"number of them ({cluster.gpus_per_node} devices each)")
    compute_dtype = autocast_dtype(cfg, default_device()) or param_dtype(cfg)  # what the trainer will use
    try:
        best = best_fitting(model_config or model_config_for(cfg), cluster, gpus=world, seq_len=cfg.seq_len,
                            batch=cfg.batch_size, dtype_bytes=compute_dtype.itemsize, modes="auto")
    except ValueError as exc:
        raise ValueError(f"--plan auto on {cluster.name}: {exc}") from None
    log.info("--plan auto on %s: %s (predicted step %.3f s, MFU %.1f%%, %.2f GiB per device, %.1f GiB host "
             "per node, bottleneck %s)", cluster.name, best.config.label(), best.step_time, 100 * best.mfu,
             best.memory["total"] / 2**30, best.host_per_node / 2**30, best.bottleneck)
    return dataclasses.replace(cfg, plan="", parallel=best.config)
