"""What stops ``--compile`` (docs/compile.md): a missing toolchain, named before any worker starts
(:func:`missing_compiler`), and a compile failure inside a worker, named in one line (:class:`CompileError`:
the block, the op, ``--compile off``), also when it comes from a compiled backward.

A failure is the compiler's (:func:`from_compiler`) when dynamo raised it, or when its innermost frame is in
torch.compile's machinery or in the code inductor generated; an error of an op the compiled code calls (a
collective, a ValueError of an argument check) is not. The block in flight is the one whose forward runs,
or, in backward, the one whose output's gradient arrived last (:func:`mark_backward`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
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


class CompileError(RuntimeError):
    """torch.compile failed on a decoder block (the message names the block, the op, and ``--compile off``).
    A restart would fail the same way: the launcher does not retry it."""

    restartable = False


def missing_compiler(device_type: str, backend: str) -> str | None:
    """What ``torch.compile`` with ``backend`` lacks on ``device_type`` (a sentence), or None. Cheap (no
    torch compilation), the pieces it needs: dynamo on this Python, and for inductor on CPU a C++ compiler
    that builds against Python's headers (``Python.h``: inductor binds each kernel to Python) with OpenMP
    (``omp.h``, ``-fopenmp``, on Linux), checked by compiling a two-line probe; on CUDA Triton, which builds its
    launchers with a C compiler against the same ``Python.h``, and the CPU's C++ compiler with OpenMP as well: a
    compiled block holds CPU ops too (the ``torch.cat`` of the documents' ``cu_seqlens``)."""
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
        if not headers:
            return _no_python_headers()
        missing = _cpu_compiler_missing(headers)  # the block's CPU ops (the documents' cu_seqlens) compile too
        return None if missing is None else f"{missing}, which a compiled block's CPU ops need on CUDA too"
    return _cpu_compiler_missing(headers)


def _cpu_compiler_missing(headers: list[str]) -> str | None:
    """What inductor's C++ (OpenMP) code generation for CPU ops lacks here, or None."""
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
    """Compile ``#include <Python.h>`` and, on Linux, ``#include <omp.h>`` with ``-fopenmp`` (syntax only;
    elsewhere inductor finds OpenMP its own way, e.g. ``-Xclang -fopenmp`` on macOS): the compiler's first
    error line if that fails, else None."""
    omp = sys.platform.startswith("linux")
    source = "#include <Python.h>\n" + ("#include <omp.h>\nint main() { return omp_get_max_threads() > 0 ? 0 : 1; }\n"
                                      if omp else "int main() { return 0; }\n")
    cmd = [compiler, *(["-fopenmp"] if omp else []), "-fsyntax-only", "-x", "c++", *(f"-I{d}" for d in headers), "-"]
    try:
        done = subprocess.run(cmd, input=source, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"the C++ compiler {compiler} did not run ({type(exc).__name__}: {exc})"
    if done.returncode == 0:
        return None
    lines = [ln.strip() for ln in (done.stderr or done.stdout).splitlines() if ln.strip()]
    first = next((ln for ln in lines if "error" in ln.lower()), lines[0] if lines else f"exit {done.returncode}")
    if "omp" in first.lower():
        first = f"it lacks OpenMP (omp.h, -fopenmp; install libgomp or libomp-dev): {first}"
    elif "python.h" in first.lower():
        first = f"it does not find Python.h (install the Python development headers): {first}"
    return f"the C++ compiler {compiler} cannot build inductor's kernels: {first}"


def enter_forward(name: str) -> None:
    """Record ``name`` as the block in flight (its compiled forward runs now)."""
    _IN_FLIGHT.block = name


class _InFlight(threading.local):
    block: str | None = None  # the compiled block whose forward, or (from its output's gradient on) backward, runs


_IN_FLIGHT = _InFlight()


def mark_backward(out: Any, name: str) -> None:
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
