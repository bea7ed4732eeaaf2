"""Which kernel the ring runs on this device: capability rules, then a measurement (docs/attention.md#kernels).

Rules (:func:`kernel_candidates`, following torch's own dispatcher checks; :func:`select_kernel` takes the
first): CPU -> ``cpu_flash`` (all float dtypes). NVIDIA CUDA: fp16/bf16 on sm80..sm121 with head dim a
multiple of 8 and <= 256 (not in (192, 224] on sm86-89/sm120-121, where FA2 has no backward) ->
``cuda_flash``; on sm90/sm100 with cuDNN >= 9 and head dim <= 128, ``cuda_cudnn`` too; where installed,
FlashAttention 3 on sm90 and 4 on sm90/sm100 (``cuda_fa3``, ``cuda_fa4``: loongtrain/attn/flash_kernels.py); fp32, and
fp16/bf16 that flash cannot take -> ``cuda_efficient`` (sm50+, bf16 from sm80, head dim a multiple of
the GEMM alignment: 8 for fp16/bf16, 4 for fp32 from sm80); a head dim that none takes as it is -> the
same kernel on the head dim zero-padded to a multiple of 8 (``*_padded``, exact); fp64 (no fused CUDA
kernel takes it), ROCm and other devices -> ``reference``. :func:`select_kernel` never takes
``cuda_cudnn``, FA3 or FA4 by rule (:data:`BY_MEASUREMENT`: their speed against FA2 depends on device and shape;
cuDNN measured on an H200: 1.9x faster at 16K, D=128, causal) but only through its ``measure`` hook.
:func:`bf16_supported` tells whether a device has native bf16 (for ``--dtype auto``).

Measurement (:func:`choose_kernel`, what the ring calls), one choice per call kind (:data:`CALL_KINDS`):
the **dense** calls (one piece, ``Kernel.forward``/``backward``) and the **varlen** calls (many pieces of
packed documents at once, ``Kernel.varlen_forward``/``varlen_backward``, or one dense call per piece):

- CPU, other devices, and CUDA cases with a single option: the rule's kernel, nothing measured;
- on CUDA, first the gate (:func:`loongtrain.attn.kernel_gate.gate`, docs/kernels.md#safety): the known-bad
  table (refusals, and cuDNN narrowed to calls of two or more rows where its bug is listed) and the probe's
  verdicts, every candidate and call kind in one probe process; nothing left: the reference kernel where the device
  holds it, else :class:`~loongtrain.attn.kernel_gate.NoSafeKernel`;
- under ``torch.use_deterministic_algorithms(True)`` (``--deterministic``): the rule's safe kernel, so the
  documented deterministic path (the flash backward's) is the one that runs;
- otherwise each option's forward + backward is timed once on the call's own head counts and head dim at the
  run's block length (:mod:`loongtrain.attn.kernel_timing`): dense calls on one causal
  block; varlen calls on the block packed as 8 equal causal documents, through each kernel's varlen op
  (``cuda_flash``: FA2's; ``cuda_cudnn``: cuDNN's ragged one) and, as one more option, the dense choice called
  once per document. An option replaces the rule's (dense: the first candidate but cuDNN; varlen: the first
  candidate with a varlen op) only when it is at least ``MARGIN`` faster, so that ranks timing the same device
  do not flip between two options of equal speed, and so a kernel without a varlen op never replaces one with it
  on the varlen calls unless it measured faster there. An option that raises is skipped, and so is a varlen op
  whose untimed first run differs from the reference kernel beyond rounding
  (:func:`loongtrain.attn.kernel_timing.varlen_error`). Distributed, every rank then takes rank 0's choices
  (:func:`agree_across_ranks`), so no two ranks run different numerics.

The ring gets one :class:`~loongtrain.attn.kernels.Kernel`: the dense choice's forward and backward with the
varlen choice's varlen ops (or none), and the window argument where every part of it passed its window probe.
It is kept per process for ``(device, dtype, head dim, heads, KV
heads, length bucket)`` (:func:`clear_choices` forgets it), logged on first use with the times, and recorded
(:func:`chosen_kernels`, :func:`refused_kernels`: the run's metrics rows and checkpoints).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch
import torch.distributed as dist

from loongtrain.attn.cuda_kernels import (
    CUDA_CUDNN,
    CUDA_EFFICIENT,
    CUDA_EFFICIENT_PADDED,
    CUDA_FLASH,
    CUDA_FLASH_PADDED,
)
from loongtrain.attn.flash_kernels import CUDA_FA3, CUDA_FA4, fa3_ok, fa4_ok
from loongtrain.attn.kernel_gate import BatchProbe, Probe, gate, length_bucket, reference_or_refuse
from loongtrain.attn.kernel_probe import current_versions
from loongtrain.attn.kernel_timing import MEASURE_DOCUMENTS, make_timer
from loongtrain.attn.kernels import CPU_FLASH, REFERENCE, Kernel
from loongtrain.parallel.runtime import is_distributed

Tensor = torch.Tensor
log = logging.getLogger(__name__)

MARGIN = 0.10  # another kernel must be at least 10% faster than the rule's choice to replace it
CALL_KINDS = ("dense", "varlen")

_ChoiceKey = tuple[str, int | None, torch.dtype, int, int, int, int]
_CHOICES: dict[_ChoiceKey, Kernel] = {}  # per-process cache, like cuDNN's benchmark cache
_REFUSED: dict[str, str] = {}  # kind:name -> why, for the run's records


# ---------------------------------------------------------------- rules (torch's dispatcher checks)

_HALF = (torch.float16, torch.bfloat16)


def bf16_supported(device: torch.device) -> bool:
    """Whether ``device`` computes bf16 natively (for ``--dtype auto``): CPU yes; CUDA from sm80; else no."""
    device = torch.device(device)
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 0)
    return False


def _flash_ok(sm: tuple[int, int], dtype: torch.dtype, head_dim: int) -> bool:
    if dtype not in _HALF or not ((8, 0) <= sm <= (12, 1)) or head_dim % 8 or head_dim > 256:
        return False
    no_backward = ((8, 6) <= sm <= (8, 9) or sm >= (12, 0)) and 192 < head_dim <= 224
    return torch.backends.cuda.is_flash_attention_available() and not no_backward


def _efficient_alignment(sm: tuple[int, int], dtype: torch.dtype) -> int:
    """The head-dim multiple torch's dispatcher requires of the memory-efficient op (GEMM alignment)."""
    half = dtype in _HALF
    tensor_cores = sm >= (8, 0) or (sm >= (7, 0) and half)
    return max(4 if sm >= (8, 0) else 1, (8 if half else 4) if tensor_cores else 1)


def _efficient_ok(sm: tuple[int, int], dtype: torch.dtype, head_dim: int) -> bool:
    dtypes = (torch.float16, torch.float32, torch.bfloat16) if sm >= (8, 0) else (torch.float16, torch.float32)
    return dtype in dtypes and (5, 0) <= sm <= (12, 1) and head_dim % _efficient_alignment(sm, dtype) == 0


def _cudnn_ok(sm: tuple[int, int], dtype: torch.dtype, head_dim: int) -> bool:
    version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return (
        dtype in _HALF and sm[0] in (9, 10) and head_dim % 8 == 0 and head_dim <= 128
        and version is not None and version >= 90000
    )


def kernel_candidates(device: torch.device, dtype: torch.dtype, head_dim: int) -> list[Kernel]:
    """The kernels that can run attention of this dtype and head dim on ``device``, fastest-expected
    first; ``[REFERENCE]`` when no fused kernel can."""
    device = torch.device(device)
    if device.type == "cpu" and dtype in (torch.float32, torch.float64, *_HALF):
        return [CPU_FLASH]
    if device.type != "cuda" or torch.version.hip is not None or dtype == torch.float64:
        return [REFERENCE]  # fp64: no fused CUDA kernel; ROCm: rules not worked out here
    sm = torch.cuda.get_device_capability(device)
    checks = ((CUDA_FLASH, _flash_ok), (CUDA_CUDNN, _cudnn_ok), (CUDA_FA3, fa3_ok), (CUDA_FA4, fa4_ok),
              (CUDA_EFFICIENT, _efficient_ok))
    exact = [kernel for kernel, ok in checks if ok(sm, dtype, head_dim)]
    padded_dim = -(-head_dim // 8) * 8  # only when no kernel takes the head dim as it is
    padded = [kernel for kernel, ok in ((CUDA_FLASH_PADDED, _flash_ok), (CUDA_EFFICIENT_PADDED, _efficient_ok))
              if ok(sm, dtype, padded_dim)]
    return exact or padded or [REFERENCE]


#: kernels never taken by rule, only where they measured faster (cuDNN; FlashAttention 3 and 4)
BY_MEASUREMENT = ("cuda_cudnn", "cuda_fa3", "cuda_fa4")


def rule_of(candidates: list[Kernel]) -> Kernel:
    """The rule's kernel among ``candidates``: the first not taken only by measurement (:data:`BY_MEASUREMENT`),
    else the first."""
    return next((k for k in candidates if not k.name.startswith(BY_MEASUREMENT)), candidates[0])


def select_kernel(
    device: torch.device, dtype: torch.dtype, head_dim: int,
    measure: Callable[[Kernel], float] | None = None,
) -> Kernel:
    """The kernel the ring uses by rule: the first of :func:`kernel_candidates`, except that cuDNN and
    FlashAttention 3/4 are only taken by measurement. ``measure(kernel) -> seconds`` (the hook for a GPU
    calibration): the fastest candidate."""
    candidates = kernel_candidates(device, dtype, head_dim)
    if measure is not None and len(candidates) > 1:
        return min(candidates, key=measure)
    return rule_of(candidates)  # efficient is eligible wherever cuDNN and FA3/FA4 are


# ---------------------------------------------------------------- measurement


def pick_by_time(
    candidates: list[Kernel], rule: Kernel, measure: Callable[[Kernel], float]
) -> tuple[Kernel, dict[str, float]]:
    """The fastest candidate by ``measure`` when it beats ``rule``'s time by at least :data:`MARGIN`, else
    ``rule``; also each candidate's time (``inf`` when it raised)."""
    times: dict[str, float] = {}
    for kernel in candidates:
        try:
            times[kernel.name] = measure(kernel)
        except Exception as exc:  # e.g. a shape the library rejects at run time: not a candidate here
            log.warning("attention kernel %s failed while being timed (%s: %s); not used",
                        kernel.name, type(exc).__name__, exc)
            times[kernel.name] = float("inf")
    fastest = min(candidates, key=lambda kernel: times[kernel.name])
    rule_time = times.get(rule.name, float("inf"))
    if times[fastest.name] < float("inf") and times[fastest.name] <= (1.0 - MARGIN) * rule_time:
        return fastest, times
    return rule, times


def per_piece(kernel: Kernel) -> Kernel:
    """``kernel`` without its varlen op: packed documents then take one dense call per piece."""
    if kernel.varlen_forward is None:
        return kernel
    return dataclasses.replace(kernel, name=f"{kernel.name}_per_piece", varlen_forward=None, varlen_backward=None)


def combined(dense: Kernel, varlen: Kernel) -> Kernel:
    """The ring's kernel: ``dense``'s forward and backward, ``varlen``'s varlen ops (none when ``varlen`` is
    a per-piece option). The same object as ``dense`` when that is what it is."""
    if varlen.varlen_forward is dense.varlen_forward and varlen.varlen_bottom_right == dense.varlen_bottom_right:
        return dense
    name = f"{dense.name}+{varlen.name}" if varlen.varlen_forward is not None else per_piece(dense).name
    return dataclasses.replace(dense, name=name, varlen_forward=varlen.varlen_forward,
                               varlen_backward=varlen.varlen_backward, varlen_bottom_right=varlen.varlen_bottom_right)


def varlen_options(candidates: list[Kernel], dense: Kernel) -> tuple[list[Kernel], Kernel]:
    """The options for the varlen calls (each candidate with a varlen op, then ``dense`` once per piece) and
    the rule's: the first with a varlen op, else per piece."""
    options = [k for k in candidates if k.varlen_forward is not None] + [per_piece(dense)]
    return options, options[0]


def choose_kernel(
    device: torch.device, dtype: torch.dtype, head_dim: int, num_heads: int, num_kv_heads: int, seq_len: int,
    measure: Callable[[Kernel, str], float] | None = None, probe: Probe | None = None,
) -> Kernel:
    """The kernel for attention of ``num_heads`` query heads against ``num_kv_heads`` KV heads of
    ``head_dim``, blocks of ``seq_len`` tokens, on ``device`` (module docstring). ``measure(kernel, kind) ->
    seconds`` (``kind`` in :data:`CALL_KINDS`) replaces the timing, ``probe(kernel, kind) -> reason or None``
    the probe process (tests). Raises :class:`~loongtrain.attn.kernel_gate.NoSafeKernel` when nothing may run the
    call (no fused kernel passes, and the reference kernel cannot hold the length) and
    :class:`~loongtrain.attn.probe_batch.ProbeError` when the probe process fails for its own reasons."""
    device = torch.device(device)
    key = (device.type, device.index, dtype, head_dim, num_heads, num_kv_heads, length_bucket(seq_len))
    deterministic = torch.are_deterministic_algorithms_enabled()
    if key in _CHOICES and not deterministic:
        return _CHOICES[key]
    if device.type != "cuda":
        rule = select_kernel(device, dtype, head_dim)
        _CHOICES[key] = rule  # for the run's records (deterministic mode looks it up again each time)
        return rule
    versions = current_versions()
    probe = probe or BatchProbe(device, dtype, head_dim, num_heads, num_kv_heads, seq_len, versions)
    safe = gate(kernel_candidates(device, dtype, head_dim), versions, probe)
    _REFUSED.update(safe.refused)
    _REFUSED.update({f"{k} (narrowed)": v for k, v in safe.narrowed.items()})
    fused = [k for k in safe.dense if k is not REFERENCE]  # fp64's rule is the reference: it must fit too
    candidates = fused or [reference_or_refuse(device, dtype, num_heads, seq_len, safe.refused)]
    rule = rule_of(candidates)
    if deterministic:  # the rule's kernel, nothing timed (its varlen op where it has a safe one)
        choice = _with_window(combined(rule, rule if rule in safe.varlen else per_piece(rule)), safe.window)
        _CHOICES[key] = choice
        return choice
    timer = measure or make_timer(device, dtype, head_dim, num_heads, num_kv_heads, seq_len)
    dense, times = (rule, {}) if len(candidates) < 2 else pick_by_time(candidates, rule, lambda k: timer(k, "dense"))
    options = varlen_options(safe.varlen, dense)[0]
    varlen_rule = options[0]
    varlen, varlen_times = ((varlen_rule, {}) if len(options) < 2 else
                            pick_by_time(options, varlen_rule, lambda k: timer(k, "varlen")))
    if times or varlen_times:
        dense_name, varlen_name = _rank0_names((dense.name, varlen.name))
        dense = next(k for k in candidates if k.name == dense_name)
        varlen = next(k for k in varlen_options(safe.varlen, dense)[0] if k.name == varlen_name)
        shown = {kind: ", ".join(f"{name} {t * 1e3:.2f} ms" for name, t in timed.items())
                 for kind, timed in (("dense", times), ("varlen", varlen_times))}
        log.info("attention kernel for %s, head dim %d, %d/%d heads, blocks of %d: dense calls %s (fwd+bwd "
                 "measured: %s); varlen calls %s (%d documents, fwd+bwd measured: %s)", dtype, head_dim, num_heads,
                 num_kv_heads, seq_len, dense.name, shown["dense"] or "-", varlen.name, MEASURE_DOCUMENTS,
                 shown["varlen"] or "-")
    choice = _with_window(combined(dense, varlen), safe.window)
    _CHOICES[key] = choice
    return choice


def _with_window(kernel: Kernel, windowed: set[str]) -> Kernel:
    """``kernel`` without its window argument unless every part of it may use it (its dense kernel's and its varlen
    op's, by name: ``dense+varlen`` for a combined one); cut pieces then cover windows."""
    if not kernel.windowed:
        return kernel
    parts = kernel.name.split("+")
    if all(p.removesuffix("_per_piece") in windowed for p in parts):
        return kernel
    return dataclasses.replace(kernel, windowed=False)


def pin_kernel(kernel: Kernel, device: torch.device, dtype: torch.dtype, head_dim: int, num_heads: int,
               num_kv_heads: int, seq_len: int) -> None:
    """Make ``kernel`` this process's choice for these calls (a benchmark comparing kernels side by side) until
    :func:`clear_choices`; nothing is probed or timed."""
    device = torch.device(device)
    _CHOICES[(device.type, device.index, dtype, head_dim, num_heads, num_kv_heads, length_bucket(seq_len))] = kernel


def chosen_kernels() -> dict[str, str]:
    """What this process chose so far, for the run's records: ``"<dtype> d<head dim> <heads>/<KV heads> heads,
    blocks <= <bucket>"`` -> the kernel's name (``dense+varlen`` when the call kinds differ)."""
    return {f"{str(dtype).removeprefix('torch.')} d{d} {h}/{hkv} heads, blocks <= {bucket}": kernel.name
            for (_, _, dtype, d, h, hkv, bucket), kernel in sorted(_CHOICES.items(), key=str)}


def refused_kernels() -> dict[str, str]:
    """The candidates refused so far (``kind:name`` -> the one line of why)."""
    return dict(_REFUSED)


def _rank0_names(names: tuple[str, ...]) -> tuple[str, ...]:
    """Collective over the world (when distributed with more than one rank): rank 0's ``names``; a rank whose
    own differ logs it. One ``all_gather_object`` (rare: once per measured choice)."""
    if not is_distributed() or dist.get_world_size() == 1:
        return names
    gathered: list[tuple[str, ...] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, names)
    first = gathered[0]
    assert first is not None
    if first != names:
        log.warning("attention kernel: this rank measured %s fastest, rank 0 %s; every rank runs %s (choices by "
                    "rank: %s)", names, first, first, gathered)
    return first


def agree_across_ranks(choice: Kernel, candidates: list[Kernel]) -> Kernel:
    """Collective over the world (when distributed with more than one rank): every rank takes rank 0's
    measured choice among ``candidates``, so all ranks run the same numerics (timings differ between
    devices). One ``all_gather_object`` per measured choice (rare: once per key)."""
    (name,) = _rank0_names((choice.name,))
    return next(k for k in candidates if k.name == name)


def kernel_for(q: Tensor, k: Tensor, v: Tensor) -> Kernel:
    """:func:`choose_kernel` for ring blocks ``q [B, H, S_c, D]``, ``k [B, Hkv, S_c, D]``, ``v [B, Hkv, S_c, Dv]``,
    chosen for the wider head dim (MLA's ``Dv < D`` runs on V padded to ``D``:
    :func:`~loongtrain.attn.kernels.for_head_dims`)."""
    return choose_kernel(q.device, q.dtype, max(q.shape[-1], v.shape[-1]), q.shape[1], k.shape[1], q.shape[2])


def clear_choices() -> None:
    """Forget every measured choice and refusal (they are re-measured on next use)."""
    _CHOICES.clear()
    _REFUSED.clear()
