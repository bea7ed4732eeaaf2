"""The local kernels of linear attention and their choice (docs/linear-attention.md#kernels).

Every kernel maps ``q, k [N, T, H, Dk]`` (L2-normalised, not scaled), ``v [N, T, H, Dv]``, ``g [N, T, H]`` or
``[N, T, H, Dk]``, ``beta [N, T, H]``, ``starts [N, T]`` (document starts, or None) and ``initial_state
[N, H, Dk, Dv]`` (or None) to ``(o [N, T, H, Dv], final state [N, H, Dk, Dv])``, with the same gradients:

- ``torch``: :func:`loongtrain.model.delta_rule.delta_rule` in fp64 for fp64 inputs, fp32 otherwise; everywhere.
- ``fla``: flash-linear-attention's ``chunk_gated_delta_rule`` (a gate per head) or ``chunk_kda`` (a gate per
  channel) on CUDA for fp16/bf16 inputs when ``fla`` is installed; the sequences and their documents become one
  variable-length call (``cu_seqlens``), each piece with its initial state (a document's is zero).

Like the attention kernels' varlen check (docs/attention.md#kernels), ``fla`` is first run once untimed on a small
problem with documents and initial states against the ``torch`` kernel on the same inputs; more than 5% off (max
error over max magnitude of the output and the final state) it is not used, and the refusal is logged. The choice
is kept per process and ``(device, dtype, gate form)``.
"""

from __future__ import annotations

import importlib
import logging

import torch

from loongtrain.model.delta_rule import compute_dtype, delta_rule

Tensor = torch.Tensor
log = logging.getLogger(__name__)

LINEAR_KERNELS = ("fla", "torch")
_FLA_DTYPES = (torch.float16, torch.bfloat16)
_TOLERANCE = 0.05
_CHOSEN: dict[tuple[str, str, bool], str] = {}
_REFUSED: dict[tuple[str, str, bool], str] = {}


def fla_function(per_channel: bool):
    """``fla``'s chunked kernel of the gate form, or None when ``fla`` is not importable."""
    module, name = ("fla.ops.kda", "chunk_kda") if per_channel else ("fla.ops.gated_delta_rule",
                                                                      "chunk_gated_delta_rule")
    try:
        return getattr(importlib.import_module(module), name)
    except Exception:  # noqa: BLE001 - a missing or broken install alike: the torch kernel runs
        return None


def kernel_options(device: torch.device, dtype: torch.dtype, per_channel: bool) -> list[str]:
    """The kernels the rules admit, preferred first: ``fla`` (CUDA, fp16/bf16, installed), then ``torch``."""
    fla = device.type == "cuda" and dtype in _FLA_DTYPES and fla_function(per_channel) is not None
    return ["fla", "torch"] if fla else ["torch"]


def choose_kernel(device: torch.device, dtype: torch.dtype, per_channel: bool) -> str:
    """The kernel for these inputs: the first of :func:`kernel_options` that passes its check (kept)."""
    key = (str(device), str(dtype), per_channel)
    if key not in _CHOSEN:
        choice = "torch"
        if kernel_options(device, dtype, per_channel)[0] == "fla":
            problem = check_fla(device, dtype, per_channel)
            if problem is None:
                choice = "fla"
            else:
                _REFUSED[key] = problem
                log.warning("linear attention: fla's kernel refused on %s %s (%s); the torch kernel runs", device,
                            dtype, problem)
        _CHOSEN[key] = choice
        log.info("linear attention kernel on %s %s, %s gate: %s", device, dtype,
                 "per-channel" if per_channel else "per-head", choice)
    return _CHOSEN[key]


def chosen_linear_kernels() -> dict[str, str]:
    """``"device dtype gate" -> kernel`` of the choices made in this process (for logs and reports)."""
    return {f"{d} {t} {'channel' if c else 'head'}": k for (d, t, c), k in _CHOSEN.items()}


def clear_linear_choices() -> None:
    _CHOSEN.clear()
    _REFUSED.clear()


def run_kernel(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, starts: Tensor | None,
               initial_state: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
    """The chosen kernel (:func:`choose_kernel`) on these inputs (module docstring for the shapes)."""
    per_channel = g.dim() == 4
    if choose_kernel(q.device, v.dtype, per_channel) == "fla":
        return fla_kernel(q, k, v, g, beta, starts, initial_state, scale)
    return torch_kernel(q, k, v, g, beta, starts, initial_state, scale)


def torch_kernel(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, starts: Tensor | None,
                 initial_state: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
    dtype = compute_dtype(v.dtype)
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    state = None if initial_state is None else initial_state.to(dtype)
    return delta_rule(q, k, v, g, beta, scale=scale, starts=starts, initial_state=state)


def fla_kernel(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, starts: Tensor | None,
               initial_state: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
    """``fla``'s kernel as one variable-length call: the ``N`` sequences cut at their document starts into
    pieces (``cu_seqlens`` over the flattened tokens); a sequence's first piece starts from its initial state,
    a document's from zero; each sequence's final state is its last piece's."""
    n, t, heads, dk = k.shape
    dv = v.shape[-1]
    cut = torch.zeros(n, t, dtype=torch.bool)
    cut[:, 0] = True
    if starts is not None:
        cut |= starts.cpu()
    first = cut.flatten().nonzero().flatten()
    cu_seqlens = torch.cat([first, torch.tensor([n * t])]).to(device=q.device, dtype=torch.int64)
    sequence = torch.div(first, t, rounding_mode="floor")
    continues = ~(starts.cpu().flatten()[first] if starts is not None else torch.zeros(len(first), dtype=torch.bool))
    continues &= first % t == 0  # a sequence's first piece, unless a document starts there
    dtype, accumulate = v.dtype, compute_dtype(v.dtype)  # gates and states in fp32 (fp64 stays fp64)
    state = (initial_state if initial_state is not None
             else torch.zeros(n, heads, dk, dv, dtype=accumulate, device=q.device))
    state = state.to(accumulate)[sequence.to(q.device)]
    state = state * continues.to(device=q.device, dtype=state.dtype)[:, None, None, None]
    flat = [x.reshape(1, n * t, *x.shape[2:]) for x in (q.to(dtype), k.to(dtype), v, g.to(accumulate),
                                                         beta.to(dtype))]
    o, final = fla_function(g.dim() == 4)(*flat, scale=scale, initial_state=state.contiguous(),
                                          output_final_state=True, cu_seqlens=cu_seqlens)
    last = torch.cat([first[1:], torch.tensor([n * t])]) - 1  # the token each piece ends at
    ends = (last % t == t - 1).nonzero().flatten().to(final.device)  # a sequence's last piece
    return o.reshape(n, t, heads, dv).to(accumulate), final[ends]


def check_fla(device: torch.device, dtype: torch.dtype, per_channel: bool) -> str | None:
    """None if ``fla``'s kernel matches the torch kernel within 5% on a small problem with documents and initial
    states (run once, untimed), else what differs (or what it raised)."""
    gen = torch.Generator().manual_seed(0)
    n, t, heads, dk, dv = 2, 96, 2, 64, 64

    def rand(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen).to(device)

    try:
        q, k = (torch.nn.functional.normalize(rand(n, t, heads, dk), dim=-1).to(dtype) for _ in range(2))
        v = rand(n, t, heads, dv).to(dtype)
        g = -torch.nn.functional.softplus(rand(n, t, heads, *((dk,) if per_channel else ()))) * 0.1
        beta = torch.sigmoid(rand(n, t, heads)).to(dtype)
        starts = torch.zeros(n, t, dtype=torch.bool)
        starts[0, 37] = starts[1, 0] = starts[1, 70] = True
        starts = starts.to(device)
        state = rand(n, heads, dk, dv) * 0.1
        got = fla_kernel(q, k, v, g, beta, starts, state, dk ** -0.5)
    except Exception as exc:  # noqa: BLE001 - any failure refuses the kernel
        return f"{type(exc).__name__}: {exc}"
    want = torch_kernel(q, k, v, g, beta, starts, state, dk ** -0.5)
    for name, a, b in zip(("output", "final state"), got, want):
        if a.shape != b.shape:
            return f"{name} shape {tuple(a.shape)} != {tuple(b.shape)}"
        error = float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-12))
        if not error <= _TOLERANCE:
            return f"{name} off by {error:.3g} of its largest magnitude"
    return None
