"""The CUDA kernels of :mod:`loongtrain.attn.kernels` (the table there): FlashAttention-2, cuDNN and
the memory-efficient op, through the torch 2.13 ops, with their variable-length forms (docs/attention.md#kernels).
FA2 also takes its own sliding window (``Kernel.windowed``: ``window=(left, right)``, through
``_flash_attention_forward`` / ``_flash_attention_backward``'s ``window_size_left`` / ``window_size_right``, dense
calls on ``[B, S, H, D]`` views without ``cum_seq``).

(``cuda_flash_padded``, ``cuda_efficient_padded``: the same ops on a head dim zero-padded to a multiple of 8,
:func:`~loongtrain.attn.kernels.head_dim_padded`.) ``cuda_flash``'s and
``cuda_cudnn``'s dense backwards run one query head at a time once their own scratch
(:func:`backward_scratch_bytes`, which the planner counts) would pass :data:`SPLIT_BACKWARD_BYTES`
(:func:`per_head_backward`; docs/memory.md).

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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from loongtrain.attn.kernels import (
    Kernel,
    Seqlens,
    Tensor,
    VarlenMask,
    dense_layout,
    expand_kv,
    head_dim_padded,
    reduce_kv_grad,
)

# the op namespace the CUDA wrappers call; tests swap in a CPU emulation (tests/helpers/cuda_emulation.py)
_aten = torch.ops.aten


# ---------------------------------------------------------------- CUDA: FlashAttention-2 (GQA native)


def _cuda_flash_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float,
                        window: tuple[int, int] | None = None) -> tuple[Tensor, Tensor]:
    if window is not None:  # FA2's own window argument: _flash_attention_forward on [B, S, H, D] views
        res = _aten._flash_attention_forward(*(t.transpose(1, 2) for t in (q, k, v)), None, None, q.shape[2],
                                             k.shape[2], 0.0, causal, False, scale=scale, **_window(window))
        return res[0].transpose(1, 2), res[1]  # (out [B, S, H, D], lse [B, H, S] fp32, rng_state, unused, ...)
    res = _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return res[0], res[1]  # (out, lse [B, H, S] fp32, cum_seq_q, cum_seq_k, max_q, max_k, rng_state, ...)


def _window(window: tuple[int, int] | None) -> dict:
    """FA2's ``window_size_left`` / ``window_size_right`` keywords (none: no window)."""
    return {} if window is None else {"window_size_left": window[0], "window_size_right": window[1]}


#: bytes of a kernel's own backward scratch (:func:`backward_scratch_bytes`) above which the flash and cuDNN
#: backwards run one query head at a time (4 GiB: at 4096 query-head dims, 256K tokens in one call)
SPLIT_BACKWARD_BYTES = 4 << 30
#: the kernels whose backward scratch :func:`backward_scratch_bytes` describes (the planner's choice set,
#: ``Cluster.attention_kernels``)
SCRATCH_KERNELS = ("cuda_flash", "cuda_cudnn")


#: streaming multiprocessors of the planner's default device (H100 and H200 SXM: 132), which FA2's deterministic
#: backward sizes its dQ accumulators by (:func:`deterministic_dq_copies`)
SM_COUNT = 132


def deterministic_dq_copies(batch: int, heads: int, sm_count: int = SM_COUNT) -> int:
    """fp32 dQ accumulators FA2's deterministic backward keeps (torch's ``mha_bwd`` / ``mha_varlen_bwd`` under
    ``torch.use_deterministic_algorithms(True)``): ``ceil(SMs / (B * H))`` instead of one, one per split of the key
    blocks, summed in a fixed order afterwards. A few heads per rank (large ``hp``), or the per-head split, makes it
    about ``SMs`` copies of one head's dQ."""
    return max(1, -(-sm_count // (batch * heads)))


def _one_call_scratch(kernel: str, batch: int, heads: int, kv_heads: int, q_len: int, k_len: int, head_dim: int,
                      dtype_bytes: int, deterministic_sms: int | None = None) -> int:
    """One backward call's own allocations beside its inputs and results: both kernels keep an fp32 dQ
    accumulator (``4 * B * Sq * H * D``; FA2's deterministic backward on a device of ``deterministic_sms`` SMs
    :func:`deterministic_dq_copies` of it) and the fp32 row sums of ``dO * O`` (``4 * B * H * Sq``: FA2's
    ``softmax_d``, cuDNN's ``softmax_sum``), and with GQA dK and dV expanded to the query heads in the input dtype
    (``2 * B * Sk * H * D`` elements: FA2's expanded dK/dV, cuDNN's "full-head" dK/dV). The kernels' rounding of
    ``Sq`` (FA2: to 128) is left out."""
    assert kernel in SCRATCH_KERNELS, kernel
    expanded = 2 * batch * k_len * heads * head_dim * dtype_bytes if kv_heads != heads else 0
    copies = 1
    if deterministic_sms is not None and kernel == "cuda_flash":
        copies = deterministic_dq_copies(batch, heads, deterministic_sms)
    return 4 * batch * heads * q_len * (copies * head_dim + 1) + expanded


def backward_scratch_bytes(kernel: str, batch: int, heads: int, kv_heads: int, q_len: int, k_len: int,
                           head_dim: int, dtype_bytes: int, deterministic_sms: int | None = None) -> int:
    """Peak bytes ``kernel``'s backward (``cuda_flash`` or ``cuda_cudnn``) holds beside its inputs and
    results for q ``[B, H, Sq, D]`` against k/v ``[B, Hkv, Sk, D]``: one call's scratch
    (:func:`_one_call_scratch`; ``deterministic_sms``: FA2's deterministic backward on a device of that many SMs,
    None: not deterministic), or past :data:`SPLIT_BACKWARD_BYTES` (:func:`per_head_backward`, decided on the
    non-deterministic scratch) one head's, with that head's dQ, dK, dV and the fp32 sums of a KV head's dK/dV (and
    their next sums) beside it. The planner (``workspace``, docs/planner.md#memory-per-device) and the simulation
    count it."""
    whole = _one_call_scratch(kernel, batch, heads, kv_heads, q_len, k_len, head_dim, dtype_bytes)
    if heads == 1 or whole <= SPLIT_BACKWARD_BYTES:
        return _one_call_scratch(kernel, batch, heads, kv_heads, q_len, k_len, head_dim, dtype_bytes,
                                 deterministic_sms)
    one = _one_call_scratch(kernel, batch, 1, 1, q_len, k_len, head_dim, dtype_bytes, deterministic_sms)
    return one + batch * head_dim * (q_len * dtype_bytes + 2 * k_len * (dtype_bytes + 2 * 4))


def largest_backward_scratch(kernels: tuple[str, ...], batch: int, heads: int, kv_heads: int, q_len: int,
                             k_len: int, head_dim: int, dtype_bytes: int, deterministic_sms: int | None = None) -> int:
    """The largest :func:`backward_scratch_bytes` among ``kernels`` (0 for none: CPU runs no CUDA kernel)."""
    return max((backward_scratch_bytes(k, batch, heads, kv_heads, q_len, k_len, head_dim, dtype_bytes,
                                       deterministic_sms) for k in kernels), default=0)


def _splits(kernel: str, q: Tensor, k: Tensor) -> bool:
    """Whether ``kernel``'s backward on these inputs runs per query head (its one-call scratch passes
    :data:`SPLIT_BACKWARD_BYTES`)."""
    b, h, sq, d = q.shape
    return h > 1 and _one_call_scratch(kernel, b, h, k.shape[1], sq, k.shape[2], d,
                                       q.element_size()) > SPLIT_BACKWARD_BYTES


def _cuda_flash_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float,
    window: tuple[int, int] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """FA2's backward; one query head per call when its scratch would pass :data:`SPLIT_BACKWARD_BYTES`
    (:func:`per_head_backward`: the scratch of one head, 1/H of it, and no expanded dK/dV)."""
    call = _cuda_flash_backward_call if window is None else _cuda_flash_window_backward
    extra = {} if window is None else {"window": window}
    if _splits("cuda_flash", q, k):
        return per_head_backward(call, dout, q, k, v, out, lse, causal, scale, **extra)
    return call(dout, q, k, v, out, lse, causal, scale, **extra)


def _cuda_flash_window_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float,
    window: tuple[int, int],
) -> tuple[Tensor, Tensor, Tensor]:
    """FA2's windowed backward (``_flash_attention_backward`` on ``[B, S, H, D]`` views, no ``cum_seq``)."""
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)  # no dropout: not read
    unused = torch.zeros((), dtype=torch.uint64, device=q.device)
    grads = _aten._flash_attention_backward(
        *(t.transpose(1, 2) for t in (dout, q, k, v, out)), dense_layout(lse), None, None, q.shape[2], k.shape[2],
        0.0, causal, rng_state, unused, scale=scale, **_window(window))
    return tuple(g.transpose(1, 2) for g in grads)


def per_head_backward(backward: Callable[..., tuple[Tensor, Tensor, Tensor]], dout: Tensor, q: Tensor, k: Tensor,
                      v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float,
                      **options) -> tuple[Tensor, Tensor, Tensor]:
    """``backward`` one query head at a time against its KV head (heads are independent; ``options``: its
    keywords, e.g. a window): dQ the same bits,
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
                                  causal, scale, **options)
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
        dout, q, k, v, out, dense_layout(lse), None, None, q.shape[2], k.shape[2], 0.0, causal,
        rng_state, unused, scale=scale,
    )
    return dq, dk, dv


def _cuda_flash_varlen_forward(q: Tensor, k: Tensor, v: Tensor, seqlens: Seqlens,
                               mask: VarlenMask) -> tuple[Tensor, Tensor]:
    """Packed sequences (module docstring): out ``[Tq, H, D]``, lse fp32 ``[H, Tq]``."""
    res = _aten._flash_attention_forward(q, k, v, *seqlens, 0.0, mask.causal, False, scale=mask.scale,
                                         **_window(mask.window))
    return res[0], res[1]  # (out, lse, rng_state, unused, debug_attn_mask)


def _cuda_flash_varlen_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                                seqlens: Seqlens, mask: VarlenMask) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of :func:`_cuda_flash_varlen_forward`; the op reads lse as a dense ``[H, Tq]`` buffer."""
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)  # no dropout: not read
    unused = torch.zeros((), dtype=torch.uint64, device=q.device)
    dq, dk, dv = _aten._flash_attention_backward(
        dout, q, k, v, out, dense_layout(lse), *seqlens, 0.0, mask.causal, rng_state, unused, scale=mask.scale,
        **_window(mask.window),
    )
    return dq, dk, dv


# ---------------------------------------------------------------- CUDA: memory-efficient (expands K/V)

_EFFICIENT_LSE_ALIGN = 32  # the op pads lse along S to a multiple of this


def _cuda_efficient_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
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
    k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    seed = torch.zeros((), dtype=torch.int64, device=q.device)  # no dropout: not read
    offset = torch.zeros((), dtype=torch.int64, device=q.device)
    dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, _padded_lse(lse), seed, offset, 0.0, [True, True, True, False], causal,
        scale=scale,
    )
    return dq, reduce_kv_grad(dk, num_kv_heads), reduce_kv_grad(dv, num_kv_heads)


# ---------------------------------------------------------------- CUDA: cuDNN (GQA native)


def _cuda_cudnn_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    res = _aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    return res[0], res[1].squeeze(-1)  # lse comes as [B, H, S, 1]


def _same_layout(dout: Tensor, out: Tensor) -> tuple[Tensor, Tensor]:
    """cuDNN takes dO in O's layout: both as they are when their strides agree, else both fresh row-major
    copies (``dense_layout`` alone keeps a contiguous tensor's strides of size-1 dims, which may still differ)."""
    if dout.stride() == out.stride():
        return dout, out
    return tuple(x.clone(memory_format=torch.contiguous_format) for x in (dout, out))


def _cuda_cudnn_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """cuDNN's backward; one query head per call when its scratch would pass :data:`SPLIT_BACKWARD_BYTES`
    (as FA2's)."""
    if _splits("cuda_cudnn", q, k):
        return per_head_backward(_cuda_cudnn_backward_call, dout, q, k, v, out, lse, causal, scale)
    return _cuda_cudnn_backward_call(dout, q, k, v, out, lse, causal, scale)


def _cuda_cudnn_backward_call(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    dout, out = _same_layout(dout, out)
    seed = torch.zeros((), dtype=torch.int64, device=q.device)  # no dropout: not read
    offset = torch.zeros((), dtype=torch.int64, device=q.device)
    dq, dk, dv = _aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, dense_layout(lse).unsqueeze(-1), seed, offset, None, None, None,
        q.shape[2], k.shape[2], 0.0, causal, scale=scale,
    )
    return dq, dk, dv


def _cuda_cudnn_varlen_forward(q: Tensor, k: Tensor, v: Tensor, seqlens: Seqlens,
                               mask: VarlenMask) -> tuple[Tensor, Tensor]:
    """Packed sequences in cuDNN's ragged layout: out ``[Tq, H, D]``, lse fp32 ``[H, Tq]`` (a view of the op's
    ``[Tq, H, 1]``). No window (not ``Kernel.windowed``)."""
    assert mask.window is None, "cuDNN's varlen op takes no window"
    res = _aten._cudnn_attention_forward(q, k, v, None, *seqlens, True, 0.0, mask.causal, False, scale=mask.scale)
    return res[0], res[1].squeeze(-1).t()  # (out, lse, cum_seq_q, cum_seq_k, max_q, max_k, seed, offset, mask)


def _cuda_cudnn_varlen_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                                seqlens: Seqlens, mask: VarlenMask) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of :func:`_cuda_cudnn_varlen_forward`; lse ``[H, Tq]`` goes back in the op's ``[Tq, H, 1]``."""
    assert mask.window is None, "cuDNN's varlen op takes no window"
    dout, out = _same_layout(dout, out)
    seed = torch.zeros((), dtype=torch.int64, device=q.device)  # no dropout: not read
    offset = torch.zeros((), dtype=torch.int64, device=q.device)
    dq, dk, dv = _aten._cudnn_attention_backward(
        dout, q, k, v, out, dense_layout(lse.t()).unsqueeze(-1), seed, offset, None, *seqlens, 0.0, mask.causal,
        scale=mask.scale,
    )
    return dq, dk, dv


CUDA_FLASH = Kernel("cuda_flash", _cuda_flash_forward, _cuda_flash_backward,
                    _cuda_flash_varlen_forward, _cuda_flash_varlen_backward, windowed=True)
CUDA_EFFICIENT = Kernel("cuda_efficient", _cuda_efficient_forward, _cuda_efficient_backward)
CUDA_CUDNN = Kernel("cuda_cudnn", _cuda_cudnn_forward, _cuda_cudnn_backward, _cuda_cudnn_varlen_forward,
                    _cuda_cudnn_varlen_backward, varlen_bottom_right=False)
# dense calls only, no window (packed documents and windows: one dense call per piece)
CUDA_FLASH_PADDED = head_dim_padded(
    dataclasses.replace(CUDA_FLASH, varlen_forward=None, varlen_backward=None, windowed=False), 8, "cuda_flash_padded")
CUDA_EFFICIENT_PADDED = head_dim_padded(CUDA_EFFICIENT, 8, "cuda_efficient_padded")


def narrowed(kernel: Kernel, fallback: Kernel, max_rows: int) -> Kernel:
    """``kernel``'s dense calls of more than ``max_rows`` query rows, ``fallback``'s for the others (a known bug
    reachable only with that few rows, docs/kernels.md#safety); named ``<kernel>_rows<max_rows + 1>``. No varlen op
    (judged on its own). Both give lse ``[B, H, S]``, so the backward of a call goes where its forward went."""

    def pick(q: Tensor) -> Kernel:
        return fallback if q.shape[2] <= max_rows else kernel

    def forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        return pick(q).forward(q, k, v, causal, scale)

    def backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                 scale: float) -> tuple[Tensor, Tensor, Tensor]:
        return pick(q).backward(dout, q, k, v, out, lse, causal, scale)

    return Kernel(f"{kernel.name}_rows{max_rows + 1}", forward, backward)


#: cuDNN on cuDNN <= 9.26 (its one-row NaN bug, NVIDIA/cudnn-frontend#1072): one-row calls on FA2
CUDA_CUDNN_ROWS2 = narrowed(CUDA_CUDNN, CUDA_FLASH, 1)
CUDA_KERNELS = (CUDA_FLASH, CUDA_CUDNN, CUDA_EFFICIENT, CUDA_FLASH_PADDED, CUDA_EFFICIENT_PADDED)
