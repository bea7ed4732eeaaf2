"""The kernel probe's process (``python -m loongtrain.attn.kernel_probe``) over the CPU emulation of the CUDA
ops (tests/helpers/cuda_emulation.py), for tests: ``python -m tests.helpers.emulated_probe MODE SPEC_JSON``.

``MODE``: ``ok`` (the emulation as it is), a planted fault's name (tests.helpers.cuda_emulation.FAULTS), or ``crash``:
cuDNN's varlen backward ends the process with SIGABRT, as a sticky illegal address ends a CUDA process."""

from __future__ import annotations

import json
import os
import sys

from loongtrain.attn import cuda_kernels, kernel_probe
from tests.helpers.cuda_emulation import EmulatedAten


class Crashing(EmulatedAten):
    def _cudnn_attention_backward(self, *args, **kwargs):
        print("CUDA error: an illegal memory access was encountered", file=sys.stderr, flush=True)
        os.abort()


def main(argv: list[str]) -> int:
    mode, spec = argv
    ops = Crashing(allow_fp64=False) if mode == "crash" else EmulatedAten(
        allow_fp64=False, fault=None if mode == "ok" else mode)
    cuda_kernels._aten = ops  # this process only
    spec = json.dumps({**json.loads(spec), "device": "cpu"})  # the emulation computes on CPU tensors
    return kernel_probe.main([spec])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
