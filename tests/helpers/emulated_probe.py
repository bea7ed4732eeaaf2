"""The kernel probe's process (``python -m loongtrain.attn.probe_process``) over the CPU emulation of the CUDA ops
and of FlashAttention 3/4 (tests/helpers/cuda_emulation.py, flash_emulation.py), for tests:
``python -m tests.helpers.emulated_probe MODE SPECS_JSON``.

``MODE``: ``ok`` (the emulation as it is), a planted fault's name (tests.helpers.cuda_emulation.FAULTS), or a
failure: ``crash`` (cuDNN's varlen backward ends the process with SIGABRT, as a sticky illegal address ends a CUDA
process), ``hang`` (cuDNN's varlen backward never returns), ``oom`` (cuDNN's varlen backward runs out of device
memory), ``noimport`` (the process cannot import what it needs, before anything is checked)."""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from loongtrain.attn import cuda_kernels, probe_process
from tests.helpers.cuda_emulation import EmulatedAten
from tests.helpers.flash_emulation import FlashEmulation, _module


class Failing(EmulatedAten):
    def __init__(self, mode: str) -> None:
        super().__init__(allow_fp64=False)
        self.mode = mode

    def _cudnn_attention_backward(self, *args, **kwargs):
        if self.mode == "crash":
            print("CUDA error: an illegal memory access was encountered", file=sys.stderr, flush=True)
            os.abort()
        if self.mode == "hang":
            time.sleep(600)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 40.00 GiB")


def main(argv: list[str]) -> int:
    mode, specs = argv
    if mode == "noimport":
        raise ModuleNotFoundError("No module named 'flash_attn_3._C'")
    failing = mode in ("crash", "hang", "oom")
    ops = Failing(mode) if failing else EmulatedAten(allow_fp64=False, fault=None if mode == "ok" else mode)
    cuda_kernels._aten = ops  # this process only
    flash = FlashEmulation()
    sys.modules["flash_attn_interface"] = _module("flash_attn_interface", _flash_attn_forward=flash.fa3_forward,
                                                  _flash_attn_backward=flash.fa3_backward)
    for name in ("flash_attn", "flash_attn.cute"):
        sys.modules[name] = _module(name)
    sys.modules["flash_attn.cute.interface"] = _module("flash_attn.cute.interface", _flash_attn_fwd=flash.fa4_fwd,
                                                       _flash_attn_bwd=flash.fa4_bwd)
    cpu = [{**d, "device": "cpu"} for d in json.loads(specs)]  # the emulation computes on CPU tensors
    return probe_process.main([json.dumps(cpu)])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
