"""The probe process (``python -m loongtrain.attn.probe_process SPECS_JSON``, docs/kernels.md#safety): every
:class:`~loongtrain.attn.kernel_probe.ProbeSpec` it is given checked in order (:func:`check_cases` against fp64,
its reference sized to this device's free memory), each verdict printed as soon as it is known, so that the
parent (:mod:`loongtrain.attn.probe_batch`) can tell which check a crash, a hang or a failure of the process's own
belongs to.

The protocol, one line each on standard output: ``READY`` once torch and the devices are up; per spec ``BEGIN
<key>`` then ``VERDICT <json {"key", "reason"}>``; ``ERROR <json {"key", "error"}>`` when the process cannot go on
for its own reasons (out of memory), after which it ends with :data:`OWN_FAILURE`.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import asdict

import torch

from loongtrain.attn.kernel_probe import ProbeSpec, check_cases
from loongtrain.attn.kernels import Kernel

READY, BEGIN, VERDICT, ERROR = "READY", "BEGIN", "VERDICT", "ERROR"
OWN_FAILURE = 3


def kernels_by_name() -> dict[str, Kernel]:
    """The kernels a probe can name: torch's CUDA kernels, cuDNN narrowed to calls of two or more query rows, and
    FlashAttention 3/4."""
    from loongtrain.attn.cuda_kernels import CUDA_CUDNN_ROWS2, CUDA_KERNELS
    from loongtrain.attn.flash_kernels import FLASH_KERNELS

    return {k.name: k for k in (*CUDA_KERNELS, CUDA_CUDNN_ROWS2, *FLASH_KERNELS)}


def _allocation_failure(exc: BaseException) -> bool:
    words = ("out of memory", "alloc_failed", "failed to allocate", "cannot allocate")
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and any(w in str(exc).lower() for w in words))


def _device_budget(device: torch.device) -> int | None:
    """Bytes the reference may use: a quarter of the device's free memory (None off CUDA)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free // 4


def _device_usable(device: torch.device) -> bool:
    try:
        torch.cuda.synchronize(device)
        return True
    except Exception:  # noqa: BLE001 - a sticky error: this process cannot run another kernel
        return False


def run_specs(specs: Sequence[ProbeSpec], kernels: dict[str, Kernel] | None = None, out=None) -> int:
    """The process's body: check every spec in order, printing the protocol lines (module docstring); returns the
    exit status (0, or :data:`OWN_FAILURE` after an ``ERROR`` line). A kernel that raises gets that as its verdict,
    unless the device is left broken (then its verdict is printed and the process ends, so the caller starts
    another for the rest)."""
    out = out or sys.stdout

    def say(tag: str, payload: str = "") -> None:
        print(f"{tag} {payload}".rstrip(), file=out, flush=True)

    kernels = kernels if kernels is not None else kernels_by_name()
    for device in {torch.device(s.device) for s in specs}:
        if device.type == "cuda":
            torch.empty(1, device=device)  # the context: a device that cannot be used fails here, before READY
    say(READY)
    for spec in specs:
        say(BEGIN, spec.key())
        device = torch.device(spec.device)
        try:
            reason = check_cases(kernels[spec.kernel], spec, device, _device_budget(device))
        except Exception as exc:  # noqa: BLE001 - sorted below: the process's own failure, or the kernel's
            if _allocation_failure(exc):
                say(ERROR, json.dumps({"key": spec.key(), "error": f"{type(exc).__name__}: {str(exc)[:300]}"}))
                return OWN_FAILURE
            reason = f"{spec.kernel} ({spec.kind}) raised {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
            if device.type == "cuda" and not _device_usable(device):
                say(VERDICT, json.dumps({"key": spec.key(), "reason": reason}))
                return 0
        say(VERDICT, json.dumps({"key": spec.key(), "reason": reason}))
    return 0


def spec_json(specs: Sequence[ProbeSpec]) -> str:
    """``specs`` as the process's argument."""
    return json.dumps([asdict(s) for s in specs])


def main(argv: Sequence[str], kernels: dict[str, Kernel] | None = None) -> int:
    """The probe process: ``argv[0]`` a JSON list of :class:`ProbeSpec` (as dicts)."""
    return run_specs([ProbeSpec(**d) for d in json.loads(argv[0])], kernels)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
