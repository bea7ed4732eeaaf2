"""``--compile off|on|auto``: ``torch.compile`` of each decoder block (docs/design.md §13).

:func:`compile_blocks` is the compile step of :func:`loongtrain.wrap.parallelize.parallelize`, after
activation checkpointing and before FSDP2: each block's ``forward`` (already the checkpointed one, if any) is
replaced on the instance by a compiled one, so FSDP2's gather/reshard hooks stay eager around it, parameter
names are unchanged, and Selective Checkpoint++'s policy is traced with the block (the compiler saves the
outputs of the attention ops and recomputes the rest, as in eager). 2D-Attention's communication and ring
run inside the ``torch.ops.loongtrain.*`` custom ops, which stay opaque to the compiler (their fake
implementations give the output shapes); the block compiles to one graph.

Document boundaries (``cu_seqlens``) and the chunk order reach the compiled block as CPU int64 tensors
(:func:`block_inputs`; the boundaries' lengths marked dynamic), never as Python ints: a new document mix or
balanced layout is new data for the same graph, not a new graph. A block compiles at most twice: for its
first inputs, and once more if a batch without documents follows batches with them (or the reverse).

``auto`` compiles on a CUDA device whose name matches :data:`COMPILE_FASTER_ON`, the devices on which a
GPU run (``benchmarks/gpu_check.py``, recorded in ``benchmarks/RESULTS.md``) measured compiled training
faster than eager; it is empty until such a run exists, so ``auto`` is eager everywhere for now. CPU runs
compile only with ``--compile on``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import inspect
import logging
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

log = logging.getLogger("loongtrain.train")

#: the modes of ``--compile`` (module docstring)
COMPILE_MODES = ("off", "on", "auto")

#: CUDA device-name substrings on which a gpu_check run measured compiled blocks faster than eager
#: (benchmarks/RESULTS.md, section "compiled blocks"). Empty: no GPU run has measured it yet, so
#: ``--compile auto`` runs eager everywhere. Add a device here with the run's figures in RESULTS.md.
COMPILE_FASTER_ON: tuple[str, ...] = ()

#: torch.compile backend of the compile step (tests use "aot_eager": the same graphs, no code generation)
BACKEND = "inductor"

_MASK_ARGS = ("cu_seqlens", "chunk_order")


class CompileError(RuntimeError):
    """torch.compile failed on a decoder block (the message names the block, the op, and ``--compile off``).
    A restart would fail the same way: the launcher does not retry it."""

    restartable = False


def compile_enabled(mode: str, device: torch.device) -> bool:
    """Whether ``--compile mode`` compiles on ``device`` (module docstring); ValueError for an unknown mode."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"--compile={mode!r} is not one of {COMPILE_MODES}")
    if mode == "auto":
        if device.type != "cuda":
            return False
        name = torch.cuda.get_device_name(device)
        return any(sub in name for sub in COMPILE_FASTER_ON)
    return mode == "on"


def missing_compiler(device_type: str, backend: str | None = None) -> str | None:
    """What ``torch.compile`` with ``backend`` lacks on ``device_type`` (a sentence), or None. Cheap (no
    torch compilation), the pieces it needs: dynamo on this Python, and for inductor on CPU a C++ compiler
    that builds against Python's headers (``Python.h``: inductor binds each kernel to Python) with OpenMP
    (``omp.h``, ``-fopenmp``), checked by compiling a two-line probe; on CUDA Triton, which builds its
    launchers with a C compiler against the same ``Python.h``."""
    backend = backend or BACKEND
    import torch._dynamo

    if not torch._dynamo.is_dynamo_supported():
        return (f"torch._dynamo does not support Python {sys.version_info.major}.{sys.version_info.minor} with "
                f"torch {torch.__version__}")
    if backend != "inductor":
        return None
    headers = _python_headers()
    if device_type == "cuda":
        if importlib.util.find_spec("triton") is None:
            return "the inductor backend needs Triton on CUDA, and the 'triton' package is not installed"
        cc = [c for c in (os.environ.get("CC"), "clang", "gcc", "cc") if c]
        if not any(shutil.which(c) for c in cc):
            return f"Triton builds its kernel launchers with a C compiler, and none of {cc} is on PATH (install gcc)"
        return None if headers else _no_python_headers()
    from torch._inductor import config as inductor_config

    cxx = inductor_config.cpp.cxx
    names = [c for c in (cxx if isinstance(cxx, (list, tuple)) else (cxx,)) if c] or ["g++"]
    found = next((shutil.which(str(c)) for c in names if shutil.which(str(c))), None)
    if found is None:
        return (f"the inductor backend needs a C++ compiler on CPU, and none of {names} is on PATH "
                f"(install g++ or set CXX)")
    if not headers:
        return _no_python_headers()
    return _probe_compile(found, tuple(headers))


def _python_headers() -> list[str]:
    """The include directories inductor passes for Python's headers that hold ``Python.h`` (none: missing)."""
    dirs = {sysconfig.get_path("include"), sysconfig.get_path("include", scheme="posix_prefix")}
    return sorted(d for d in dirs if d and (Path(d) / "Python.h").is_file())


def _no_python_headers() -> str:
    where = sysconfig.get_path("include")
    return (f"the inductor backend compiles its kernels against Python's C headers, and Python.h is not in "
            f"{where} (install the Python development headers, e.g. python{sys.version_info.major}."
            f"{sys.version_info.minor}-dev)")


@functools.cache
def _probe_compile(compiler: str, headers: tuple[str, ...]) -> str | None:
    """Compile ``#include <Python.h>`` and ``#include <omp.h>`` with ``-fopenmp`` (syntax only): the
    compiler's first error line if that fails, else None."""
    source = "#include <Python.h>\n#include <omp.h>\nint main() { return omp_get_max_threads() > 0 ? 0 : 1; }\n"
    cmd = [compiler, "-fopenmp", "-fsyntax-only", "-x", "c++", *(f"-I{d}" for d in headers), "-"]
    try:
        done = subprocess.run(cmd, input=source, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"the C++ compiler {compiler} did not run ({type(exc).__name__}: {exc})"
    if done.returncode == 0:
        return None
    lines = [ln.strip() for ln in (done.stderr or done.stdout).splitlines() if ln.strip()]
    first = next((ln for ln in lines if "error" in ln.lower()), lines[0] if lines else f"exit {done.returncode}")
    what = "OpenMP (omp.h, -fopenmp; e.g. libgomp or libomp-dev)" if "omp" in first.lower() else "Python.h"
    return (f"the C++ compiler {compiler} cannot build inductor's kernels: it lacks {what}: {first}")


def check_compile_backend(mode: str, device_type: str) -> None:
    """Launcher validation: ValueError naming the missing piece if ``--compile mode`` would compile on
    ``device_type`` and torch cannot (:func:`missing_compiler`)."""
    wants = mode == "on" or (mode == "auto" and device_type == "cuda" and bool(COMPILE_FASTER_ON))
    if mode not in COMPILE_MODES:
        raise ValueError(f"--compile={mode!r} is not one of {COMPILE_MODES}")
    if not wants:
        return
    missing = missing_compiler(device_type)
    if missing is not None:
        raise ValueError(f"--compile {mode}: {missing}; run with --compile off")


def check_compile_options(parallel: Any) -> None:
    """ValueError unless the memory modes of ``parallel`` (a ParallelConfig) compose with compiled blocks:
    activation offload (saved-tensor hooks around each block) and MLP tiles (a Python autograd Function per
    tile) have not been verified under torch.compile, so they run eager only."""
    if parallel.offload_activations:
        raise ValueError("--compile on with --offload-activations is not supported yet: use --compile off")
    if str(parallel.mlp_tiles) != "1":
        raise ValueError(f"--compile on with --mlp-tiles {parallel.mlp_tiles} is not supported yet: use "
                         f"--compile off or --mlp-tiles 1")


def check_compile_run(mode: str, parallel: Any, device_type: str) -> None:
    """The launcher's check of ``--compile`` (before any worker starts): :func:`check_compile_backend`, and
    when it compiles, :func:`check_compile_options`."""
    check_compile_backend(mode, device_type)
    if mode == "on" or (mode == "auto" and device_type == "cuda" and bool(COMPILE_FASTER_ON)):
        check_compile_options(parallel)


def block_inputs(signature: inspect.Signature, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict]:
    """``args, kwargs`` of a block call with ``cu_seqlens`` (a list of per-row CPU int64 tensors, lengths
    marked dynamic) and ``chunk_order`` (one CPU int64 tensor) as tensors, wherever they are passed
    (positionally, by name, or inside ``**kwargs`` as transformers' layers take them)."""
    bound = signature.bind_partial(*args, **kwargs)
    params = signature.parameters
    extra = next((n for n, p in params.items() if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    for name in _MASK_ARGS:
        holder = bound.arguments
        if name not in holder and extra is not None and name in holder.get(extra, {}):
            holder = holder[extra]
        if holder.get(name) is not None:
            holder[name] = _as_tensors(name, holder[name])
    return bound.args, bound.kwargs


def _as_tensors(name: str, value: Any) -> Any:
    if name == "chunk_order":
        return (value if isinstance(value, torch.Tensor) else torch.tensor(list(value))).to("cpu", torch.int64)
    single = isinstance(value, torch.Tensor) and value.dim() == 1
    if not single and value and all(isinstance(x, int) for x in value):
        single = True
    rows = [value] if single else list(value)
    out = []
    for row in rows:
        t = (row if isinstance(row, torch.Tensor) else torch.tensor(list(row))).to("cpu", torch.int64)
        torch._dynamo.maybe_mark_dynamic(t, 0)
        out.append(t)
    return out


def compile_block(block: nn.Module, name: str, backend: str | None = None) -> None:
    """Replace ``block.forward`` by its compiled version (module docstring). The compiled code is cached
    (inductor's caches) under a key that includes :func:`ops_digest`."""
    forward = block.forward
    original = block.__dict__.get("_loongtrain_forward", forward)
    signature = inspect.signature(original)
    compiled = torch.compile(forward, backend=backend or BACKEND)

    def run(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = block_inputs(signature, args, kwargs)
        _IN_FLIGHT.block = name
        try:
            with torch.compiler.config.patch(cache_key_tag=_cache_key_tag()):
                out = compiled(*args, **kwargs)
        except Exception as exc:
            if isinstance(exc, CompileError) or not from_compiler(exc):
                raise
            raise CompileError(compile_failure(name, exc)) from exc
        _mark_backward(out, name)
        return out

    block.forward = run


# --------------------------------------------------------------------------------------------------
# Failures: which block, which op

class _InFlight(threading.local):
    block: str | None = None  # the compiled block whose forward, or (from its output's gradient on) backward, runs


_IN_FLIGHT = _InFlight()


def _mark_backward(out: Any, name: str) -> None:
    """Record ``name`` as the block in flight when the gradient of its output arrives (its backward runs next)."""
    first = out[0] if isinstance(out, (tuple, list)) and out else out
    if isinstance(first, torch.Tensor) and first.requires_grad:
        first.register_hook(functools.partial(_entering_backward, name))


def _entering_backward(name: str, grad: torch.Tensor) -> None:
    _IN_FLIGHT.block = name


#: where torch.compile's own code lives (dynamo, AOT autograd, inductor); its generated code lives in inductor's
#: cache directory
_COMPILER_PACKAGES = tuple(os.path.join("torch", part) + os.sep for part in ("_dynamo", "_functorch", "_inductor"))


def from_compiler(exc: BaseException) -> bool:
    """Whether ``exc`` is a compile failure: raised by dynamo, or from torch.compile's machinery or the code it
    generated (the innermost frame), not by an op the compiled code calls (a collective's failure, a
    ValueError of an op's argument check)."""
    if isinstance(exc, torch._dynamo.exc.TorchDynamoException):
        return True
    if isinstance(exc, ValueError):
        return False
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return False
    filename = tb.tb_frame.f_code.co_filename
    return any(part in filename for part in _COMPILER_PACKAGES) or filename.startswith(_generated_code_dir())


def _generated_code_dir() -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return os.path.join(cache_dir(), "")


@contextlib.contextmanager
def named_compile_failures() -> Iterator[None]:
    """Re-raise a compile failure (:func:`from_compiler`) escaping the body, e.g. from a compiled block's
    backward (``loss.backward()``), as a one-line :class:`CompileError` naming the block in flight, the op and
    ``--compile off``; anything else passes unchanged."""
    try:
        yield
    except Exception as exc:
        if isinstance(exc, CompileError) or not from_compiler(exc):
            raise
        raise CompileError(compile_failure(_IN_FLIGHT.block or "(none in flight)", exc)) from exc


def compile_failure(name: str, exc: BaseException) -> str:
    """One line for a failed compile: the block, the op (the first ``aten.*``/``loongtrain.*`` name in the
    error, else the failing source line) and the way out."""
    text = str(exc)
    op = re.search(r"\b(?:aten|loongtrain|prims)\.\w+(?:\.\w+)?", text)
    where = op.group(0) if op else _user_frame(exc)
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return (f"torch.compile failed on decoder block {name} at op {where}: {type(exc).__name__}: {first}; "
            f"run with --compile off")


def _user_frame(exc: BaseException) -> str:
    stack = getattr(exc, "real_stack", None)
    if stack:
        frame = stack[-1]
        return f"{frame.filename}:{frame.lineno} ({frame.line})"
    return "unknown"


# --------------------------------------------------------------------------------------------------
# The cache key

#: the files whose code the compiled graphs depend on beyond what inductor's cache keys see: the custom ops'
#: schemas and fake implementations (the output strides a compiled graph asserts)
_OPS_SOURCES = ("attn/ops.py", "parallel/comm.py")


@functools.cache
def ops_digest() -> str:
    """A digest of :data:`_OPS_SOURCES`. Inductor's caches key a graph on its ops' names, not on their fake
    implementations: without it, graphs compiled against older fakes would be loaded after an upgrade."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for rel in _OPS_SOURCES:
        digest.update((root / rel).read_bytes())
    return digest.hexdigest()[:16]


def _cache_key_tag() -> str:
    """torch.compile's cache key tag with :func:`ops_digest` added (a tag the user set is kept)."""
    user = torch.compiler.config.cache_key_tag
    ours = f"loongtrain-ops-{ops_digest()}"
    return ours if not user or ours in user else f"{user}+{ours}"


def compile_blocks(model: nn.Module, layers: list[nn.Module], backend: str | None = None) -> list[str]:
    """The compile step: :func:`compile_block` on each decoder block of ``model``; returns their names."""
    names = {id(m): n for n, m in model.named_modules()}
    compiled = []
    for block in layers:
        name = names.get(id(block), type(block).__name__)
        compile_block(block, name, backend)
        compiled.append(name)
    log.info("compiled %d decoder blocks with torch.compile (backend %s)", len(compiled), backend or BACKEND)
    return compiled
