"""Which attention kernels are safe to run here, before any is timed (docs/kernels.md#safety): the known-bad table,
and what the probe checks.

Two gates, both before :mod:`loongtrain.attn.kernel_choice` times a candidate:

- :data:`KNOWN_BAD`, a table of (kernel, call kind, torch/cuDNN versions) -> reason: a listed candidate is
  refused on those versions with its reason (:func:`known_bad`), nothing run; an entry with ``max_rows`` refuses
  only calls of that few query rows, which then go to the rule's kernel (:func:`narrowing`);
- a *probe* of every candidate that can fault asynchronously (:func:`needs_probe`: cuDNN's ops and FlashAttention
  3/4 always, torch's other CUDA kernels on a (torch release, call kind) not in :data:`VERIFIED`). An illegal
  address is sticky: once a kernel has written out of bounds every later CUDA call of the process fails, and no
  ``try`` catches it. So the candidates run first in one short-lived subprocess per run
  (:mod:`loongtrain.attn.probe_process`, started by :mod:`loongtrain.attn.probe_batch`: batched, cached on disk
  per versions, its own failures told apart from the kernels') on the ring's real call shapes (:func:`probe_cases`)
  against an fp64 reference sized to the device (:func:`reference_rows`); a crash, a timeout or a wrong result
  removes a candidate with one line of why.

Call kinds: ``dense`` (one piece), ``varlen`` (packed pieces) and ``window`` (a windowed kernel's own window
argument, dense and packed: a kernel refused there keeps its other calls and cuts windows into pieces).
Autocast is off inside every check (the fp64 reference is fp64, the kernels see the dtype they are given).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from loongtrain.attn.kernels import Kernel, Seqlens, VarlenMask, reference_backward, reference_forward

Tensor = torch.Tensor

#: call kinds a probe checks (the choice times ``dense`` and ``varlen``; ``window`` is a windowed kernel's own)
PROBE_KINDS = ("dense", "varlen", "window")
#: (torch release, call kind) on which this project ran torch's CUDA kernels other than cuDNN's on a device: the
#: one H200 run (torch 2.11.0+cu130, benchmarks/results/RESULTS.md) ran FA2 and the memory-efficient op dense
VERIFIED: dict[str, tuple[tuple[int, int], ...]] = {"dense": ((2, 11),), "varlen": (), "window": ()}
PROBE_TIMEOUT_S = 180.0  # one spec's cases in the probe process
PROBE_TOLERANCE = 0.05  # max error / max magnitude against fp64, half dtypes (bf16 rounding is ~1e-2)
PROBE_MAX_HEADS = 8  # query heads a probe uses at most (the reference's cost grows with them)
#: the longest block a probe runs: a longer length bucket's verdict is this one's (its fp64 reference costs grow with
#: the square of the length; the call shapes, short and long documents, one-row calls, are the same)
PROBE_MAX_BLOCK = 16384


@dataclass(frozen=True)
class Versions:
    """What a verdict depends on: torch ``(major, minor)``, cuDNN's integer version (``9.26.0`` -> ``92600``; None
    without cuDNN), and for the on-disk verdicts torch's full version (its CUDA build), the CUDA driver's version and
    the device's name."""

    torch: tuple[int, int]
    cudnn: int | None
    build: str = ""
    driver: int | None = None
    gpu: str = ""


def current_versions(device: torch.device | None = None) -> Versions:
    """This process's versions (the driver and device name of ``device``, or of the current CUDA device)."""
    major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    driver, gpu = None, ""
    if torch.cuda.is_available():
        get_driver = getattr(torch._C, "_cuda_getDriverVersion", None)
        driver = int(get_driver()) if get_driver is not None else None
        gpu = torch.cuda.get_device_name(device if device is not None and device.type == "cuda" else None)
    return Versions((major, minor), cudnn, torch.__version__, driver, gpu)


@dataclass(frozen=True)
class BadVersion:
    """One entry of :data:`KNOWN_BAD`: ``kernel`` (a name prefix: padded forms too) on call ``kind`` is refused
    when ``applies(versions)``, for ``reason``; with ``max_rows`` only its calls of at most that many query rows
    (the rest of its calls run: :func:`narrowing`)."""

    kernel: str
    kind: str
    applies: Callable[[Versions], bool]
    reason: str
    max_rows: int | None = None


_CUDNN_1072 = ("cuDNN <= 9.26's attention backward gives NaN dK/dV for one-row queries with strongly negative "
               "scores on sm90 (NVIDIA/cudnn-frontend#1072), which packed documents produce")
KNOWN_BAD: tuple[BadVersion, ...] = (
    BadVersion("cuda_cudnn", "varlen", lambda v: v.torch < (2, 14),
               "cuDNN's varlen backward sizes its dQ accumulator by the head dim instead of the longest document "
               "and writes out of bounds (a sticky illegal address) once a document is longer than the head dim; "
               "fixed in torch after 2.13 (pytorch/pytorch#186142, #194818)"),
    BadVersion("cuda_cudnn", "varlen", lambda v: v.cudnn is not None and v.cudnn < 92700, _CUDNN_1072),
    BadVersion("cuda_cudnn", "dense", lambda v: v.cudnn is not None and v.cudnn < 92700, _CUDNN_1072, max_rows=1),
)


def _entries(kernel: Kernel, kind: str, versions: Versions, table: Sequence[BadVersion]) -> list[BadVersion]:
    return [e for e in table if kernel.name.startswith(e.kernel) and e.kind == kind and e.applies(versions)]


def _where(kernel: Kernel, kind: str, versions: Versions) -> str:
    return f"{kernel.name} ({kind} calls) refused on torch {'.'.join(map(str, versions.torch))}, cuDNN {versions.cudnn}"


def known_bad(kernel: Kernel, kind: str, versions: Versions, table: Sequence[BadVersion] = KNOWN_BAD) -> str | None:
    """The reason ``kernel`` may not run call ``kind`` at all on ``versions`` (None: not listed, or only some of its
    call shapes are: :func:`narrowing`)."""
    for entry in _entries(kernel, kind, versions, table):
        if entry.max_rows is None:
            return f"{_where(kernel, kind, versions)}: {entry.reason}"
    return None


def narrowing(kernel: Kernel, kind: str, versions: Versions,
              table: Sequence[BadVersion] = KNOWN_BAD) -> tuple[int, str] | None:
    """``(max_rows, reason)`` when ``kernel``'s ``kind`` calls of at most ``max_rows`` query rows are refused on
    ``versions`` and its other calls are not (None otherwise)."""
    entries = _entries(kernel, kind, versions, table)
    if not entries or any(e.max_rows is None for e in entries):
        return None
    rows = max(e.max_rows for e in entries if e.max_rows is not None)
    reasons = "; ".join(e.reason for e in entries)
    return rows, f"{kernel.name}'s {kind} calls of at most {rows} query row(s) refused: {reasons}"


def needs_probe(kernel: Kernel, kind: str, versions: Versions) -> bool:
    """Whether ``kernel``'s ``kind`` calls run in the probe process before their first use here: cuDNN's ops and
    FlashAttention 3/4 always, torch's other CUDA kernels unless :data:`VERIFIED` lists the torch release for the
    call kind."""
    name = kernel.name
    if name.startswith(("cuda_cudnn", "cuda_fa3", "cuda_fa4")):
        return True
    return name.startswith("cuda_") and versions.torch not in VERIFIED.get(kind, ())


# ---------------------------------------------------------------- the cases


@dataclass(frozen=True)
class ProbeSpec:
    """What a probe runs: ``kernel`` (a name in :func:`kernels_by_name`) on call ``kind`` (:data:`PROBE_KINDS`),
    ``dtype`` (a torch dtype's name), ``head_dim``, ``heads`` query heads against ``kv_heads`` KV heads, blocks of
    ``block_len`` tokens (the length bucket's), on ``device``."""

    kernel: str
    kind: str
    dtype: str
    head_dim: int
    heads: int
    kv_heads: int
    block_len: int
    device: str

    def key(self) -> str:
        """The verdict's key (in the on-disk cache; the device index is not part of it)."""
        return (f"{self.kind}:{self.kernel}:{self.dtype}:d{self.head_dim}:{self.heads}/{self.kv_heads}:"
                f"{self.block_len}")


def probe_heads(num_heads: int, num_kv_heads: int) -> tuple[int, int]:
    """The head counts a probe uses for a call of ``num_heads`` against ``num_kv_heads``: the same group size
    (FA2's one-row calls take another path when it is > 1), at least two KV heads where the call has them, at most
    :data:`PROBE_MAX_HEADS` query heads."""
    group = num_heads // num_kv_heads
    kv = max(1, min(num_kv_heads, 2, PROBE_MAX_HEADS // group))
    return kv * min(group, PROBE_MAX_HEADS), kv


@dataclass(frozen=True)
class Case:
    """One call: sequences of ``q_lens`` query rows against ``k_lens`` keys (one sequence: a dense call),
    ``causal``; ``window``: FA2's ``(left, right)`` (a band call); ``negative``: scores strongly negative (every lse
    well below 0), through one large common component of q and k, which any kernel's dQ carries with large rounding
    (only its finiteness is checked)."""

    q_lens: tuple[int, ...]
    k_lens: tuple[int, ...]
    causal: bool
    negative: bool = False
    window: tuple[int, int] | None = None


def probe_cases(kind: str, block_len: int, bottom_right: bool = True) -> list[Case]:
    """The ring's call shapes at blocks of ``block_len``: query lengths 1, 128 and the block, causal and not,
    short and long documents, q and k lengths differing where a call allows it, strongly negative scores at one
    row and at many; for ``varlen``, packed sequences with distinct ``cu_seqlens`` for q and k and a call of
    one-row sequences only (one-row causal sequences only where the op aligns causal masks bottom-right); for
    ``window``, band calls dense and packed."""
    long, mid = block_len, min(128, block_len)
    short = max(1, min(5, block_len))
    if kind == "dense":
        return [Case((1,), (long,), False), Case((1,), (long,), False, negative=True), Case((mid,), (long,), False),
                Case((mid,), (long,), False, negative=True), Case((long,), (long,), True),
                Case((long,), (long,), True, negative=True), Case((mid,), (mid,), True), Case((1,), (1,), True)]
    if kind == "window":
        w = max(1, min(127, block_len - 1))
        return [Case((long,), (long,), False, window=(w, 0)), Case((mid,), (long,), False, window=(w, 0)),
                Case((long, short), (long, short), False, window=(w, 0)),
                Case((mid, 1), (mid + w, w), False, window=(w, 0))]
    squares = (long, mid, short, 1)
    cases = [Case(squares, squares, True), Case((1, mid, long), (long, 2 * mid, mid), False),
             Case((1, 1, short), (long, mid, short), False, negative=True), Case((1, 1, 1), (long, mid, 1), False)]
    if bottom_right:
        cases += [Case((1, mid, 1), (long, mid, short), True), Case((1, 1, 1), (long, short, 1), True)]
    return cases


def _lengths_ok(case: Case) -> None:
    assert len(case.q_lens) == len(case.k_lens)
    assert not case.causal or all(q in (1, k) for q, k in zip(case.q_lens, case.k_lens))


def _inputs(case: Case, spec: ProbeSpec, device: torch.device, gen: torch.Generator) -> tuple[Tensor, ...]:
    """Packed fp64 q/dout ``[Tq, H, D]``, k/v ``[Tk, Hkv, D]``."""
    tq, tk = sum(case.q_lens), sum(case.k_lens)

    def rand(t: int, h: int) -> Tensor:
        return torch.randn(t, h, spec.head_dim, generator=gen, dtype=torch.float64).to(device)

    q, k, v, dout = rand(tq, spec.heads), rand(tk, spec.kv_heads), rand(tk, spec.kv_heads), rand(tq, spec.heads)
    if case.negative:  # every score about -30 * sqrt(D) * scale: lse far below 0
        q[..., 0], k[..., 0] = 1.0, -30.0 * spec.head_dim ** 0.5
    return q, k, v, dout


def _cu(lengths: Sequence[int], device: torch.device) -> Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def _bhsd(x: Tensor) -> Tensor:  # [T, H, D] -> [1, H, T, D] view, as the ring passes blocks
    return x.unsqueeze(0).transpose(1, 2)


REFERENCE_ROWS = 1024  # query rows per fp64 reference call at most


def reference_rows(keys: int, heads: int, budget_bytes: int | None) -> int:
    """Query rows per fp64 reference call: its score-sized buffers (about six of ``heads x rows x keys`` fp64) fit
    ``budget_bytes`` (None: :data:`REFERENCE_ROWS`), between 16 and :data:`REFERENCE_ROWS`."""
    if budget_bytes is None:
        return REFERENCE_ROWS
    return max(16, min(REFERENCE_ROWS, budget_bytes // (6 * 8 * heads * max(1, keys))))


def _visible(rows: int, cols: int, r0: int, r1: int, causal: bool, window: tuple[int, int] | None,
             device: torch.device) -> Tensor | None:
    """Visibility of rows ``[r0, r1)`` of a ``rows x cols`` call, bottom-right aligned (None: all)."""
    if not causal and window is None:
        return None
    d = torch.arange(cols, device=device)[None, :] - torch.arange(r0, r1, device=device)[:, None] - (cols - rows)
    left, right = window if window is not None else (-1, 0)
    visible = d <= right if right >= 0 else torch.ones_like(d, dtype=torch.bool)
    return visible & (d >= -left) if left >= 0 else visible


def _reference_sequence(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, causal: bool, window: tuple[int, int] | None,
                        scale: float, rows_per_call: int) -> list[Tensor]:
    """fp64 (out, lse, dq, dk, dv) of one sequence ``[1, H, S, D]``, ``rows_per_call`` query rows at a time
    (bottom-right aligned, as the one-row and band calls are)."""
    outs, lses, dqs = [], [], []
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    rows, cols = q.shape[2], k.shape[2]
    for r0 in range(0, rows, rows_per_call):
        r1 = min(r0 + rows_per_call, rows)
        mask = _visible(rows, cols, r0, r1, causal, window, q.device)
        qc, dc = q[:, :, r0:r1], dout[:, :, r0:r1]
        out, lse = reference_forward(qc, k, v, False, scale, mask)
        gq, gk, gv = reference_backward(dc, qc, k, v, out, lse, False, scale, mask)
        outs.append(out), lses.append(lse), dqs.append(gq)
        dk += gk
        dv += gv
    return [torch.cat(outs, 2), torch.cat(lses, 2), torch.cat(dqs, 2), dk, dv]


def _reference(case: Case, q: Tensor, k: Tensor, v: Tensor, dout: Tensor, scale: float,
               rows_per_call: int) -> list[Tensor]:
    """fp64 (out, lse [H, Tq], dq, dk, dv), sequence by sequence."""
    parts: list[list[Tensor]] = []
    q0 = k0 = 0
    for nq, nk in zip(case.q_lens, case.k_lens):
        sq, sk = slice(q0, q0 + nq), slice(k0, k0 + nk)
        res = _reference_sequence(*(_bhsd(t[s]) for t, s in ((q, sq), (k, sk), (v, sk), (dout, sq))),
                                  case.causal, case.window, scale, rows_per_call)
        parts.append([res[0][0].transpose(0, 1), res[1][0], *(g[0].transpose(0, 1) for g in res[2:])])
        q0, k0 = q0 + nq, k0 + nk
    return [torch.cat([p[i] for p in parts], dim=1 if i == 1 else 0) for i in range(5)]


def _run(kernel: Kernel, case: Case, q: Tensor, k: Tensor, v: Tensor, dout: Tensor, scale: float) -> list[Tensor]:
    extra = {} if case.window is None else {"window": case.window}
    if len(case.q_lens) == 1:  # a dense call
        args = [_bhsd(t) for t in (q, k, v)]
        out, lse = kernel.forward(*args, case.causal, scale, **extra)
        grads = kernel.backward(_bhsd(dout), *args, out, lse, case.causal, scale, **extra)
        return [out[0].transpose(0, 1), lse[0], *(g[0].transpose(0, 1) for g in grads)]
    assert kernel.varlen_forward is not None and kernel.varlen_backward is not None
    # distinct cu tensors, as the ring's
    seqlens = Seqlens(_cu(case.q_lens, q.device), _cu(case.k_lens, q.device), max(case.q_lens), max(case.k_lens))
    mask = VarlenMask(case.causal, scale, case.window)
    out, lse = kernel.varlen_forward(q, k, v, seqlens, mask)
    lse = lse.contiguous()
    grads = kernel.varlen_backward(dout, q, k, v, out, lse, seqlens, mask)
    return [out, lse, *grads]


def spec_cases(kernel: Kernel, spec: ProbeSpec) -> list[Case]:
    """The cases ``kernel`` runs for ``spec`` (a dense call of ``varlen`` kind: none; packed window cases only with
    a varlen op)."""
    cases = probe_cases(spec.kind, spec.block_len, kernel.varlen_bottom_right)
    if spec.kind == "window":
        return [c for c in cases if len(c.q_lens) == 1 or kernel.varlen_forward is not None]
    return cases


def check_cases(kernel: Kernel, spec: ProbeSpec, device: torch.device, budget_bytes: int | None = None) -> str | None:
    """Run ``kernel`` on every case of ``spec`` (:func:`spec_cases`) against fp64 (its reference in
    :func:`reference_rows` of ``budget_bytes``), synchronising after each: None when all agree within
    :data:`PROBE_TOLERANCE` (max error over the larger of max magnitude and 1: the inputs are of order 1, and a
    result near 0, as dQ of a one-key causal row, is judged by its absolute error) and are finite, else one line
    naming the first that does not (a fault on the device ends the process instead: what the probe process is
    for; an allocation failure is raised, not a verdict)."""
    dtype = getattr(torch, spec.dtype)
    scale = spec.head_dim ** -0.5
    gen = torch.Generator().manual_seed(0)
    names = ("out", "lse", "dq", "dk", "dv")
    with torch.autocast(device.type, enabled=False):
        for case in spec_cases(kernel, spec):
            _lengths_ok(case)
            given = [t.to(dtype) for t in _inputs(case, spec, device, gen)]
            rows = reference_rows(max(case.k_lens), spec.heads, budget_bytes)
            want = _reference(case, *(t.to(torch.float64) for t in given), scale, rows)  # the kernel's own inputs
            got = _run(kernel, case, *given, scale)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            for name, g, w in zip(names, got, want):
                g = g.to(torch.float64)
                error = float((g - w).abs().max() / w.abs().max().clamp(min=1.0))  # of values of order 1
                if case.negative and name == "dq":  # the common score shift cancels in dQ: finiteness only
                    error = 0.0
                if not torch.isfinite(g).all() or not error <= PROBE_TOLERANCE:
                    shape = f", window={case.window}" if case.window else ""
                    return (f"{kernel.name} ({spec.kind}) wrong on q lengths {list(case.q_lens)}, k lengths "
                            f"{list(case.k_lens)}, causal={case.causal}{shape}: {name} off by {error:.3g} (relative)")
    return None
