"""Local attention kernels returning ``(out, lse)`` with an explicit backward (docs/design.md §6).

All tensors are ``[B, H, S, D]``, possibly non-contiguous (transposed views of ``[B, S, H, D]``, slices
along S); ``lse`` is ``[B, H, S]`` (natural log; fp32, fp64 for the fp64 kernels). Causal masks are
top-left aligned and only used with ``Sq == Sk``. K/V may have fewer heads than Q (GQA, docs/design.md
§5); the returned dK/dV have K/V's head count.

Kernels and the torch 2.13 ops behind them (schemas: ``torch.ops.aten.<op>.default._schema``):

=================  ==========================================================  ======================
kernel             op (forward / backward)                                       GQA
=================  ==========================================================  ======================
``cpu_flash``      ``_scaled_dot_product_flash_attention_for_cpu[_backward]``    native
``cuda_flash``     ``_scaled_dot_product_flash_attention[_backward]`` (FA2)      native
``cuda_cudnn``     ``_scaled_dot_product_cudnn_attention[_backward]``            native
``cuda_efficient`` ``_scaled_dot_product_efficient_attention[_backward]``        K/V expanded here
``reference``      plain math; materialises the ``Sq x Sk`` score matrix         K/V expanded here
=================  ==========================================================  ======================

(``cuda_flash_padded``, ``cuda_efficient_padded``: the same ops on a zero-padded head dim.) ``cuda_flash``'s
backward runs one query head at a time once FA2's own workspace would pass :data:`SPLIT_BACKWARD_BYTES`
(:func:`per_head_backward`; docs/design.md §7).

Variable-length form (``Kernel.varlen_forward`` / ``varlen_backward``; ``None`` where a kernel has none):
``cuda_flash`` through ``_flash_attention_forward`` / ``_flash_attention_backward`` (FA2's ``mha_varlen_fwd`` /
``mha_varlen_bwd``) and ``cuda_cudnn`` through ``_cudnn_attention_forward`` / ``_cudnn_attention_backward``
(cuDNN's ragged layout, the op behind torch's nested jagged tensors), each with ``cum_seq_q`` / ``cum_seq_k``
given. Tensors are packed: q ``[Tq, H, D]``, k/v ``[Tk, Hkv, D]`` (GQA native, unit last-dim stride),
sequence ``i`` being q rows ``[cu_q[i], cu_q[i+1])`` against k rows ``[cu_k[i], cu_k[i+1])`` (``cu_*`` int32,
contiguous, ``n + 1`` entries, starting at 0 and ending at the row count); the wrappers return lse fp32
``[H, Tq]`` (FA2 gives it so; cuDNN gives ``[Tq, H, 1]``, seen here as ``[H, Tq]``) and take it back so. FA2
aligns causal masks bottom-right per sequence (the ring packs causal squares, where both alignments agree,
and single query rows, which so see every key); cuDNN top-left, so only squares go into its causal calls
(``Kernel.varlen_bottom_right``). One call takes one causal flag for all its sequences.

The memory-efficient op needs equal head counts: K/V are broadcast to the query heads (a zero-stride
view for one KV head, a copy otherwise) and dK/dV summed back over each group. Its lse comes padded
along S to a multiple of 32 (``+inf`` in the padding); the forward returns the ``[:S]`` view and the
backward rebuilds that padded layout. The flash backward reads lse as a contiguous ``[B, H, S]``
buffer, so it gets ``lse.contiguous()`` (free when it already is); cuDNN's backward takes dO in O's
layout, so both are made contiguous when their strides differ. No other input is copied: the ops take
strided inputs with a unit last-dim stride. lse is passed on in the dtype given (the ring accumulates it
in fp32 for every dtype but fp64, which only the reference kernel handles on CUDA).

Which kernel runs where (capability rules and measurement): :mod:`loongtrain.attn.kernel_choice`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Tensor = torch.Tensor

# the op namespace the CUDA wrappers call; tests swap in a CPU emulation (tests/cuda_emulation.py)
_aten = torch.ops.aten


VarlenForward = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, int, int, bool, float], tuple[Tensor, Tensor]]
VarlenBackward = Callable[
    [Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, int, int, bool, float],
    tuple[Tensor, Tensor, Tensor],
]


@dataclass(frozen=True)
class Kernel:
    """A local attention kernel: ``forward(q, k, v, causal, scale) -> (out, lse)`` and ``backward(dout, q, k,
    v, out, lse, causal, scale) -> (dq, dk, dv)`` on ``[B, H, S, D]``; optionally the packed variable-length
    form ``varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale) -> (out, lse [H, Tq])`` and
    ``varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale)`` (module docstring);
    ``varlen_bottom_right``: whether the varlen op aligns a causal mask bottom-right (a single query row then
    sees every key), else top-left."""

    name: str
    forward: Callable[[Tensor, Tensor, Tensor, bool, float], tuple[Tensor, Tensor]]
    backward: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, bool, float], tuple[Tensor, Tensor, Tensor]]
    varlen_forward: VarlenForward | None = None
    varlen_backward: VarlenBackward | None = None
    varlen_bottom_right: bool = True


def _expand_kv(k: Tensor, num_heads: int) -> Tensor:
    """``[B, Hkv, S, D]`` -> ``[B, num_heads, S, D]``, query head ``h`` reading KV head ``h // group``.
    A view (zero head stride) when ``Hkv == 1``, a copy otherwise."""
    b, num_kv_heads, s, d = k.shape
    if num_kv_heads == num_heads:
        return k
    group = num_heads // num_kv_heads
    return k.unsqueeze(2).expand(b, num_kv_heads, group, s, d).reshape(b, num_heads, s, d)


def _dense(x: Tensor) -> Tensor:
    """``x.contiguous()``, spelled so that it also runs on fake CUDA tensors in a CPU-only build."""
    return x if x.is_contiguous() else x.clone(memory_format=torch.contiguous_format)


def _reduce_kv_grad(dk: Tensor, num_kv_heads: int) -> Tensor:
    b, h, s, d = dk.shape
    if h == num_kv_heads:
        return dk
    acc = torch.float32 if dk.dtype in (torch.float16, torch.bfloat16) else dk.dtype
    return dk.unflatten(1, (num_kv_heads, h // num_kv_heads)).sum(dim=2, dtype=acc).to(dk.dtype)


# ---------------------------------------------------------------- reference (plain math)


def _scores(q: Tensor, k: Tensor, scale: float, causal: bool, mask: Tensor | None) -> Tensor:
    """``q k^T * scale`` with invisible entries ``-inf`` (top-left causal, and/or an explicit ``[Sq, Sk]`` mask)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        tril = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        mask = tril if mask is None else mask & tril
    return scores if mask is None else scores.masked_fill(~mask, float("-inf"))


def reference_forward(
    q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, mask: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Plain-math attention; ``mask [Sq, Sk]`` (bool, True = visible) restricts it further. Every query
    row must see at least one key."""
    k, v = _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1])
    scores = _scores(q, k, scale, causal, mask)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v)
    return out, lse


def reference_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float,
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    num_kv_heads = k.shape[1]
    k, v = _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1])
    scores = _scores(q, k, scale, causal, mask)
    probs = torch.exp(scores - lse.unsqueeze(-1).to(scores.dtype))
    dv = torch.matmul(probs.transpose(-1, -2), dout)
    dprobs = torch.matmul(dout, v.transpose(-1, -2))
    delta = (dout * out).sum(dim=-1, keepdim=True)
    dscores = probs * (dprobs - delta) * scale
    dq = torch.matmul(dscores, k)
    dk = torch.matmul(dscores.transpose(-1, -2), q)
    return dq, _reduce_kv_grad(dk, num_kv_heads), _reduce_kv_grad(dv, num_kv_heads)


# ---------------------------------------------------------------- CPU flash op (GQA native)


def _cpu_native_gqa(q: Tensor, k: Tensor) -> bool:
    """The CPU op takes fewer KV heads natively; in fp16/bf16 its in-kernel dK/dV group sum rounds worse than
    expanding and summing the per-head gradients in fp32, so half dtypes expand (a copy, CPU only)."""
    return k.shape[1] == q.shape[1] or q.dtype not in (torch.float16, torch.bfloat16)


def _cpu_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    if not _cpu_native_gqa(q, k):
        k, v = _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1])
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def _cpu_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    if _cpu_native_gqa(q, k):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale
        )
    num_kv_heads = k.shape[1]
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1]), out, lse, 0.0, causal, scale=scale
    )
    return dq, _reduce_kv_grad(dk, num_kv_heads), _reduce_kv_grad(dv, num_kv_heads)


# ---------------------------------------------------------------- CUDA: FlashAttention-2 (GQA native)


def _cuda_flash_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    res = _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return res[0], res[1]  # (out, lse [B, H, S] fp32, cum_seq_q, cum_seq_k, max_q, max_k, rng_state, ...)


#: bytes of FA2's own backward workspace (:func:`flash_backward_workspace`) above which the flash backward
#: runs one query head at a time (4 GiB: at 4096 query-head dims, 256K tokens in one call)
SPLIT_BACKWARD_BYTES = 4 << 30


def flash_backward_workspace(q: Tensor, k: Tensor) -> int:
    """Bytes FA2's backward allocates beside its outputs for ``q [B, H, Sq, D]``: an fp32 dQ accumulator
    (``4 * B * Sq * H * D``) and, when K/V have fewer heads (GQA), dK and dV expanded to the query heads in the
    input dtype (``2 * B * Sk * H * D`` elements)."""
    b, h, _, d = q.shape
    expanded = 2 * b * k.shape[2] * h * d * q.element_size() if k.shape[1] != h else 0
    return 4 * q.numel() + expanded


def _cuda_flash_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """FA2's backward; one query head per call when its workspace would pass :data:`SPLIT_BACKWARD_BYTES`
    (:func:`per_head_backward`: the workspace of one head, 1/H of it, and no expanded dK/dV)."""
    if q.shape[1] > 1 and flash_backward_workspace(q, k) > SPLIT_BACKWARD_BYTES:
        return per_head_backward(_cuda_flash_backward_call, dout, q, k, v, out, lse, causal, scale)
    return _cuda_flash_backward_call(dout, q, k, v, out, lse, causal, scale)


def per_head_backward(backward: Callable[..., tuple[Tensor, Tensor, Tensor]], dout: Tensor, q: Tensor, k: Tensor,
                      v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """``backward`` one query head at a time against its KV head (heads are independent): dQ the same bits,
    each KV head's dK/dV the sum over its query heads' (GQA) in fp32 (fp64 for fp64), rounded once, as the
    kernels sum their expanded dK/dV. Outputs in the ``[B, S, H, D]`` storage the kernels give."""
    b, h, s, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    group = h // hk
    dq = q.new_empty(b, s, h, d).transpose(1, 2)
    dk, dv = (k.new_empty(b, sk, hk, d).transpose(1, 2) for _ in range(2))
    acc = torch.promote_types(torch.float32, k.dtype)
    for j in range(hk):
        sums: list[Tensor] = []
        for head in range(j * group, (j + 1) * group):
            one = slice(head, head + 1)
            gq, gk, gv = backward(dout[:, one], q[:, one], k[:, j:j + 1], v[:, j:j + 1], out[:, one], lse[:, one],
                                  causal, scale)
            dq[:, one] = gq
            sums = [gk.to(acc), gv.to(acc)] if not sums else [sums[0] + gk, sums[1] + gv]
        dk[:, j:j + 1], dv[:, j:j + 1] = sums[0], sums[1]
    return dq, dk, dv


def _cuda_flash_backward_call(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    # no dropout: the rng state is not read; shaped as the forward returns it (uint64 [2], uint64 [])
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)
    unused = torch.zeros((), dtype=torch.uint64, device=q.device)
    # cum_seq_q/k undefined (None): dense, not variable-length, batches
    dq, dk, dv = _aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, _dense(lse), None, None, q.shape[2], k.shape[2], 0.0, causal,
        rng_state, unused, scale=scale,
    )
    return dq, dk, dv


def _cuda_flash_varlen_forward(
    q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """Packed sequences (module docstring): out ``[Tq, H, D]``, lse fp32 ``[H, Tq]``."""
    res = _aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale)
    return res[0], res[1]  # (out, lse, rng_state, unused, debug_attn_mask)


def _cuda_flash_varlen_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_q: Tensor, cu_k: Tensor,
    max_q: int, max_k: int, causal: bool, scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of :func:`_cuda_flash_varlen_forward`; the op reads lse as a dense ``[H, Tq]`` buffer."""
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)  # no dropout: not read
    unused = torch.zeros((), dtype=torch.uint64, device=q.device)
    dq, dk, dv = _aten._flash_attention_backward(
        dout, q, k, v, out, _dense(lse), cu_q, cu_k, max_q, max_k, 0.0, causal, rng_state, unused, scale=scale,
    )
    return dq, dk, dv


# ---------------------------------------------------------------- CUDA: memory-efficient (expands K/V)

_EFFICIENT_LSE_ALIGN = 32  # the op pads lse along S to a multiple of this


def _cuda_efficient_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    k, v = _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1])
    out, lse, _, _ = _aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
    return out, lse.narrow(2, 0, q.shape[2])


def _padded_lse(lse: Tensor) -> Tensor:
    """``[B, H, S]`` -> the efficient forward's layout: ``[B, H, ceil(S/32)*32]``, ``+inf`` padding."""
    s = lse.shape[2]
    padded_len = -(-s // _EFFICIENT_LSE_ALIGN) * _EFFICIENT_LSE_ALIGN
    return torch.nn.functional.pad(lse, (0, padded_len - s), value=float("inf"))


def _cuda_efficient_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    num_kv_heads = k.shape[1]
    k, v = _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1])
    seed = torch.zeros((), dtype=torch.int64, device=q.device)  # no dropout: not read
    offset = torch.zeros((), dtype=torch.int64, device=q.device)
    dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, _padded_lse(lse), seed, offset, 0.0, [True, True, True, False], causal,
        scale=scale,
    )
    return dq, _reduce_kv_grad(dk, num_kv_heads), _reduce_kv_grad(dv, num_kv_heads)


# ---------------------------------------------------------------- CUDA: cuDNN (GQA native)


def _cuda_cudnn_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    res = _aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    return res[0], res[1].squeeze(-1)  # lse comes as [B, H, S, 1]


def _same_layout(dout: Tensor, out: Tensor) -> tuple[Tensor, Tensor]:
    """cuDNN takes dO in O's layout: both as they are when their strides agree, else both fresh row-major
    copies (``_dense`` alone keeps a contiguous tensor's strides of size-1 dims, which may still differ)."""
    if dout.stride() == out.stride():
        return dout, out
    return tuple(x.clone(memory_format=torch.contiguous_format) for x in (dout, out))


def _cuda_cudnn_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    dout, out = _same_layout(dout, out)
    seed = torch.zeros((), dtype=torch.int64, device=q.device)  # no dropout: not read
    offset = torch.zeros((), dtype=torch.int64, device=q.device)
    dq, dk, dv = _aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, _dense(lse).unsqueeze(-1), seed, offset, None, None, None,
        q.shape[2], k.shape[2], 0.0, causal, scale=scale,
    )
    return dq, dk, dv


def _cuda_cudnn_varlen_forward(
    q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """Packed sequences in cuDNN's ragged layout: out ``[Tq, H, D]``, lse fp32 ``[H, Tq]`` (a view of the op's
    ``[Tq, H, 1]``)."""
    res = _aten._cudnn_attention_forward(q, k, v, None, cu_q, cu_k, max_q, max_k, True, 0.0, causal, False,
                                         scale=scale)
    return res[0], res[1].squeeze(-1).t()  # (out, lse, cum_seq_q, cum_seq_k, max_q, max_k, seed, offset, mask)


def _cuda_cudnn_varlen_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_q: Tensor, cu_k: Tensor,
    max_q: int, max_k: int, causal: bool, scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of :func:`_cuda_cudnn_varlen_forward`; lse ``[H, Tq]`` goes back in the op's ``[Tq, H, 1]``."""
    dout, out = _same_layout(dout, out)
    seed = torch.zeros((), dtype=torch.int64, device=q.device)  # no dropout: not read
    offset = torch.zeros((), dtype=torch.int64, device=q.device)
    dq, dk, dv = _aten._cudnn_attention_backward(
        dout, q, k, v, out, _dense(lse.t()).unsqueeze(-1), seed, offset, None, cu_q, cu_k, max_q, max_k, 0.0,
        causal, scale=scale,
    )
    return dq, dk, dv


def _head_dim_padded(kernel: Kernel, multiple: int) -> Kernel:
    """``kernel`` on head dims zero-padded to a multiple of ``multiple``: exact (zero columns add nothing
    to ``q . k``, give zero output columns and receive zero gradients), at the cost of padded copies."""

    def pad(x: Tensor) -> Tensor:
        return torch.nn.functional.pad(x, (0, -x.shape[-1] % multiple))

    def forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        out, lse = kernel.forward(pad(q), pad(k), pad(v), causal, scale)
        return out.narrow(-1, 0, v.shape[-1]), lse

    def backward(
        dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        dq, dk, dv = kernel.backward(pad(dout), pad(q), pad(k), pad(v), pad(out), lse, causal, scale)
        return dq.narrow(-1, 0, q.shape[-1]), dk.narrow(-1, 0, k.shape[-1]), dv.narrow(-1, 0, v.shape[-1])

    return Kernel(f"{kernel.name}_padded", forward, backward)


REFERENCE = Kernel("reference", reference_forward, reference_backward)
CPU_FLASH = Kernel("cpu_flash", _cpu_forward, _cpu_backward)
CUDA_FLASH = Kernel("cuda_flash", _cuda_flash_forward, _cuda_flash_backward,
                    _cuda_flash_varlen_forward, _cuda_flash_varlen_backward)
CUDA_EFFICIENT = Kernel("cuda_efficient", _cuda_efficient_forward, _cuda_efficient_backward)
CUDA_CUDNN = Kernel("cuda_cudnn", _cuda_cudnn_forward, _cuda_cudnn_backward, _cuda_cudnn_varlen_forward,
                    _cuda_cudnn_varlen_backward, varlen_bottom_right=False)
CUDA_FLASH_PADDED = _head_dim_padded(CUDA_FLASH, 8)
CUDA_EFFICIENT_PADDED = _head_dim_padded(CUDA_EFFICIENT, 8)
