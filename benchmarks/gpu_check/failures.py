"""gpu_check's allocation failures: what counts as the device running out of memory, and freeing what a
measurement left, shared by its sections (``benchmarks/gpu_check/run.py`` records a failure and goes on)."""

from __future__ import annotations

import gc

import torch

#: words of an allocation failure in a RuntimeError's message (CUDA, cuBLAS, cuDNN)
ALLOCATION_WORDS = ("out of memory", "alloc_failed", "cublas_status_alloc", "cudnn_status_alloc",
                    "failed to allocate", "cannot allocate")


def allocation_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is the device running out of memory: ``torch.OutOfMemoryError``, or a RuntimeError whose
    message says an allocation failed (cuBLAS's ``CUBLAS_STATUS_ALLOC_FAILED``, cuDNN's
    ``CUDNN_STATUS_ALLOC_FAILED``, "out of memory")."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(word in str(exc).lower() for word in ALLOCATION_WORDS)


def release(device: torch.device) -> None:
    """Free what a failed or finished measurement left on a CUDA device: Python garbage (a cycle may hold device
    tensors) and the CUDA allocator's cache. Nothing on CPU: the host's allocator has no cache to empty, and a
    full collection there costs about 0.3 s a call with transformers loaded (the --cpu run makes two dozen)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def device_error(device: torch.device) -> str | None:
    """None when ``device`` still runs work, else the error a synchronisation raises (a CUDA context left with a
    sticky error, e.g. an illegal address: no later call on it can succeed)."""
    if device.type != "cuda":
        return None
    try:
        torch.cuda.synchronize(device)
        return None
    except Exception as exc:  # noqa: BLE001 - whatever the runtime raises is the answer
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
