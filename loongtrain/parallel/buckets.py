"""The gradient buckets of the replicated-weights sync (``--zero none``; docs/memory.md): which
parameters' gradients travel together in one all-reduce.

Pure arithmetic on sizes, so the trainer's sync (``train/sync.py``) and the planner's charge for it use the
same buckets: gradients are listed in the order the backward produces them (the reverse of the model's
parameter order, fixed at set-up so every rank builds the same buckets), and a bucket closes when the next
gradient would take it past :data:`BUCKET_BYTES`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

BUCKET_BYTES = 32 * 1024 * 1024  # bytes of gradients per all-reduce


def gradient_buckets(param_sizes: Sequence[int], bucket_bytes: int = BUCKET_BYTES,
                     kinds: Sequence[Hashable] | None = None) -> list[list[int]]:
    """Consecutive runs of indices into ``param_sizes`` (gradient bytes, in the order the backward produces
    them), each run holding at most ``bucket_bytes`` unless a single gradient is larger (it then travels
    alone). ``kinds`` (e.g. each gradient's dtype): a bucket also closes where the kind changes, since a
    bucket is one flat buffer of one dtype."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be positive")
    if kinds is not None and len(kinds) != len(param_sizes):
        raise ValueError(f"{len(kinds)} kinds for {len(param_sizes)} gradients")
    buckets: list[list[int]] = []
    size = 0
    for i, nbytes in enumerate(param_sizes):
        if nbytes < 0:
            raise ValueError(f"gradient {i} has a negative size ({nbytes} bytes)")
        new_kind = kinds is not None and bool(buckets) and kinds[i] != kinds[buckets[-1][0]]
        if not buckets or new_kind or size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += nbytes
    return buckets
