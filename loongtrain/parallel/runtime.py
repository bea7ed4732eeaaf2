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


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Host tensor ``t`` on ``device`` without blocking the host: on CUDA through pinned memory and a
    non-blocking copy (torch's pinned-memory cache keeps the block until the copy has run), elsewhere as
    ``t.to(device)``."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def default_device() -> torch.device:
    """The device this process should compute on: its local CUDA device under torchrun, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    return torch.device("cpu")


def default_backend(*, host_collectives: bool = False) -> str:
    """NCCL when CUDA devices exist, gloo otherwise. ``host_collectives``: on CUDA
    ``"cuda:nccl,cpu:gloo"``, so collectives on host tensors work too (``--offload-params``: FSDP2's
    gradient-norm reduction and checkpoints then run on CPU shards)."""
    if not torch.cuda.is_available():
        return "gloo"
    return "cuda:nccl,cpu:gloo" if host_collectives else "nccl"


ALLOC_CONF = "expandable_segments:True"


def configure_cuda_allocator() -> bool:
    """Set ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` for a CUDA run unless the user set an
    allocator configuration (``PYTORCH_CUDA_ALLOC_CONF`` or ``PYTORCH_ALLOC_CONF``): segments grow in
    place instead of fragmenting the cache as long-sequence activations change size (docs/memory.md).
    Must run before the first CUDA allocation (workers inherit it); returns whether it was set."""
    if not torch.cuda.is_available() or "PYTORCH_CUDA_ALLOC_CONF" in os.environ \
            or "PYTORCH_ALLOC_CONF" in os.environ:
        return False
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOC_CONF
    return True
