"""gpu_check's training sections (``python -m benchmarks.gpu_check``) and its closing summary.

- ``training``: ``Trainer`` on one device for each of ``rows`` (1b at 128K and 7b-gqa at 64K on the GPU) with
  the configuration the planner picks (``loongtrain.plan.search.best_fitting`` with ``modes="auto"`` on the
  device's built-in cluster: checkpointing, and the offload and tiling modes when nothing fits without them),
  then, time allowing, the ``extra`` rows (7b-gqa at 32K under selective recompute, the shape of the first H200
  run). Per row: step seconds after a warm-up step, tokens/s, MFU (model FLOPs, ``loongtrain.train.metrics``),
  peak allocated memory against ``loongtrain.plan.memory_model`` (memory against the planner), and the
  planner's step time, its terms and MFU with the built-in cluster and with the one calibrated from this run's
  rate sections (``loongtrain.plan.calibrate.calibrated``), each ÷ measured.
- ``documents_mfu``: the same for 1b at 64K and 128K on packed documents (lognormal lengths, median 4K and 8K, a
  new mix every step; ``--doc-mask on``): MFU of the visible pairs' FLOPs, and the planner with those documents.
- ``offload``: ``benchmarks/offload.py``'s modes on 1b at 64K, one mode at a time while the budget lasts: each
  mode's step time against its baseline timed right before it, peak memory of both, bytes offloaded per step.

:func:`summary` lists planner ÷ measured for every training row.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from loongtrain.data.synthetic import global_batch
from loongtrain.model.config import ModelConfig, get_preset, step_flops
from loongtrain.parallel.config import ParallelConfig
from loongtrain.parallel.documents import Documents
from loongtrain.plan.document_work import lognormal_documents

SIZES: dict[str, dict[str, Any]] = {
    "gpu": {"rows": (("1b", 131072), ("7b-gqa", 65536)), "extra": (("7b-gqa", 32768, "selective"),),
            "steps": 2, "documents": (("1b", 65536, 4096), ("1b", 131072, 8192)), "offload": ("1b", 65536)},
    "cpu": {"rows": (("tiny", 512),), "extra": (("tiny", 256, "selective"),), "steps": 2,
            "documents": (("tiny", 512, 64), ("tiny", 1024, 128)), "offload": ("cpu-small", 128)},
}


def probe_shapes(kind: str) -> list[tuple]:
    size = SIZES[kind]
    rows = [r[:2] for r in size["rows"] + size["extra"] + size["documents"]] + [size["offload"]]
    dtype = torch.bfloat16 if kind == "gpu" else torch.float32
    return [(dtype, preset(n).head_dim, preset(n).num_heads, preset(n).num_kv_heads, s) for n, s in rows]
CPU_SMALL = ModelConfig(vocab_size=128, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=64)


def preset(name: str) -> ModelConfig:
    """The model of a row: a preset, or the tiny CPU model ``cpu-small``."""
    return CPU_SMALL if name == "cpu-small" else get_preset(name)


SETUP_S = {"gpu": 15.0, "cpu": 0.3}  # building a row's trainer (the model's weights, the optimizer)
CPU_STEP_S = 0.25  # one step of the tiny CPU rows on this project's 2-core machine


def row_estimate_s(ctx, model: ModelConfig, config: ParallelConfig, seq: int, steps: int) -> float:
    """Seconds a training row needs, set-up and ``steps`` steps: on a GPU the planner's step time on the device's
    built-in cluster (1.5x, for the first step's warm-up), on CPU :data:`CPU_STEP_S` a step."""
    if ctx.kind == "cpu":  # this machine's speed varies: the slowest step seen so far in this run counts too
        seen = [r.get("first_step_s", 0.0) for section in ("training", "documents_mfu")
                for r in (ctx.results.get(section) or {}).get("runs", []) if isinstance(r, dict)]
        return SETUP_S["cpu"] + steps * max([CPU_STEP_S, *seen])
    from loongtrain.plan.cost import step_cost

    cost = step_cost(model, config, _cluster(ctx.device), nodes=1, world=1, seq_len=seq)
    return SETUP_S["gpu"] + 1.5 * steps * cost.step_time


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cluster(device: torch.device):
    """The built-in cluster of this device (h200 on CPU, for the planner's figures only)."""
    from loongtrain.plan.cluster import cluster_for_device, load_cluster

    found = cluster_for_device(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    return found or load_cluster("h200")


@contextlib.contextmanager
def one_rank_group(device: torch.device) -> Iterator[None]:
    """A one-rank process group in this process (FSDP2, which the offload modes and some picks need)."""
    owns = not dist.is_initialized()
    if owns:
        backend = "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if owns:
            dist.destroy_process_group()


def doc_batch(step: int, seq: int, vocab: int, median: int) -> dict[str, torch.Tensor]:
    """Random tokens packed into lognormal documents (median ``median``), a new mix every step."""
    batch = global_batch(step, 1, seq, vocab, seed=0)
    starts = torch.zeros(1, seq, dtype=torch.bool)
    starts[0, list(lognormal_documents(seq, median, seed=step))[:-1]] = True
    return {**batch, "doc_starts": starts}


def predictions(ctx, model: ModelConfig, config: ParallelConfig, seq: int, measured_s: float,
                documents: Documents | None = None) -> dict[str, Any]:
    """The planner's step for this row with the built-in cluster and the one calibrated from this run's rates."""
    from loongtrain.plan.calibrate import calibrated
    from loongtrain.plan.cost import Workload, step_cost

    base = _cluster(ctx.device)
    clusters = {"builtin": base}
    try:
        clusters["calibrated"] = calibrated(ctx.results, base, "this run")[0]
    except ValueError as exc:  # no rate sections yet (left out of this run)
        clusters["calibrated_error"] = str(exc)
    out: dict[str, Any] = {}
    for name, cluster in clusters.items():
        if isinstance(cluster, str):
            out[name] = cluster
            continue
        c = step_cost(model, config, cluster, nodes=1, world=1, seq_len=seq, workload=Workload(documents=documents))
        out[name] = {"step_s": c.step_time, "mfu": c.mfu, "terms_s": c.terms, "fits": c.fits,
                     "planner_over_measured": c.step_time / measured_s}
    return out


def train_row(ctx, name: str, seq: int, config: ParallelConfig | None, documents: int = 0) -> dict[str, Any] | None:
    """One training row (module docstring); None when it ran out of time before its first timed step."""
    from loongtrain.attn.kernel_choice import chosen_kernels, refused_kernels
    from loongtrain.launch.config import TrainConfig, run_of
    from loongtrain.model.config import flops_per_token
    from loongtrain.parallel.mesh import single_process_mesh
    from loongtrain.plan.search import best_fitting
    from loongtrain.sections.model import compute_dtype
    from loongtrain.train.metrics import cuda_peak_tflops, measure_cpu_tflops
    from loongtrain.train.trainer import Trainer

    device, size = ctx.device, SIZES[ctx.kind]
    model = preset(name)
    if config is None:
        config = best_fitting(model, _cluster(device), gpus=1, seq_len=seq, modes="auto").config
    if not ctx.enough(row_estimate_s(ctx, model, config, seq, size["steps"] + 1), f"{name} S={seq}"):
        return None  # a row never starts without the time it needs
    cfg = TrainConfig.from_dict(dict(model=name, seq_len=seq, steps=size["steps"] + 1, warmup=1, dtype="auto",
                                     parallel=config, memory_report=False, doc_mask="on" if documents else "off"))
    trainer = Trainer(run_of(cfg, model), single_process_mesh(), device)
    predicted = trainer.predicted_memory(seq_len=seq, batch=1)  # the trainer's own report's mapping
    compute = compute_dtype(cfg.model.dtype, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, flops, docs = [], [], []
    for step in range(size["steps"] + 1):
        batch = doc_batch(step, seq, model.vocab_size, documents) if documents else \
            global_batch(step, 1, seq, model.vocab_size, seed=0)
        if times and not ctx.enough(1.2 * times[-1], f"{name} S={seq} step {step}"):
            break
        _sync(device)
        t0 = time.perf_counter()
        result = trainer.step([batch])
        _sync(device)
        times.append(time.perf_counter() - t0)
        flops.append(step_flops(model, seq, result["attention_pairs"]))
        if documents:
            docs.append(tuple(int(i) for i in batch["doc_starts"][0].nonzero().flatten()) + (seq,))
    if len(times) < 2:
        return None
    timed, step_s = times[1:], statistics.median(times[1:])
    peak = (cuda_peak_tflops(device) or float("nan")) if device.type == "cuda" else measure_cpu_tflops()
    achieved = statistics.median(flops[1:]) / step_s / 1e12
    row: dict[str, Any] = {
        "model": name, "seq_len": seq, "configuration": config.label(), "compute_dtype": str(compute),
        "first_step_s": times[0], "step_s": timed, "tokens_per_s": seq / step_s, "model_tflops": achieved,
        "mfu": achieved / peak,
        "loss": result["loss"], "predicted_memory_gib": {k: v / 2**30 for k, v in predicted.items()},
        "attention_kernels": chosen_kernels(), "refused_kernels": refused_kernels()}
    if documents:
        row["documents_median"] = documents
        row["visible_fraction"] = statistics.median(flops[1:]) / (seq * flops_per_token(model, seq))
    if device.type == "cuda":
        measured = torch.cuda.max_memory_allocated(device)
        row.update(peak_allocated_gib=measured / 2**30, memory_predicted_over_measured=predicted["total"] / measured)
    mix = Documents(tuple(docs[1:2])) if documents else None  # the planner sees one timed step's mix
    row["planner"] = predictions(ctx, model, config, seq, step_s if not documents else timed[0], mix)
    return row


@contextlib.contextmanager
def initial_weights_once() -> Iterator[None]:
    """The rows of one model, in every section, share its seeded initial weights: the trainer's
    ``Transformer(config, seed=...)`` (``loongtrain.train.model_setup``, the unsharded path one device takes) is
    built on the host once per ``(config, seed)`` and copied for each later row (a 7B model's init is tens of
    seconds of host time; the copy, the same values, is a fraction of it). The cache goes when the run ends."""
    import copy

    from loongtrain.train import model_setup

    built: dict[tuple, Any] = {}
    real = model_setup.Transformer

    def shared(config: ModelConfig, seed: int | None = 0, **kw: Any) -> Any:
        if seed is None or kw:
            return real(config, seed=seed, **kw)
        key = (config, seed)
        if key not in built:
            built[key] = real(config, seed=seed)
        return copy.deepcopy(built[key])

    model_setup.Transformer = shared
    try:
        yield
    finally:
        model_setup.Transformer = real
        built.clear()


def _rows(ctx, rows: list[tuple], out: dict[str, Any]) -> None:
    from benchmarks.gpu_check.failures import allocation_failure, release

    for spec in rows:
        name, seq = spec[0], spec[1]
        config = ParallelConfig(recompute=spec[2]) if len(spec) > 2 else None
        if not ctx.enough(0.0, f"{name} S={seq}"):
            continue
        try:
            with one_rank_group(ctx.device):
                row = train_row(ctx, name, seq, config)
        except Exception as exc:  # noqa: BLE001 - an allocation failure is recorded, the next row runs
            if not allocation_failure(exc):
                raise
            ctx.skipped.append(f"{name} S={seq}: allocation failure ({type(exc).__name__}: {str(exc)[:200]})")
            row = None
        finally:
            release(ctx.device)
        if row is not None:
            out["runs"].append(row)
        ctx.flush()


def check_training(ctx) -> dict[str, Any]:
    size = SIZES[ctx.kind]
    capacity = torch.cuda.mem_get_info(ctx.device)[1] if ctx.device.type == "cuda" else 0
    out: dict[str, Any] = {"capacity_gib": capacity / 2**30, "runs": []}
    ctx.results["training"] = out  # written after every row, so a run cut short keeps the finished ones
    _rows(ctx, list(size["rows"]) + list(size["extra"]), out)
    return out


def check_documents_mfu(ctx) -> dict[str, Any]:
    """Packed documents' MFU, a row per length (1b at 64K and 128K on the GPU), the longer only with its time."""
    from benchmarks.gpu_check.failures import allocation_failure, release

    out: dict[str, Any] = {"runs": []}
    ctx.results["documents_mfu"] = out
    for name, seq, median in SIZES[ctx.kind]["documents"]:
        if not ctx.enough(0.0, f"{name} S={seq} documents"):
            continue
        try:
            with one_rank_group(ctx.device):
                row = ctx.attempt(f"{name} S={seq} documents",
                                  lambda name=name, seq=seq, median=median: train_row(ctx, name, seq, None,
                                                                                     documents=median))
        except Exception as exc:  # noqa: BLE001
            if not allocation_failure(exc):
                raise
            row = None
        finally:
            release(ctx.device)
        if row:
            out["runs"].append(row)
        ctx.flush()
    return out


def check_offload(ctx) -> dict[str, Any]:
    """benchmarks/offload.py's side-by-side step times of the memory modes (selective recompute beside each),
    one mode at a time while the section's budget lasts, on a one-rank process group."""
    from benchmarks.offload import MODES, compare_modes

    name, seq = SIZES[ctx.kind]["offload"]
    model = CPU_SMALL if name == "cpu-small" else get_preset(name)
    out: dict[str, Any] = {"model": name, "seq_len": seq, "modes": {}}
    with one_rank_group(ctx.device):
        for mode, opts in MODES.items():
            if not ctx.enough(0.0, mode):
                continue
            result = ctx.attempt(mode, lambda opts=opts, mode=mode: compare_modes(model, seq, ctx.device, rounds=1,
                                                                               modes={mode: opts}))
            if result:
                r = result[mode]
                r["tokens_per_s"], r["baseline_tokens_per_s"] = seq / r["mode_s"], seq / r["baseline_s"]
                out["modes"][mode] = r
            ctx.flush()
    return out


def summary(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Planner ÷ measured step time (and both MFUs) of every training row, with the built-in and the calibrated
    cluster."""
    rows = []
    for section in ("training", "documents_mfu"):
        for run in (results.get(section) or {}).get("runs", []):
            planner = run.get("planner", {})
            rows.append({"section": section, "model": run["model"], "seq_len": run["seq_len"],
                         "configuration": run["configuration"], "measured_step_s": statistics.median(run["step_s"]),
                         "measured_mfu": run["mfu"],
                         **{f"{k}_over_measured": v["planner_over_measured"] for k, v in planner.items()
                            if isinstance(v, dict)},
                         **{f"{k}_mfu": v["mfu"] for k, v in planner.items() if isinstance(v, dict)}})
    return rows
