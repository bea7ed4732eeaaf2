"""Which of a call's kernel candidates may run here (docs/kernels.md#safety), before any is timed: the known-bad
table (a whole refusal, or a narrowing to the call shapes the bug cannot reach), then the probe's verdicts, all
checked in one probe process (:class:`BatchProbe`), merged over the ranks; and the reference kernel only at lengths
the device holds.

:func:`gate` gives a :class:`Gate`: the candidates each call kind may use (``dense``; ``varlen``, the varlen ops;
``window``, a windowed kernel's own window argument) and the refusals with their one line of why.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from loongtrain.attn.cuda_kernels import CUDA_CUDNN_ROWS2
from loongtrain.attn.kernel_probe import (
    PROBE_MAX_BLOCK,
    ProbeSpec,
    Versions,
    known_bad,
    narrowing,
    needs_probe,
    probe_heads,
)
from loongtrain.attn.kernels import REFERENCE, Kernel
from loongtrain.attn.probe_batch import PROBE_COMMAND, ProbeError, default_cache_dir, probe_batch
from loongtrain.parallel.runtime import is_distributed

log = logging.getLogger(__name__)

Probe = Callable[[Kernel, str], "str | None"]
#: the narrowed forms the table's ``max_rows`` entries name: (kernel, max rows) -> the kernel that sends those calls
#: to the rule's kernel (the probe process builds the same by name)
NARROWED = {("cuda_cudnn", 1): CUDA_CUDNN_ROWS2}
REFERENCE_SHARE = 4  # the reference kernel may use at most 1/4 of the device's memory for one call's scores


def length_bucket(seq_len: int) -> int:
    """The power of two at or above ``seq_len``: choices and probe verdicts are kept per bucket of block lengths,
    so a short first stage of a length schedule does not fix the kernel of a long one."""
    return 1 << max(0, int(seq_len) - 1).bit_length()


class NoSafeKernel(RuntimeError):
    """No fused kernel may run this call here, and the reference kernel cannot hold its length."""


class BatchProbe:
    """``probe(kernel, kind) -> reason or None`` through :func:`~loongtrain.attn.probe_batch.probe_batch` at one
    call's shapes (the head counts of :func:`~loongtrain.attn.kernel_probe.probe_heads`, blocks of the length
    bucket, at most :data:`~loongtrain.attn.kernel_probe.PROBE_MAX_BLOCK`); :meth:`prefetch` checks many pairs in
    one probe process. ``cache_dir``: the verdicts' files (None: the user's cache,
    :func:`~loongtrain.attn.probe_batch.default_cache_dir`)."""

    def __init__(self, device: torch.device, dtype: torch.dtype, head_dim: int, num_heads: int, num_kv_heads: int,
                 seq_len: int, versions: Versions, cache_dir: Path | None = None,
                 command: Sequence[str] = PROBE_COMMAND) -> None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.where, self.dtype, self.head_dim = f"cuda:{index}", str(dtype).removeprefix("torch."), head_dim
        self.heads, self.kv_heads = probe_heads(num_heads, num_kv_heads)
        self.block = min(length_bucket(seq_len), PROBE_MAX_BLOCK)
        self.versions = versions
        self.cache_dir = cache_dir if cache_dir is not None else default_cache_dir()
        self.command = tuple(command)
        self.verdicts: dict[str, str | None] = {}

    def spec(self, kernel: Kernel, kind: str) -> ProbeSpec:
        return ProbeSpec(kernel.name, kind, self.dtype, self.head_dim, self.heads, self.kv_heads, self.block,
                         self.where)

    def prefetch(self, pairs: list[tuple[Kernel, str]]) -> None:
        specs = [self.spec(k, kind) for k, kind in pairs if self.spec(k, kind).key() not in self.verdicts]
        if specs:
            self.verdicts.update(probe_batch(specs, self.versions, self.command, cache_dir=self.cache_dir))

    def __call__(self, kernel: Kernel, kind: str) -> str | None:
        key = self.spec(kernel, kind).key()
        if key not in self.verdicts:
            self.prefetch([(kernel, kind)])
        return self.verdicts[key]


@dataclass
class Gate:
    """The safe candidates per call kind (``dense``: the kernels, a narrowed form in place of its kernel; ``varlen``:
    the kernels whose varlen op may run; ``window``: the kernels whose window argument may), the refusals
    (``kind:name`` -> why) and the narrowings (``kind:name`` -> why)."""

    dense: list[Kernel]
    varlen: list[Kernel]
    window: set[str]
    refused: dict[str, str] = field(default_factory=dict)
    narrowed: dict[str, str] = field(default_factory=dict)


def _kinds(kernel: Kernel) -> list[str]:
    return ["dense"] + (["varlen"] if kernel.varlen_forward is not None else []) + (
        ["window"] if kernel.windowed else [])


@dataclass
class GatePlan:
    """What the table decides for a call's candidates before anything runs: the kernels to judge (a narrowed form
    in place of its kernel's dense calls), the (kernel, kind) pairs the probe must check, the table's refusals and
    narrowings (``kind:name`` -> why)."""

    kernels: list[Kernel]
    asked: list[tuple[Kernel, str]]
    refused: dict[str, str]
    narrowed: dict[str, str]


def plan_gate(candidates: list[Kernel], versions: Versions) -> GatePlan:
    """The table's part of :func:`gate` (no probe, no communication)."""
    kernels: list[Kernel] = []
    refused: dict[str, str] = {}
    narrowed: dict[str, str] = {}
    for kernel in candidates:
        narrow = narrowing(kernel, "dense", versions)
        if narrow is not None and (kernel.name, narrow[0]) in NARROWED:
            narrowed[f"dense:{kernel.name}"] = narrow[1]
            kernels.append(NARROWED[(kernel.name, narrow[0])])
        kernels.append(kernel)  # a narrowed kernel's own dense calls are not judged (nor run); its varlen op is
    asked = []
    for k in kernels:
        for kind in _kinds(k):
            if kind == "dense" and f"dense:{k.name}" in narrowed:
                continue
            reason = known_bad(k, kind, versions)
            if reason is not None:
                refused[f"{kind}:{k.name}"] = reason
            elif needs_probe(k, kind, versions):
                asked.append((k, kind))
    return GatePlan(kernels, asked, refused, narrowed)


def gate(candidates: list[Kernel], versions: Versions, probe: Probe) -> Gate:
    """The candidates' verdicts (module docstring), checked with ``probe`` (all at once when it can ``prefetch``)
    and merged over the ranks (collective when distributed: one ``all_gather_object``). A probe process that fails
    for its own reasons raises :class:`~loongtrain.attn.probe_batch.ProbeError` on every rank."""
    plan = plan_gate(candidates, versions)
    refused, narrowed = dict(plan.refused), plan.narrowed
    error = None
    try:
        if plan.asked and hasattr(probe, "prefetch"):
            probe.prefetch(plan.asked)
        for k, kind in plan.asked:
            reason = probe(k, kind)
            if reason is not None:
                refused[f"{kind}:{k.name}"] = reason
    except ProbeError as exc:
        error = str(exc)
    refused, error = _merged(refused, error)
    if error is not None:
        raise ProbeError(error)
    for key, reason in refused.items():
        log.warning("attention kernel %s not used for %s calls: %s", key.split(":", 1)[1], key.split(":", 1)[0],
                    reason)
    kernels = plan.kernels
    dense = [k for k in kernels if f"dense:{k.name}" not in refused and f"dense:{k.name}" not in narrowed]
    varlen = [k for k in kernels if k.varlen_forward is not None and f"varlen:{k.name}" not in refused
              and f"dense:{k.name}" not in refused]
    window = {k.name for k in kernels if k.windowed and f"window:{k.name}" not in refused}
    return Gate(dense, varlen, window, refused, narrowed)


def safe_forms(safe: Gate) -> list[Kernel]:
    """Each dense-safe candidate as it may run every call kind: its varlen op only where that passed (else one
    dense call per piece), its window argument only where that passed (a benchmark timing every safe kernel)."""
    out = []
    for k in safe.dense:
        form = k if k in safe.varlen or k.varlen_forward is None else dataclasses.replace(
            k, name=f"{k.name}_per_piece", varlen_forward=None, varlen_backward=None)
        out.append(form if not form.windowed or k.name in safe.window else dataclasses.replace(form, windowed=False))
    return out


def _merged(refused: dict[str, str], error: str | None) -> tuple[dict[str, str], str | None]:
    """Collective over the world (when distributed with more than one rank): every rank's refusals together, so no
    rank runs a kernel that failed its check on another, and the first probe-process error of any rank."""
    if not is_distributed() or dist.get_world_size() == 1:
        return refused, error
    gathered: list[tuple[dict[str, str], str | None] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (refused, error))
    merged: dict[str, str] = {}
    first_error = None
    for rank, item in enumerate(gathered):
        theirs, their_error = item if item is not None else ({}, None)
        for key, reason in theirs.items():
            merged.setdefault(key, reason if rank == dist.get_rank() else f"rank {rank}: {reason}")
        if their_error is not None and first_error is None:
            first_error = their_error if rank == dist.get_rank() else f"rank {rank}: {their_error}"
    return merged, first_error


def _device_bytes(device: torch.device) -> int | None:
    try:
        return int(torch.cuda.get_device_properties(device).total_memory)
    except (RuntimeError, AssertionError, AttributeError):
        return None


def reference_or_refuse(device: torch.device, dtype: torch.dtype, num_heads: int, seq_len: int,
                        refused: dict[str, str]) -> Kernel:
    """The reference kernel where the device holds one call's score-sized buffers (three of ``heads x S x S`` in
    the accumulators' dtype: at most 1/:data:`REFERENCE_SHARE` of its memory), else :class:`NoSafeKernel` naming
    the refusals."""
    need = 3 * num_heads * seq_len * seq_len * max(4, torch.empty((), dtype=dtype).element_size())
    total = _device_bytes(device)
    if total is None or need <= total // REFERENCE_SHARE:
        return REFERENCE
    why = "; ".join(f"{k}: {v}" for k, v in refused.items()) or "no fused kernel takes this dtype and head dim"
    raise NoSafeKernel(f"no fused attention kernel may run {str(dtype).removeprefix('torch.')} attention of "
                       f"{num_heads} heads on blocks of {seq_len} tokens here ({why}), and the reference kernel "
                       f"would need {need / 2**30:.1f} GiB of the device's {total / 2**30:.1f} GiB for one call; "
                       f"use shorter blocks (a larger --cp), or a torch/cuDNN whose kernels pass")
