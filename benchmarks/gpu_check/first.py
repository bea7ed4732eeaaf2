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
import time
import warnings
from typing import Any

import torch

from loongtrain.attn import kernel_choice
from loongtrain.attn.kernel_probe import (
    ProbeSpec,
    check_cases,
    current_versions,
    known_bad,
    needs_probe,
    probe_in_subprocess,
)

SIZES: dict[str, dict[str, Any]] = {
    "gpu": {"probe": (128, 4, 16384), "documents": ("1b", 65536, 4096), "sync": ("1b", 8192)},
    "cpu": {"probe": (16, 2, 128), "documents": ("cpu-small", 256, 32), "sync": ("cpu-small", 128)},
}
PROBE_S = {"gpu": 25.0, "cpu": 0.5}  # seconds one probe needs at most (a subprocess on the GPU: torch, CUDA)


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


def check_kernel_probes(ctx) -> dict[str, Any]:
    device, kind = ctx.device, ctx.kind
    head_dim, group, block = SIZES[kind]["probe"]
    dtype = torch.bfloat16
    versions = current_versions()
    where = f"cuda:{device.index or 0}" if device.type == "cuda" else "cpu"
    out: dict[str, Any] = {"dtype": str(dtype), "head_dim": head_dim, "group": group, "block_len": block,
                           "verdicts": {}}
    for kernel in kernel_choice.kernel_candidates(device, dtype, head_dim):
        for call in ("dense", "varlen"):
            if call == "varlen" and kernel.varlen_forward is None:
                continue
            label = f"{call}:{kernel.name}"
            if not ctx.enough(PROBE_S[kind], label):
                continue
            t0 = time.perf_counter()
            reason = known_bad(kernel, call, versions)
            spec = ProbeSpec(kernel.name, call, "bfloat16", head_dim, group, block, where)
            how = "table"
            if reason is None and needs_probe(kernel, versions):
                reason, how = probe_in_subprocess(spec, timeout_s=max(1.0, ctx.left())), "subprocess"
            elif reason is None:
                reason, how = check_cases(kernel, spec, device), "in process"
            out["verdicts"][label] = {"ok": reason is None, "reason": reason, "how": how,
                                      "seconds": time.perf_counter() - t0}
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
        kernels = kernel_choice.kernel_candidates(device, compute, head_dim)
        versions = current_versions()
        for kernel in kernels:
            label = f"eager {kernel.name}"
            if known_bad(kernel, "dense", versions):
                out["rows"][label] = {"skipped": known_bad(kernel, "dense", versions)}
                continue
            verdict = (ctx.results.get("kernel_probes") or {}).get("verdicts", {}).get(f"dense:{kernel.name}")
            if verdict is not None and not verdict["ok"]:
                out["rows"][label] = {"skipped": f"failed its probe: {verdict['reason']}"}
                continue
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
        elif ctx.enough(max(3 * estimate, 1.0), "compiled"):  # compiling costs a few steps' time
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
