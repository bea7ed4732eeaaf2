"""What the benchmark scripts share. Run each from the repository root as a module,
``python -m benchmarks.NAME [options]`` (nothing here edits ``sys.path``; ``loongtrain`` is the installed
package, and spawned workers re-import the script by its module name).

- :data:`ROOT`: the repository root (benchmark inputs under ``benchmarks/inputs`` and ``benchmarks/results``);
- :func:`add_common`: the arguments several scripts take, with one spelling and meaning each
  (``--rounds``, ``--threads``, ``--device``, ``--dtype``, ``--seed``);
- :func:`setup`: what those arguments imply before a measurement (threads, the device);
- :func:`header`: the line every printed result starts with, so a figure carries its command, date,
  machine and load (this machine's speed drifts by up to 1.5x within minutes: ratios only, docs/design.md
  docs/testing.md).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64, "fp64": torch.float64}


def add_common(parser: argparse.ArgumentParser, *, rounds: int | None = None, threads: int | None = None,
               device: str | None = None, dtype: str | None = None, seed: int | None = None) -> None:
    """Add the shared arguments whose default is given (None: the script does not take it)."""
    if rounds is not None:
        parser.add_argument("--rounds", type=int, default=rounds,
                            help=f"side-by-side rounds; tables give medians and spreads (default {rounds})")
    if threads is not None:
        parser.add_argument("--threads", type=int, default=threads,
                            help=f"torch threads of this process, 0: torch's default (default {threads})")
    if device is not None:
        parser.add_argument("--device", default=device,
                            help=f"cpu, cuda, or auto (cuda when available) (default {device})")
    if dtype is not None:
        parser.add_argument("--dtype", choices=sorted(DTYPES), default=dtype, help=f"(default {dtype})")
    if seed is not None:
        parser.add_argument("--seed", type=int, default=seed, help=f"(default {seed})")


def setup(args: argparse.Namespace) -> torch.device | None:
    """Apply the shared arguments: ``--threads`` (when > 0), and resolve ``--device`` (None without it)."""
    if getattr(args, "threads", 0):
        torch.set_num_threads(args.threads)
    name = getattr(args, "device", None)
    if name is None:
        return None
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device("cuda", 0) if name == "cuda" else torch.device(name)


def header() -> str:
    """``command · date · machine · torch``: the first line of a result (a markdown comment line)."""
    module = Path(sys.argv[0]).stem
    load = "/".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    gpu = f", {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""
    return (f"`python -m benchmarks.{module} {shlex.join(sys.argv[1:])}` · {time.strftime('%Y-%m-%d %H:%M')} · "
            f"{os.cpu_count()} cores, load {load}{gpu} · torch {torch.__version__}")
