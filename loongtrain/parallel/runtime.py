"""What this process runs on: whether torch.distributed is up, the device and the backend to use."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    """True when a default process group exists (torch.distributed available and initialised)."""
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    """Ranks of the default group; 1 without torch.distributed."""
    return dist.get_world_size() if is_distributed() else 1


def rank() -> int:
    """This process's rank in the default group; 0 without torch.distributed."""
    return dist.get_rank() if is_distributed() else 0


def default_device() -> torch.device:
    """The device this process should compute on: its local CUDA device under torchrun, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    return torch.device("cpu")


def default_backend() -> str:
    """NCCL when CUDA devices exist, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"
