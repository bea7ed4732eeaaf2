"""gpu_check's first sections (``python -m benchmarks.gpu_check``), the questions a first device run must answer:

- ``environment``: torch, CUDA, cuDNN, Triton, the C/C++ compilers and OpenMP (what ``--compile on`` needs), the
  device, and each dtype's kernel candidates;
- ``kernel_probes``: the kernel safety checks of ``loongtrain.attn.kernel_probe`` for every candidate and call kind
  at the run's shapes: the known-bad table's verdict, else the probe (in a subprocess for a candidate that can
  fault asynchronously, in this process otherwise), each with its seconds;
- ``documents_1b``: 1b at 64K on packed documents, one timed step each: every safe dense kernel pinned
  (flash against cuDNN), then eager against ``--compile on``; the chosen kernels of each row;
- ``sync_debug``: two training steps under ``torch.cuda.set_sync_debug_mode("warn")``, counting the
  synchronising calls (CUDA only).
"""

from __future__ import annotations

import importlib.util
import shutil
import statistics
import sys
import time
import warnings
from typing import Any

import torch

from benchmarks.gpu_check.safety import refusal_rows, safe_kernels
from loongtrain.attn import kernel_choice
from loongtrain.attn.kernel_probe import ProbeSpec, check_cases, current_versions

SIZES: dict[str, dict[str, Any]] = {
    "gpu": {"probe": (128, 4, 16384), "documents": ("1b", 65536, 4096), "sync": ("1b", 8192)},
    "cpu": {"probe": (16, 2, 128), "documents": ("cpu-small", 256, 32), "sync": ("cpu-small", 128)},
}
COMPILE_S = {"gpu": 45.0, "cpu": 1.5}  # compiling 1b's block with inductor (aot_eager on CPU), its first step


def check_environment(ctx) -> dict[str, Any]:
    from loongtrain.parallelize.compile_errors import missing_compiler

    device = ctx.device
    env: dict[str, Any] = {"torch": torch.__version__, "device": str(device), "cuda": torch.version.cuda,
                           "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
                           "triton": _version("triton"), "gcc": shutil.which("gcc"), "g++": shutil.which("g++")}
    if device.type == "cuda":
        env.update(name=torch.cuda.get_device_name(device), capability=list(torch.cuda.get_device_capability(device)))
    if ctx.kind == "gpu" or ctx.left() > 10:  # builds a probe with g++ -fopenmp (seconds)
        env["compile_missing"] = missing_compiler(device.type, "inductor")  # None: inductor builds here
    else:
        env["compile_missing"] = None
        ctx.skipped.append("the C++ compiler's OpenMP probe: out of time (a short --cpu run)")
    env["kernels"] = {str(dt): [k.name for k in kernel_choice.kernel_candidates(device, dt, 128)]
                      for dt in (torch.bfloat16, torch.float16, torch.float32)}
    return env


def _version(module: str) -> str | None:
    if importlib.util.find_spec(module) is None:
        return None
    return getattr(__import__(module), "__version__", "?")


def probe_shapes(kind: str) -> list[tuple]:
    """The call shapes of this module's sections (the 1b model's: documents, sync)."""
    from benchmarks.gpu_check.train import preset

    rows = [SIZES[kind]["documents"][:2], SIZES[kind]["sync"]]
    dtype = torch.bfloat16 if kind == "gpu" else torch.float32
    return [(dtype, preset(name).head_dim, preset(name).num_heads, preset(name).num_kv_heads, seq)
            for name, seq in rows]


def run_shapes(kind: str) -> list[tuple]:
    """Every call shape the check's sections use (each module's ``probe_shapes``), once each."""
    from benchmarks.gpu_check import exact, features, post, rates, speed, train

    shapes = [s for module in (sys.modules[__name__], features, post, rates, train, exact, speed)
              for s in module.probe_shapes(kind)]
    return list(dict.fromkeys(shapes))


def check_kernel_probes(ctx) -> dict[str, Any]:
    """Every candidate's verdict for every call kind at every call shape of this check (:func:`run_shapes`): the
    known-bad table's (refused, or narrowed), else the probe's, all of them in one probe process whose verdicts
    the later sections read from the probe cache; on CPU (nothing to probe) the first shape's cases in this
    process."""
    from loongtrain.attn.kernel_gate import BatchProbe, plan_gate
    from loongtrain.attn.probe_batch import PROBE_TIMEOUT_S, default_cache_dir, probe_batch

    device, versions = ctx.device, current_versions()
    out: dict[str, Any] = {"shapes": [], "table": {}, "verdicts": {}}
    specs: dict[str, Any] = {}
    for dtype, head_dim, heads, kv_heads, seq in run_shapes(ctx.kind):
        out["shapes"].append([str(dtype), head_dim, heads, kv_heads, seq])
        candidates = kernel_choice.kernel_candidates(device, dtype, head_dim)
        if device.type != "cuda":
            if not out["verdicts"]:  # CPU: the cases of the first shape, in process
                for kernel in candidates:
                    spec = ProbeSpec(kernel.name, "dense", str(dtype).removeprefix("torch."), head_dim, heads,
                                     kv_heads, min(seq, 128), "cpu")
                    t0 = time.perf_counter()
                    reason = check_cases(kernel, spec, device)
                    out["verdicts"][spec.key()] = {"ok": reason is None, "reason": reason, "how": "in process",
                                                   "seconds": time.perf_counter() - t0}
            continue
        plan = plan_gate(candidates, versions)
        out["table"].update({f"{k} {dtype} d{head_dim}": v for k, v in {**plan.refused, **plan.narrowed}.items()})
        probe = BatchProbe(device, dtype, head_dim, heads, kv_heads, seq, versions)
        specs.update({probe.spec(k, kind).key(): probe.spec(k, kind) for k, kind in plan.asked})
    if specs:
        t0 = time.perf_counter()
        verdicts = probe_batch(list(specs.values()), versions, cache_dir=default_cache_dir(),
                               timeout_s=min(PROBE_TIMEOUT_S, max(1.0, ctx.left())))
        out["probe_s"], out["specs"] = time.perf_counter() - t0, len(specs)
        out["verdicts"].update({key: {"ok": reason is None, "reason": reason, "how": "probe process"}
                                for key, reason in verdicts.items()})
    return out


def _timed_steps(trainer, batches: list[dict[str, torch.Tensor]], device: torch.device) -> list[float]:
    times = []
    for batch in batches:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        trainer.step([batch])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return times


def _trainer(name: str, seq: int, device: torch.device, compile: str = "off"):
    from benchmarks.gpu_check.train import preset
    from loongtrain.launch.config import TrainConfig, run_of
    from loongtrain.parallel.config import ParallelConfig
    from loongtrain.parallel.mesh import single_process_mesh
    from loongtrain.train.trainer import Trainer

    model = preset(name)
    named = {} if name == "cpu-small" else {"model": name}  # cpu-small: no preset, the default model's name
    cfg = TrainConfig.from_dict(dict(**named, seq_len=seq, steps=100, warmup=1, dtype="auto", doc_mask="on",
                                     compile=compile,
                      parallel=ParallelConfig(recompute="selective"), memory_report=False))
    return model, Trainer(run_of(cfg, model), single_process_mesh(), device)


def check_documents_1b(ctx) -> dict[str, Any]:
    """Module docstring. A row starts only with its estimate left: the first row's own time, times its steps."""
    from benchmarks.gpu_check.train import doc_batch, one_rank_group

    name, seq, median = SIZES[ctx.kind]["documents"]
    device = ctx.device
    out: dict[str, Any] = {"model": name, "seq_len": seq, "documents_median": median, "rows": {}}
    estimate = first_row_s(ctx, name, seq)
    with one_rank_group(device):
        from loongtrain.sections.model import compute_dtype

        model, trainer = _trainer(name, seq, device)
        compute = compute_dtype(trainer.cfg.model.dtype, device)
        head_dim, heads, kv_heads = model.head_dim, model.num_heads, model.num_kv_heads
        batches = [doc_batch(step, seq, model.vocab_size, median) for step in range(2)]
        kernels, refused = safe_kernels(device, compute, head_dim, heads, kv_heads, seq)
        out.update(refusal_rows(refused))
        for kernel in kernels:
            label = f"eager {kernel.name}"
            if not ctx.enough(estimate, label):  # the planner's estimate, then the last row's own time
                continue
            kernel_choice.clear_choices()
            kernel_choice.pin_kernel(kernel, device, compute, head_dim, heads, kv_heads, seq)
            times = ctx.attempt(label, lambda trainer=trainer: _timed_steps(trainer, batches, device))
            if times:
                out["rows"][label] = {"step_s": times, "tokens_per_s": seq / min(times),
                                      "attention_kernels": kernel_choice.chosen_kernels()}
                estimate = max(estimate, sum(times))
            ctx.flush()
        kernel_choice.clear_choices()
        trainer = None  # its memory back before the compiled one is built
        compile_missing = (ctx.results.get("environment") or {}).get("compile_missing")
        if compile_missing:
            out["rows"]["compiled"] = {"skipped": f"--compile on cannot build here: {compile_missing}"}
        elif ctx.enough(estimate + COMPILE_S[ctx.kind], "compiled"):  # its compilation, then its steps
            from loongtrain.parallelize import compile as compile_step

            before = compile_step.BACKEND
            compile_step.BACKEND = before if device.type == "cuda" else "aot_eager"  # CPU: the same graphs, fast
            try:
                _, compiled = _trainer(name, seq, device, compile="on")
                times = ctx.attempt("compiled", lambda: _timed_steps(compiled, batches, device))
            finally:
                compile_step.BACKEND = before
            if times:
                eager = [r["step_s"][-1] for r in out["rows"].values() if "step_s" in r]
                out["rows"]["compiled"] = {"step_s": times, "tokens_per_s": seq / times[-1],
                                           "eager_over_compiled": statistics.median(eager) / times[-1] if eager
                                           else None, "attention_kernels": kernel_choice.chosen_kernels()}
    return out


def first_row_s(ctx, name: str, seq: int) -> float:
    """What the first row needs: building the model and two steps (the planner's estimate)."""
    from benchmarks.gpu_check.train import preset, row_estimate_s
    from loongtrain.parallel.config import ParallelConfig

    return row_estimate_s(ctx, preset(name), ParallelConfig(recompute="selective"), seq, steps=2)


def check_sync_debug(ctx) -> dict[str, Any]:
    """Module docstring; on CPU a record of why not."""
    if ctx.device.type != "cuda":
        return {"skipped": "no CUDA device: torch.cuda.set_sync_debug_mode is CUDA's"}
    from benchmarks.gpu_check.train import doc_batch, one_rank_group

    name, seq = SIZES[ctx.kind]["sync"]
    with one_rank_group(ctx.device):
        model, trainer = _trainer(name, seq, ctx.device)
        batches = [doc_batch(step, seq, model.vocab_size, 1024) for step in range(3)]
        _timed_steps(trainer, batches[:1], ctx.device)  # the first step: kernel choice, allocator warm-up
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                times = _timed_steps(trainer, batches[1:], ctx.device)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message).splitlines()[0][:200] for w in caught if "synchroniz" in str(w.message)]
    return {"model": name, "seq_len": seq, "steps": 2, "step_s": times, "syncs": len(syncs),
            "syncs_per_step": len(syncs) / 2, "first": sorted(set(syncs))[:10]}
