"""The gated delta rule, computed a chunk of tokens at a time, and the short causal convolution before it
(docs/linear-attention.md). Plain math on one process: no mesh, no process group.

Per head, a state ``S`` (``Dk x Dv``) evolves token by token as

    S_t = (I - beta_t k_t k_t^T) diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,       o_t = S_t^T q_t

with ``g_t <= 0`` one log-decay per head (the gated delta rule of Qwen3.5 and Qwen3-Next) or one per key
channel (KDA, Kimi-Linear). A token that starts a document sees a zero state before it. The state is affine in
the state it starts from; that is what lets the context ranks exchange per-chunk pairs instead of passing the
state round the ring (loongtrain/attn/linear/).

Chunked form (one chunk of ``C`` tokens, ``G_t`` the cumulative log-decay inside it, ``S_0`` the state before
it): the written values ``U`` solve ``(I + A) U = beta V - beta exp(G) K S_0`` with ``A[t, s] = beta_t
<k_t, exp(G_t - G_s) k_s>`` for ``s < t``; then ``O = exp(G) Q S_0 + P U`` with ``P[t, s] = <q_t, exp(G_t - G_s)
k_s>`` for ``s <= t``, and ``S_C = exp(G_C) S_0 + (exp(G_C - G) K)^T U``. Every exponent is ``<= 0``. Pairs and
terms that cross a document start are masked out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Tensor = torch.Tensor

#: tokens per chunk of the chunked form (the intra-chunk matrices are ``C x C``)
CHUNK_SIZE = 64


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the recurrence runs in: fp64 stays fp64, every lower precision is upcast to fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def l2_normalize(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (the q/k normalisation of the delta-rule layers)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, scale: float,
               starts: Tensor | None = None, initial_state: Tensor | None = None,
               chunk_size: int = CHUNK_SIZE) -> tuple[Tensor, Tensor]:
    """The gated delta rule over ``N`` sequences, chunked (module docstring), in the inputs' dtype.

    ``q, k [N, T, H, Dk]`` (q is multiplied by ``scale`` here), ``v [N, T, H, Dv]``, ``g [N, T, H]`` (a gate per
    head) or ``[N, T, H, Dk]`` (a gate per key channel), log-space, ``<= 0``; ``beta [N, T, H]``; ``starts [N, T]``
    bool: the tokens that start a document (the state before them is zero), or None; ``initial_state
    [N, H, Dk, Dv]`` or None (zero). Returns ``o [N, T, H, Dv]`` and the final state ``[N, H, Dk, Dv]``."""
    n, t, h, dk = k.shape
    dv = v.shape[-1]
    per_channel = g.dim() == 4
    c = chunk_size
    pad = (-t) % c
    # padding after the last token: k = 0 writes nothing and g = 0 decays nothing, so the final state stands
    q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q * scale, k, v))
    beta = F.pad(beta, (0, 0, 0, pad))
    g = F.pad(g, (0, 0, 0, 0, 0, pad) if per_channel else (0, 0, 0, pad))
    chunks = (t + pad) // c
    # [N, H, n, C, ...]
    q, k, v = (x.transpose(1, 2).reshape(n, h, chunks, c, -1) for x in (q, k, v))
    beta = beta.transpose(1, 2).reshape(n, h, chunks, c)
    gates = g.transpose(1, 2).reshape(n, h, chunks, c, -1)  # last dim 1 (per head) or Dk
    cum = gates.cumsum(dim=3)

    seg = _segments(starts, n, t, pad, chunks, c, q.device)  # [N, 1, n, C] document index inside each chunk
    same = seg.unsqueeze(-1) == seg.unsqueeze(-2)  # [N, 1, n, C, C]
    carried = (seg == 0).to(q.dtype).unsqueeze(-1)  # the tokens the state before the chunk reaches
    last = (seg == seg[..., -1:]).to(q.dtype).unsqueeze(-1)  # the tokens that reach the state after it
    kept = (seg[..., -1] == 0).to(q.dtype)[..., None, None]  # [N, 1, n, 1, 1]: no document starts inside

    lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    strict = lower.logical_and(~torch.eye(c, dtype=torch.bool, device=q.device))
    if per_channel:  # exp(G_t - G_s) per key channel: [N, H, n, C, C, Dk]
        decay = (cum.unsqueeze(-2) - cum.unsqueeze(-3)).masked_fill(~lower[..., None], float("-inf")).exp()
        kk = torch.einsum("...tc,...tsc,...sc->...ts", k, decay, k)
        qk = torch.einsum("...tc,...tsc,...sc->...ts", q, decay, k)
    else:
        decay = (cum - cum.transpose(-1, -2)).masked_fill(~lower, float("-inf")).exp()
        kk = (k @ k.transpose(-1, -2)) * decay
        qk = (q @ k.transpose(-1, -2)) * decay
    system = (beta.unsqueeze(-1) * kk).masked_fill(~(strict & same), 0.0)
    pairs = qk.masked_fill(~(lower & same), 0.0)
    eye = torch.eye(c, dtype=q.dtype, device=q.device)
    # (I + A) X = B for B = beta V and beta exp(G) K
    solve = lambda rhs: torch.linalg.solve_triangular(system + eye, rhs, upper=False, unitriangular=True)  # noqa: E731
    written = solve(beta.unsqueeze(-1) * v)
    from_state = solve(beta.unsqueeze(-1) * cum.exp() * k * carried)
    q_state = cum.exp() * q * carried
    k_end = (cum[..., -1:, :] - cum).exp() * k * last
    end_decay = cum[..., -1, :].exp().unsqueeze(-1) * kept  # [N, H, n, Dk or 1, 1]

    state = (initial_state if initial_state is not None
             else torch.zeros(n, h, dk, dv, dtype=q.dtype, device=q.device))
    outs = []
    for i in range(chunks):
        u = written[:, :, i] - from_state[:, :, i] @ state
        outs.append(q_state[:, :, i] @ state + pairs[:, :, i] @ u)
        state = end_decay[:, :, i] * state + k_end[:, :, i].transpose(-1, -2) @ u
    o = torch.stack(outs, dim=2).reshape(n, h, chunks * c, dv)[:, :, :t]
    return o.transpose(1, 2), state


def _segments(starts: Tensor | None, n: int, t: int, pad: int, chunks: int, c: int,
              device: torch.device) -> Tensor:
    """``[N, 1, chunks, C]`` int: how many document starts precede each token inside its chunk (itself
    included); 0 marks the tokens the state before the chunk reaches."""
    if starts is None:
        return torch.zeros(n, 1, chunks, c, dtype=torch.int64, device=device)
    padded = F.pad(starts.to(device=device, dtype=torch.int64), (0, pad))
    return padded.reshape(n, 1, chunks, c).cumsum(dim=-1)


def short_conv(x: Tensor, weight: Tensor, bias: Tensor | None, visible: Tensor,
               activation: str | None) -> Tensor:
    """The depthwise causal convolution of the delta-rule layers on runs of tokens with their halos.

    ``x [N, K-1+T, C]``: each run's ``K - 1`` preceding tokens (its halo) then its ``T`` tokens; ``weight [C, K]``
    (``nn.Conv1d``'s ``[C, 1, K]`` squeezed: tap ``K-1`` is the token itself); ``visible [N, T, K]`` bool: whether
    token ``t`` sees the input ``j`` tokens back (False across a document start or before the sequence).
    Returns ``[N, T, C]``, then ``activation`` (``"silu"`` or None)."""
    taps = weight.shape[1]
    length = x.shape[1] - (taps - 1)
    out = None
    for j in range(taps):  # input j tokens back, times tap K-1-j
        term = x[:, taps - 1 - j: taps - 1 - j + length] * weight[:, taps - 1 - j] * visible[..., j: j + 1]
        out = term if out is None else out + term
    if bias is not None:
        out = out + bias
    if activation == "silu":
        out = F.silu(out)
    elif activation is not None:
        raise ValueError(f"short convolution activation={activation!r} is not one of ('silu', None)")
    return out
