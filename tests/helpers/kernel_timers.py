"""A stand-in for the kernel choice's timer in the kernel-safety tests."""

from __future__ import annotations


class Timer:
    """``measure(kernel, kind)``: cuDNN (whole or narrowed) twice as fast as anything else (its own ops, on both call
    kinds; per piece it is as slow as the rest)."""

    def __init__(self) -> None:
        self.timed: list[tuple[str, str]] = []

    def __call__(self, kernel, kind):
        self.timed.append((kernel.name, kind))
        own_op = kind == "dense" or kernel.varlen_forward is not None
        return 0.5 if kernel.name in ("cuda_cudnn", "cuda_cudnn_rows2") and own_op else 1.0
