"""Throughput, MFU, peak memory, and the metric sinks (JSONL; TensorBoard, tqdm, matplotlib if installed).

MFU (model FLOPs utilisation)::

    flops_per_token = 6 * N_matmul + 6 * L * S * H * D       (loongtrain.model.flops_per_token)
    tokens_per_s    = dp * batch_size * grad_accum * seq_len / step_time
    achieved        = flops_per_token * tokens_per_s          (whole job, FLOP/s)
    mfu             = achieved / (num_devices * peak_per_device)

``peak_per_device``: ``--peak-tflops`` when given; else on CUDA the dense bf16 tensor-core peak of
the device by name (:func:`device_peak_tflops`: the cluster presets' ``device_names`` and
``peak_tflops``, then :data:`CUDA_PEAK_TFLOPS` for devices without a preset); on CPU the fp32 matmul throughput
(512 x 512, best of ~0.3 s) that rank 0 measures with the worker's own thread count while the other
ranks wait (one thread per worker when several share a machine), and ``num_devices`` is then the
number of workers that can run at once, ``min(world, os.cpu_count())``. CPU MFU is therefore
relative to what torch's matmul achieves on this machine, not to a datasheet number.
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

from loongtrain.plan.cluster import Cluster, builtin_clusters, load_cluster

log = logging.getLogger("loongtrain.train")

#: the in-loop evaluations' metrics (``eval/passkey/<length>``, ``eval/position_loss/<start>-<end>``)
EVAL_PREFIX = "eval/"

# Dense (no sparsity) bf16 tensor-core peak TFLOP/s of devices WITHOUT a cluster preset, matched by
# substring of the name. Preset devices (A100, H100, H200) take ``peak_tflops`` from their
# loongtrain/plan/clusters/*.toml, where ``device_names`` lists them: each peak is written once.
CUDA_PEAK_TFLOPS: dict[str, float] = {
    "H100 PCIe": 756.0,  # the SXM part is the h100 preset
    "H800": 989.0,
    "GH200": 989.0,
    "B200": 2250.0,
    "A800": 312.0,
    "A10G": 70.0,
    "A10": 125.0,
    "L40S": 362.0,
    "L40": 181.0,
    "L4": 121.0,
    "RTX 4090": 165.0,
    "RTX 3090": 71.0,
    "V100": 125.0,  # fp16
    "T4": 65.0,  # fp16
}


def _preset_clusters() -> list[Cluster]:
    return [load_cluster(name) for name in builtin_clusters()]


def _longest_match(device_name: str, keys: list[str]) -> str | None:
    found = [key for key in keys if key in device_name]
    return max(found, key=len) if found else None


def device_peak_tflops(device_name: str) -> float | None:
    """Dense bf16 peak TFLOP/s of a CUDA device by name: the longest matching key among the presets'
    ``device_names`` and :data:`CUDA_PEAK_TFLOPS`; None when unknown."""
    peaks = {key: c.peak_tflops for c in _preset_clusters() for key in c.device_names}
    peaks.update(CUDA_PEAK_TFLOPS)
    key = _longest_match(device_name, list(peaks))
    return peaks[key] if key is not None else None


def cuda_peak_tflops(device: torch.device) -> float | None:
    """:func:`device_peak_tflops` of a CUDA device; None when unknown."""
    return device_peak_tflops(torch.cuda.get_device_name(device))


def measure_cpu_tflops(dtype: torch.dtype = torch.float32, size: int = 512, seconds: float = 0.3) -> float:
    """Measured matmul TFLOP/s of the calling thread configuration (best of a short loop)."""
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    torch.mm(a, b)
    best = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        for _ in range(4):
            torch.mm(a, b)
        dt = time.perf_counter() - t0
        best = max(best, 4 * 2 * size**3 / dt / 1e12)
    return best


def host_values(tensors: list[torch.Tensor]) -> list[float]:
    """The values of scalar tensors (one device, any dtype) as Python floats, in ONE device-to-host
    transfer (one synchronisation on CUDA) however many there are."""
    return torch.stack([t.detach().to(torch.float64).reshape(()) for t in tensors]).tolist()


#: a step record's values that may stay device tensors until a log step reads them (``Trainer.step``)
DEVICE_VALUES = ("loss", "grad_norm", "attention_pairs", "aux_loss")


def read_device_values(records: list[dict[str, Any]], guard: torch.Tensor | None = None) -> bool:
    """In place, in one :func:`host_values` transfer: each record's :data:`DEVICE_VALUES` still on the device
    become Python numbers (``attention_pairs`` an int); returns the ``guard`` flag read with them (True
    without one). Nothing to read and no guard: no transfer."""
    slots = [(r, key) for r in records for key in DEVICE_VALUES if isinstance(r.get(key), torch.Tensor)]
    tensors = [r[key] for r, key in slots] + ([guard] if guard is not None else [])
    values = host_values(tensors) if tensors else []
    for (r, key), value in zip(slots, values):
        r[key] = int(value) if key == "attention_pairs" else value
    return guard is None or bool(values[-1])


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated CUDA memory of this process, or its peak resident set size on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


class MetricsLogger:
    """Rank 0's sinks: metrics.jsonl (always), TensorBoard and a progress bar when available.

    metrics.jsonl is append-only, never truncated: each run (fresh, resumed or restarted) first appends
    ``{"event": "start", "step": start_step, ...}``; :func:`read_jsonl` then drops the earlier records
    of steps after ``start_step`` (work redone after a resume from an older checkpoint).
    """

    def __init__(self, out_dir: Path, *, total_steps: int, start_step: int, tensorboard: bool,
                 progress: str) -> None:
        self.out_dir = out_dir
        out_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = out_dir / "metrics.jsonl"
        torn = self.jsonl_path.is_file() and not self.jsonl_path.read_bytes().endswith(b"\n")
        self._jsonl = open(self.jsonl_path, "a")  # noqa: SIM115 - closed in close()
        if torn and self.jsonl_path.stat().st_size:  # a run killed mid-line: keep the next line whole
            self._jsonl.write("\n")
        self._jsonl.write(json.dumps({"event": "start", "step": start_step, "time": time.time()}) + "\n")
        self._jsonl.flush()
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(out_dir / "tensorboard"))
            except ImportError:
                log.info("tensorboard is not installed: skipping TensorBoard events")
        show_bar = progress == "on" or (progress == "auto" and sys.stderr.isatty())
        self._bar = None
        if show_bar:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step")
            except ImportError:
                pass
        self._plain = not self._bar

    def log(self, record: dict[str, Any]) -> None:
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        step = record["step"]
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(_tensorboard_tag(key), value, step)
        summary = (
            f"loss {record['loss']:.4f} | lr {record['lr']:.2e} | {record['tokens_per_s']:.0f} tok/s | "
            f"{record['tflops']:.3f} TFLOP/s | MFU {100 * record['mfu']:.1f}% | "
            f"mem {record['peak_mem_gib']:.2f} GiB"
        )
        if "val_loss" in record:
            summary += f" | val_loss {record['val_loss']:.4f}"
        evaluated = {k: v for k, v in record.items() if k.startswith(EVAL_PREFIX)}
        if evaluated:
            summary += " | " + " ".join(f"{k[len(EVAL_PREFIX):]} {v:.3f}" for k, v in evaluated.items())
        if self._bar is not None:
            self._bar.n = step
            self._bar.set_postfix_str(summary, refresh=True)
        else:
            log.info("step %d/%d | %s", step, record["total_steps"], summary)

    def close(self) -> None:
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._bar is not None:
            self._bar.close()


def read_jsonl(path: str | os.PathLike, *, raw: bool = False) -> list[dict[str, Any]]:
    """The step records of a metrics.jsonl file, as the runs that wrote it left them: a ``start`` event at
    step ``s`` drops the earlier records of steps after ``s``; events themselves are not returned.
    ``raw=True``: every line as written (events included). A torn line (a run killed mid-write) is skipped."""
    records: list[dict[str, Any]] = []
    with open(path) as fh:
        for line in fh:
            try:
                record = json.loads(line) if line.strip() else None
            except json.JSONDecodeError:
                log.warning("%s: skipping a torn line %r", path, line[:60])
                continue
            if record is None:
                continue
            if raw:
                records.append(record)
            elif "event" not in record:
                records.append(record)
            elif record["event"] == "start":
                records = [r for r in records if r.get("step", 0) <= record["step"]]
    return records


def _tensorboard_tag(key: str) -> str:
    """``val/loss`` for the validation loss, the in-loop evaluations under their own name (``eval/...``),
    everything else under ``train/``."""
    if key == "val_loss":
        return "val/loss"
    return key if key.startswith(EVAL_PREFIX) else f"train/{key}"


def _pyplot(png_path: Path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("matplotlib is not installed: skipping %s", png_path.name)
        return None
    return plt


def plot_loss_curve(jsonl_path: Path, png_path: Path, *, stages: list[tuple[int, int]] = ()) -> bool:
    """Write the loss curve of ``jsonl_path`` to ``png_path`` (matplotlib); False when unavailable.
    ``stages``: ``(first_step, seq_len)`` of each stage of --seq-len-stages, drawn as a dashed line
    where it begins, labelled with its length."""
    plt = _pyplot(png_path)
    records = read_jsonl(jsonl_path) if plt is not None else []
    if not records:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["step"] for r in records], [r["loss"] for r in records], marker=".", label="train")
    validated = [r for r in records if "val_loss" in r]
    if validated:
        ax.plot([r["step"] for r in validated], [r["val_loss"] for r in validated], marker="o", label="validation")
        ax.legend()
    for first_step, seq_len in stages:
        ax.axvline(first_step + 0.5, color="grey", linestyle="--", linewidth=0.8)
        ax.text(first_step + 0.5, 1.0, f" {size_label(seq_len)}", transform=ax.get_xaxis_transform(), va="top",
                fontsize=8, color="grey")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("training loss" + (" and validation loss" if validated else ""))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return True


def plot_evaluations(jsonl_path: Path, png_path: Path) -> bool:
    """Write the in-loop evaluations of ``jsonl_path`` (``eval/...`` metrics) to ``png_path``: passkey
    retrieval by length and loss by position bucket, against the step. False when there are none or
    matplotlib is unavailable."""
    records = [r for r in read_jsonl(jsonl_path) if any(k.startswith(EVAL_PREFIX) for k in r)]
    plt = _pyplot(png_path) if records else None
    if plt is None:
        return False
    keys = list(dict.fromkeys(k for r in records for k in r if k.startswith(EVAL_PREFIX)))
    tasks = list(dict.fromkeys(k.split("/")[1] for k in keys))
    fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for key in (k for k in keys if k.split("/")[1] == task):
            shown = [r for r in records if key in r]
            ax.plot([r["step"] for r in shown], [r[key] for r in shown], marker="o", label=key.split("/", 2)[2])
        ax.set_xlabel("step")
        ax.set_ylabel("fraction of keys retrieved" if task == "passkey" else "mean loss")
        if task == "passkey":
            ax.set_ylim(-0.05, 1.05)
        ax.set_title("passkey retrieval by length" if task == "passkey" else "loss by position")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return True


def size_label(n: int) -> str:
    """A token count as users write it: ``4096`` -> ``4K``; not a multiple of 1024: the number."""
    return f"{n // 1024}K" if n % 1024 == 0 and n >= 1024 else str(n)


def peak_flops_total(peak_tflops: float, device: torch.device, world: int) -> float | None:
    """Peak FLOP/s of the whole job for MFU (see loongtrain.train.metrics); None when unknown."""
    if peak_tflops > 0:
        per_device = peak_tflops
    elif device.type == "cuda":
        per_device = cuda_peak_tflops(device)
        if per_device is None:
            log.warning("unknown CUDA device %r: pass --peak-tflops for MFU", torch.cuda.get_device_name())
            return None
    else:
        per_device = measure_cpu_tflops()
        log.info("CPU peak for MFU: measured %.4f TFLOP/s per single-thread worker", per_device)
    devices = world if device.type == "cuda" or peak_tflops > 0 else min(world, os.cpu_count() or 1)
    return per_device * 1e12 * devices
