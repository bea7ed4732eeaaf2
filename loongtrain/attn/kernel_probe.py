"""Which attention kernels are safe to run here, before any is timed (docs/kernels.md#safety).

Two gates, both before :mod:`loongtrain.attn.kernel_choice` times a candidate:

- :data:`KNOWN_BAD`, a table of (kernel, call kind, torch/cuDNN versions) -> reason: a listed candidate is
  refused on those versions with its reason (:func:`known_bad`), nothing run;
- a *probe* (:func:`probe_in_subprocess`) of every candidate that can fault asynchronously (:func:`needs_probe`:
  cuDNN's ops, and any CUDA kernel on a torch version not in :data:`VERIFIED_TORCH`). An illegal address is
  sticky: once a kernel has written out of bounds every later CUDA call of the process fails, and no ``try``
  catches it. So the candidate runs first in a short-lived subprocess (``python -m loongtrain.attn.kernel_probe``)
  on the ring's real call shapes (:func:`probe_cases`) against fp64; a crash, a timeout or a wrong result
  removes it with one line of why. Verdicts are kept per process (:func:`clear_verdicts` forgets them).

Autocast is off inside every check (the fp64 reference is fp64, the kernels see the dtype they are given).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from loongtrain.attn.kernels import Kernel, reference_backward, reference_forward

Tensor = torch.Tensor

#: torch releases on which the CUDA kernels other than cuDNN's were run on a device by this project
VERIFIED_TORCH = ((2, 13),)
PROBE_TIMEOUT_S = 180.0
PROBE_TOLERANCE = 0.05  # max error / max magnitude against fp64, half dtypes (bf16 rounding is ~1e-2)


@dataclass(frozen=True)
class Versions:
    """The library versions a verdict depends on: torch ``(major, minor)`` and cuDNN's integer version
    (``9.26.0`` -> ``92600``; None without cuDNN)."""

    torch: tuple[int, int]
    cudnn: int | None


def current_versions() -> Versions:
    """This process's torch and cuDNN versions."""
    major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return Versions((major, minor), cudnn)


@dataclass(frozen=True)
class BadVersion:
    """One entry of :data:`KNOWN_BAD`: ``kernel`` (a name prefix: padded forms too) on call ``kind`` is refused
    when ``applies(versions)``, for ``reason``."""

    kernel: str
    kind: str
    applies: Callable[[Versions], bool]
    reason: str


KNOWN_BAD: tuple[BadVersion, ...] = (
    BadVersion("cuda_cudnn", "varlen", lambda v: v.torch < (2, 14),
               "cuDNN's varlen backward sizes its dQ accumulator by the head dim instead of the longest document "
               "and writes out of bounds (a sticky illegal address) once a document is longer than the head dim; "
               "fixed in torch after 2.13 (pytorch/pytorch#186142, #194818)"),
    BadVersion("cuda_cudnn", "dense", lambda v: v.cudnn is not None and v.cudnn < 92700,
               "cuDNN <= 9.26's attention backward gives NaN dK/dV for one-row queries with strongly negative "
               "scores on sm90 (NVIDIA/cudnn-frontend#1072), which packed documents produce"),
)


def known_bad(kernel: Kernel, kind: str, versions: Versions, table: Sequence[BadVersion] = KNOWN_BAD) -> str | None:
    """The reason ``kernel`` may not run call ``kind`` on ``versions`` (None: not listed)."""
    for entry in table:
        if kernel.name.startswith(entry.kernel) and entry.kind == kind and entry.applies(versions):
            return f"{kernel.name} ({kind} calls) refused on torch {'.'.join(map(str, versions.torch))}, " \
                   f"cuDNN {versions.cudnn}: {entry.reason}"
    return None


def needs_probe(kernel: Kernel, versions: Versions) -> bool:
    """Whether ``kernel`` runs in a subprocess before its first use here: cuDNN's ops always, any other CUDA
    kernel on a torch release not in :data:`VERIFIED_TORCH`."""
    return kernel.name.startswith("cuda_cudnn") or (kernel.name.startswith("cuda_")
                                                    and versions.torch not in VERIFIED_TORCH)


# ---------------------------------------------------------------- the cases


@dataclass(frozen=True)
class ProbeSpec:
    """What a probe runs: ``kernel`` (a name in :func:`kernels_by_name`) on call ``kind`` (``dense``/``varlen``),
    ``dtype`` (a torch dtype's name), ``head_dim``, one KV head against ``group`` query heads, blocks of
    ``block_len`` tokens, on ``device``."""

    kernel: str
    kind: str
    dtype: str
    head_dim: int
    group: int
    block_len: int
    device: str


@dataclass(frozen=True)
class Case:
    """One call: sequences of ``q_lens`` query rows against ``k_lens`` keys (one sequence: a dense call),
    ``causal``; ``negative``: scores strongly negative (every lse well below 0), through one large common
    component of q and k, which any kernel's dQ carries with large rounding (only its finiteness is checked)."""

    q_lens: tuple[int, ...]
    k_lens: tuple[int, ...]
    causal: bool
    negative: bool = False


def probe_cases(kind: str, block_len: int, bottom_right: bool = True) -> list[Case]:
    """The ring's call shapes at blocks of ``block_len``: query lengths 1, 128 and the block, causal and not,
    short and long documents, q and k lengths differing where a call allows it; for ``varlen``, packed
    sequences with distinct ``cu_seqlens`` for q and k (one-row causal sequences only where the op aligns
    causal masks bottom-right)."""
    long, mid = block_len, min(128, block_len)
    if kind == "dense":
        return [Case((1,), (long,), False), Case((1,), (long,), False, negative=True), Case((mid,), (long,), False),
                Case((long,), (long,), True), Case((mid,), (mid,), True), Case((1,), (1,), True)]
    short = max(1, min(5, block_len))
    squares = (long, mid, short, 1)
    cases = [Case(squares, squares, True), Case((1, mid, long), (long, 2 * mid, mid), False),
             Case((1, 1, short), (long, mid, short), False, negative=True)]
    if bottom_right:
        cases.append(Case((1, mid, 1), (long, mid, short), True))
    return cases


def _lengths_ok(case: Case) -> None:
    assert len(case.q_lens) == len(case.k_lens)
    assert not case.causal or all(q in (1, k) for q, k in zip(case.q_lens, case.k_lens))


def _inputs(case: Case, spec: ProbeSpec, device: torch.device, gen: torch.Generator) -> tuple[Tensor, ...]:
    """Packed fp64 q/dout ``[Tq, H, D]``, k/v ``[Tk, 1, D]``."""
    tq, tk = sum(case.q_lens), sum(case.k_lens)

    def rand(t: int, h: int) -> Tensor:
        return torch.randn(t, h, spec.head_dim, generator=gen, dtype=torch.float64).to(device)

    q, k, v, dout = rand(tq, spec.group), rand(tk, 1), rand(tk, 1), rand(tq, spec.group)
    if case.negative:  # every score about -30 * sqrt(D) * scale: lse far below 0
        q[..., 0], k[..., 0] = 1.0, -30.0 * spec.head_dim ** 0.5
    return q, k, v, dout


def _cu(lengths: Sequence[int], device: torch.device) -> Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def _bhsd(x: Tensor) -> Tensor:  # [T, H, D] -> [1, H, T, D] view, as the ring passes blocks
    return x.unsqueeze(0).transpose(1, 2)


REFERENCE_ROWS = 1024  # query rows per fp64 reference call (bounds its score matrix at long blocks)


def _reference_sequence(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, causal: bool, scale: float
                        ) -> list[Tensor]:
    """fp64 (out, lse, dq, dk, dv) of one sequence ``[1, H, S, D]``, :data:`REFERENCE_ROWS` query rows at a time
    (causal: top-left, a square)."""
    outs, lses, dqs = [], [], []
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for r0 in range(0, q.shape[2], REFERENCE_ROWS):
        r1 = min(r0 + REFERENCE_ROWS, q.shape[2])
        cols = r1 if causal else k.shape[2]
        mask = None
        if causal:
            mask = torch.arange(r0, r1, device=q.device)[:, None] >= torch.arange(cols, device=q.device)[None, :]
        qc, kc, vc, dc = q[:, :, r0:r1], k[:, :, :cols], v[:, :, :cols], dout[:, :, r0:r1]
        out, lse = reference_forward(qc, kc, vc, False, scale, mask)
        gq, gk, gv = reference_backward(dc, qc, kc, vc, out, lse, False, scale, mask)
        outs.append(out), lses.append(lse), dqs.append(gq)
        dk[:, :, :cols] += gk
        dv[:, :, :cols] += gv
    return [torch.cat(outs, 2), torch.cat(lses, 2), torch.cat(dqs, 2), dk, dv]


def _reference(case: Case, q: Tensor, k: Tensor, v: Tensor, dout: Tensor, scale: float) -> list[Tensor]:
    """fp64 (out, lse [H, Tq], dq, dk, dv), sequence by sequence (a one-row causal query sees every key:
    bottom-right)."""
    parts: list[list[Tensor]] = []
    q0 = k0 = 0
    for nq, nk in zip(case.q_lens, case.k_lens):
        sq, sk = slice(q0, q0 + nq), slice(k0, k0 + nk)
        res = _reference_sequence(*(_bhsd(t[s]) for t, s in ((q, sq), (k, sk), (v, sk), (dout, sq))),
                                  case.causal and nq == nk, scale)
        parts.append([res[0][0].transpose(0, 1), res[1][0], *(g[0].transpose(0, 1) for g in res[2:])])
        q0, k0 = q0 + nq, k0 + nk
    return [torch.cat([p[i] for p in parts], dim=1 if i == 1 else 0) for i in range(5)]


def _run(kernel: Kernel, kind: str, case: Case, q: Tensor, k: Tensor, v: Tensor, dout: Tensor,
         scale: float) -> list[Tensor]:
    if kind == "dense":
        args = [_bhsd(t) for t in (q, k, v)]
        out, lse = kernel.forward(*args, case.causal, scale)
        grads = kernel.backward(_bhsd(dout), *args, out, lse, case.causal, scale)
        return [out[0].transpose(0, 1), lse[0], *(g[0].transpose(0, 1) for g in grads)]
    assert kernel.varlen_forward is not None and kernel.varlen_backward is not None
    cu_q, cu_k = _cu(case.q_lens, q.device), _cu(case.k_lens, q.device)  # distinct tensors, as the ring's
    max_q, max_k = max(case.q_lens), max(case.k_lens)
    out, lse = kernel.varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, case.causal, scale)
    lse = lse.contiguous()
    grads = kernel.varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, case.causal, scale)
    return [out, lse, *grads]


def check_cases(kernel: Kernel, spec: ProbeSpec, device: torch.device) -> str | None:
    """Run ``kernel`` on every :func:`probe_cases` case of ``spec`` against fp64, synchronising after each: None
    when all agree within :data:`PROBE_TOLERANCE` (max error over the larger of max magnitude and 1: the inputs
    are of order 1, and a result near 0, as dQ of a one-key causal row, is judged by its absolute error) and are
    finite, else one line naming the first that does not
    (a fault on the device ends the process instead: what :func:`probe_in_subprocess` is for)."""
    dtype = getattr(torch, spec.dtype)
    scale = spec.head_dim ** -0.5
    gen = torch.Generator().manual_seed(0)
    names = ("out", "lse", "dq", "dk", "dv")
    with torch.autocast(device.type, enabled=False):
        for case in probe_cases(spec.kind, spec.block_len, kernel.varlen_bottom_right):
            _lengths_ok(case)
            given = [t.to(dtype) for t in _inputs(case, spec, device, gen)]
            want = _reference(case, *(t.to(torch.float64) for t in given), scale)  # the kernel's own inputs
            got = _run(kernel, spec.kind, case, *given, scale)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            for name, g, w in zip(names, got, want):
                g = g.to(torch.float64)
                error = float((g - w).abs().max() / w.abs().max().clamp(min=1.0))  # of values of order 1
                if case.negative and name == "dq":  # the common score shift cancels in dQ: finiteness only
                    error = 0.0
                if not torch.isfinite(g).all() or not error <= PROBE_TOLERANCE:
                    return (f"{kernel.name} ({spec.kind}) wrong on q lengths {list(case.q_lens)}, k lengths "
                            f"{list(case.k_lens)}, causal={case.causal}: {name} off by {error:.3g} (relative)")
    return None


# ---------------------------------------------------------------- the subprocess


def kernels_by_name() -> dict[str, Kernel]:
    """The kernels a probe can name."""
    from loongtrain.attn.cuda_kernels import (
        CUDA_CUDNN,
        CUDA_EFFICIENT,
        CUDA_EFFICIENT_PADDED,
        CUDA_FLASH,
        CUDA_FLASH_PADDED,
    )
    return {k.name: k for k in (CUDA_FLASH, CUDA_CUDNN, CUDA_EFFICIENT, CUDA_FLASH_PADDED, CUDA_EFFICIENT_PADDED)}


PROBE_COMMAND = (sys.executable, "-m", "loongtrain.attn.kernel_probe")
_VERDICTS: dict[tuple[Versions, ProbeSpec], str | None] = {}


def probe_in_subprocess(spec: ProbeSpec, command: Sequence[str] = PROBE_COMMAND,
                        timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """None when ``spec``'s kernel passed :func:`check_cases` in a fresh process (``command`` + the spec as
    JSON), else the one line of why (its wrong result, its crash, or its timeout). Kept per process."""
    key = (current_versions(), spec)
    if key in _VERDICTS:
        return _VERDICTS[key]
    try:
        done = subprocess.run([*command, json.dumps(asdict(spec))], capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        verdict: str | None = f"{spec.kernel} ({spec.kind}) probe did not finish in {timeout_s:.0f} s"
    else:
        lines = [line for line in (done.stdout + "\n" + done.stderr).splitlines() if line.strip()]
        last = lines[-1].strip() if lines else ""
        if done.returncode == 0:
            verdict = None
        elif done.returncode == 1 and last.startswith(spec.kernel):  # check_cases's own line
            verdict = last
        else:
            how = f"signal {-done.returncode}" if done.returncode < 0 else f"exit status {done.returncode}"
            verdict = f"{spec.kernel} ({spec.kind}) probe crashed ({how}): {last[:300] or 'no output'}"
    _VERDICTS[key] = verdict
    return verdict


def clear_verdicts() -> None:
    """Forget every probe verdict."""
    _VERDICTS.clear()


def main(argv: Sequence[str], kernels: dict[str, Kernel] | None = None) -> int:
    """The probe process: ``argv[0]`` a :class:`ProbeSpec` as JSON; prints ``ok`` (status 0) or the one line of
    :func:`check_cases` (status 1)."""
    spec = ProbeSpec(**json.loads(argv[0]))
    kernel = (kernels or kernels_by_name())[spec.kernel]
    reason = check_cases(kernel, spec, torch.device(spec.device))
    print(reason or "ok", flush=True)
    return 1 if reason else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
