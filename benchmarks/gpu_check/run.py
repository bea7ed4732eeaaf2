"""One device check of the GPU path that fits any device loan: exactness, kernel rates, training, the planner.

    python -m benchmarks.gpu_check                                        # a device loan: $OUT/gpu_check.json, 420 s
    python -m benchmarks.gpu_check --out gpu_check.json                   # one GPU, at most --budget-s (420 s)
    python -m benchmarks.gpu_check --out gpu_check.json --sections training,compile
    python -m benchmarks.gpu_check --cpu --budget-s 5 --out /tmp/check.json   # tiny sizes on CPU (the tests)

The sections (:data:`SECTIONS`) run in that order, most wanted first. Each has a budget of its own, a
minimum and a maximum of seconds per device kind: a section starts only when the run has at least its
minimum left and then gets its maximum or what is left, whichever is less; it checks that deadline between
its measurements and records what it left out. A section that does not run is recorded as ``{"skipped":
reason}`` (out of time, or not in ``--sections``). Every deadline decision is recorded with the clock it was
made on (``schedule``: each section's time left, its minimum and maximum, and whether it ran and for how long;
``decisions`` in a section's result: each measurement's need against the time left), so what the run did with
its budget can be checked without timing it. Results go to ``--out`` after every section (and after
every training row), so a run cut short keeps what it measured. A section that fails records its error and
the next one runs, unless it left the device in an error state (a sticky illegal address: every later CUDA call
would fail): then the rest are recorded as skipped with that error, and the results are written; an allocation
failure (out of memory, cuBLAS or cuDNN unable to allocate:
:func:`allocation_failure`) inside a section is recorded with the measurement it hit, the device memory is
released, and the section goes on with its next measurement.

- the first device run's questions (``benchmarks/gpu_check/first.py``): ``environment``, ``kernel_probes``
  (every call shape of the check in one probe process), ``documents_1b``, ``sync_debug``;
- what was built since (``features.py``, ``post.py``): ``moe``, ``gpt_oss``, ``post_training``;
- exactness (``benchmarks/gpu_check/exact.py``): ``kernels``, ``ring``, ``documents``, ``determinism``;
- rates (``benchmarks/gpu_check/rates.py``): ``attention`` (every kernel candidate's forward and backward,
  dense and varlen, at 16K, 64K and 128K, and the ring's kernel at more call sizes and head dims: the rows
  ``loongtrain plan --calibrate-from`` reads), ``matmul`` (the models' GEMM shapes), ``memory_bandwidth``;
- speed (``benchmarks/gpu_check/speed.py``): ``kernel_choice``, ``loss`` (chunked against unchunked),
  ``compile`` (eager against compiled for the whole 1b, with dynamo's graph count);
- training (``benchmarks/gpu_check/train.py``): ``training`` (1b at 128K and 7b-gqa at 64K with the
  configuration the planner picks, memory against the planner, planner ÷ measured step time with the
  shipped cluster and with the one calibrated from this run's rates), ``documents_mfu`` (MFU with packed
  documents), ``offload`` (the offload modes' cost).

The run ends with ``summary``: planner ÷ measured for every training row.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu_check import exact, features, first, post, rates, speed, train
from benchmarks.gpu_check.failures import allocation_failure, device_error, release  # noqa: F401 - API too


@dataclass
class Context:
    """What a section gets: the device, the sizes of its kind (``gpu``/``cpu``), the results so far, this section's
    ``deadline`` (``time.monotonic()``) and ``flush`` (write the results now)."""

    device: torch.device
    kind: str
    results: dict[str, Any]
    deadline: float
    flush: Callable[[], None]
    skipped: list[str] = field(default_factory=list)
    decisions: list[dict[str, Any]] = field(default_factory=list)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def attempt(self, label: str, fn: Callable[[], Any]) -> Any:
        """``fn()``, or None after recording an allocation failure under ``label`` (the memory released)."""
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - only allocation failures are absorbed
            if not allocation_failure(exc):
                raise
            self.skipped.append(f"{label}: allocation failure ({type(exc).__name__}: {str(exc)[:200]})")
            release(self.device)
            return None

    def enough(self, seconds: float, label: str) -> bool:
        """Whether ``seconds`` fit before the deadline (the decision recorded); if not, ``label`` is recorded as left
        out."""
        left = self.left()
        self.decisions.append({"label": label, "need_s": seconds, "left_s": left, "fits": left >= seconds})
        if left >= seconds:
            return True
        self.skipped.append(f"{label}: out of time (section budget, {left:.0f} s left)")
        return False


@dataclass(frozen=True)
class Section:
    name: str
    run: Callable[[Context], dict[str, Any]]
    gpu: tuple[float, float]  # (minimum, maximum) seconds on one H200
    cpu: tuple[float, float]  # the same at the tiny CPU sizes
    always: bool = False  # runs even out of time (cheap, and what every reader of the results needs)


SECTIONS = (  # most wanted first (docs/kernels.md#the-device-check); the sum of the GPU maxima fits a 420 s budget
    Section("environment", first.check_environment, (1, 5), (0.05, 1), always=True),
    Section("kernel_probes", first.check_kernel_probes, (15, 35), (0.2, 1.5)),
    Section("moe", features.check_moe, (10, 20), (1.5, 6)),
    Section("post_training", post.check_post_training, (15, 30), (3, 15)),
    Section("gpt_oss", features.check_gpt_oss, (10, 25), (1, 5)),
    Section("attention", rates.check_attention, (15, 30), (0.3, 3)),
    Section("matmul", rates.check_matmul, (3, 5), (0.1, 2)),
    Section("memory_bandwidth", rates.check_memory_bandwidth, (2, 3), (0.1, 1)),
    Section("training", train.check_training, (40, 60), (0.5, 10)),
    Section("documents_mfu", train.check_documents_mfu, (15, 35), (0.3, 6)),
    Section("kernels", exact.check_kernels, (5, 8), (0.2, 3)),
    Section("documents_1b", first.check_documents_1b, (30, 70), (0.8, 4)),
    Section("ring", exact.check_ring, (3, 5), (0.3, 5)),
    Section("documents", exact.check_documents, (5, 6), (0.3, 5)),
    Section("determinism", exact.check_determinism, (3, 4), (0.1, 2)),
    Section("kernel_choice", speed.check_kernel_choice, (4, 5), (0.2, 3)),
    Section("sync_debug", first.check_sync_debug, (8, 10), (0.01, 0.2)),
    Section("loss", speed.check_loss, (4, 5), (0.2, 3)),
    Section("compile", speed.check_compile, (30, 30), (8, 30)),
    Section("offload", train.check_offload, (8, 9), (0.5, 10)),
)


def process_start() -> float:
    """``time.monotonic()`` when this process started (Linux: from /proc; elsewhere: now), so that the budget
    covers torch's import too."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as up:
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
            uptime = float(up.read().split()[0])
        return time.monotonic() - max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.monotonic()


def run_section(section: Section, ctx: Context) -> dict[str, Any]:
    """One section's result (its error when it failed), with its wall time and what it left out."""
    t0 = time.perf_counter()
    try:
        out = section.run(ctx)
    except Exception as exc:  # noqa: BLE001 - record it and run the next section
        out = {"error": traceback.format_exc()[-2000:], "allocation_failure": allocation_failure(exc)}
    broken = device_error(ctx.device)  # a sticky error (an illegal address): no later CUDA call can succeed
    if broken is None:
        release(ctx.device)
    else:
        out["device_error"] = broken
    if ctx.skipped:
        out["left_out"] = list(ctx.skipped)
    if ctx.decisions:
        out["decisions"] = list(ctx.decisions)
    out["wall_s"] = time.perf_counter() - t0
    return out


def run_sections(args: Any, wanted: list[str], kind: str, device: torch.device, end: float, results: dict[str, Any],
                 flush: Callable[[], None]) -> None:
    """Each section in order, while the budget lasts, its result written as it ends; each decision recorded in
    ``results["schedule"]`` (module docstring)."""
    schedule = results.setdefault("schedule", [])
    broken = None
    for section in SECTIONS:
        least, most = getattr(section, kind)
        left = end - time.monotonic()
        decision = {"section": section.name, "left_s": left, "least_s": least, "most_s": most}
        if section.name not in wanted:
            results[section.name] = {"skipped": "not in --sections"}
            schedule.append({**decision, "ran": False, "why": "not in --sections"})
        elif broken is not None:
            results[section.name] = {"skipped": f"the device is in an error state since an earlier section: {broken}"}
            schedule.append({**decision, "ran": False, "why": "device error"})
        elif left < least and not section.always:
            results[section.name] = {"skipped": f"out of time: {left:.1f} s of --budget-s {args.budget_s:g} left, "
                                                f"the section needs at least {least:g} s"}
            schedule.append({**decision, "ran": False, "why": "out of time"})
        else:
            given = max(0.0, min(most, left))
            schedule.append({**decision, "ran": True, "given_s": given})
            ctx = Context(device, kind, results, time.monotonic() + given, flush)
            results[section.name] = {"running": True}
            results[section.name] = run_section(section, ctx)
            broken = results[section.name].get("device_error")
        print(f"== {section.name}: {json.dumps(results[section.name], default=str)[:1500]}", flush=True)
        flush()


def main(argv: list[str] | None = None, started: float | None = None) -> int:
    """The run (module docstring); ``started``: the ``time.monotonic()`` the budget counts from (the module's
    ``__main__`` passes :func:`process_start`; else the call's own start)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu", action="store_true", help="tiny sizes on CPU (the tests of this script)")
    out_dir = os.environ.get("OUT")  # a device loan's output folder: everything under it comes back
    parser.add_argument("--out", default=str(Path(out_dir) / "gpu_check.json") if out_dir else None,
                        required=not out_dir, help="JSON output path, written after every section (default with $OUT "
                        "set: $OUT/gpu_check.json); the probe verdicts go beside it, in cache/loongtrain/")
    parser.add_argument("--budget-s", type=float, default=420.0, help="wall-time budget of the whole run")
    parser.add_argument("--sections", default=",".join(s.name for s in SECTIONS), help="comma-separated sections")
    args = parser.parse_args(argv)
    if not args.cpu and not torch.cuda.is_available():
        parser.error("no CUDA device: pass --cpu for the tiny CPU run")
    wanted = args.sections.split(",")
    unknown = sorted(set(wanted) - {s.name for s in SECTIONS})
    if unknown:
        parser.error(f"unknown sections {unknown}; valid: {[s.name for s in SECTIONS]}")
    start = time.monotonic() if started is None else started
    end = start + args.budget_s
    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    kind = "cpu" if args.cpu else "gpu"
    results: dict[str, Any] = {"command": " ".join(["python -m benchmarks.gpu_check", *(argv or sys.argv[1:])]),
                               "budget_s": args.budget_s, "started_s": time.monotonic() - start}
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    # the kernel probe's verdicts (loongtrain.attn.probe_batch.default_cache_dir) beside the results, so they come
    # back with them and every section reads the ones the kernel_probes section wrote
    os.environ["XDG_CACHE_HOME"] = str(out_path.parent.resolve() / "cache")

    def flush() -> None:
        out_path.write_text(json.dumps(results, indent=1, default=str))

    with train.initial_weights_once():  # 7b-gqa's and 1b's weights built once for all their rows
        run_sections(args, wanted, kind, device, end, results, flush)
    results["summary"] = train.summary(results)
    results["wall_s"] = time.monotonic() - start
    flush()
    print(f"== summary: {json.dumps(results['summary'], indent=1, default=str)}\n"
          f"wall {results['wall_s']:.1f} s of --budget-s {args.budget_s:g}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
