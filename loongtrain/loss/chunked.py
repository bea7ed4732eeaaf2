"""Cross-entropy from the final hidden states and the LM head, a chunk of tokens at a time.

:func:`chunked_cross_entropy` has the contract of ``sharded_cross_entropy`` (loongtrain/loss/sharded.py)
but takes ``hidden [..., d]`` and the head ``weight [V, d]`` (tied or not) instead of logits, so no
rank ever holds the logits of all its tokens: one pass per chunk computes its logits, their
log-sum-exp, and (when gradients are wanted) the chunk's gradients for ``hidden``, the head and its bias
at once, so the logits are never recomputed (three matmuls per chunk, as many as the unchunked loss;
the backward only scales the gradients by the upstream gradient). Peak extra memory is one chunk's
working set, ``chunk_tokens * V * (bytes(compute) + bytes(stats))``, plus the head cast to the compute
dtype, instead of about fourteen bytes per logit of all tokens (:func:`chunked_loss_peak_bytes` term by
term); the gradients it returns exist from the forward on.

Precision: logits in the compute dtype (the autocast dtype when autocast is on for the inputs'
device, else the promoted dtype of ``hidden`` and ``weight``), soft-max statistics in float32 (float64
for float64 inputs), exactly as ``sharded_cross_entropy(F.linear(hidden, weight), ...)`` computes
them. Gradients of ``weight`` and ``bias`` are accumulated over chunks in their own dtype.

FSDP2: the function needs the *gathered* head weight (a plain tensor, not a sharded ``DTensor``).
Call it while the root module's parameters are unsharded, e.g. with the root wrapped by
``fully_shard(model, reshard_after_forward=False)`` (blocks keep their own setting), which is also
FSDP2's default for the root: the embedding and head are gathered for the whole forward anyway and
re-gathered at the start of the backward, so keeping them costs no extra peak.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from loongtrain.loss.sharded import IGNORE_INDEX, replica_mean
from loongtrain.model.rms_norm import rms_norm_backward, rms_norm_forward
from loongtrain.parallel.mesh import Mesh

Tensor = torch.Tensor

# Default chunk: fp32 logits of one chunk are at most this many bytes (512 tokens at V = 128K).
CHUNK_LOGITS_BYTES = 256 * 2**20


@dataclass(frozen=True)
class FinalNorm:
    """The model's final RMSNorm for :func:`chunked_cross_entropy`: its (gathered) ``weight``, ``eps`` and
    statistics dtype (None: :func:`loongtrain.model.rms_norm.rms_norm`'s default)."""

    weight: Tensor
    eps: float
    stats_dtype: torch.dtype | None = None


def default_chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk such that a chunk's fp32 logits take at most :data:`CHUNK_LOGITS_BYTES`.

    Independent of the sequence length, so the loss's peak is a constant for the planner; at
    V = 128K it is 512 tokens (a ``512 x d x 128K`` matmul per chunk, large enough to run at full rate).
    """
    return max(1, CHUNK_LOGITS_BYTES // (4 * vocab_size))


def _stats_dtype(compute: torch.dtype) -> torch.dtype:
    return torch.float64 if compute == torch.float64 else torch.float32


def _compute_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype ``F.linear(hidden, weight)`` would produce here (autocast-aware)."""
    device = hidden.device.type
    if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _chunk_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, dtype: torch.dtype) -> Tensor:
    """``hidden [c, d] @ weight.T (+ bias)`` in ``dtype``; ``weight`` is already in ``dtype``."""
    h = hidden.to(dtype)
    if bias is None:
        return h @ weight.T
    return torch.addmm(bias.to(dtype), h, weight.T)


def _chunks(n_tokens: int, chunk_tokens: int):
    """``(start, stop)`` of each chunk."""
    for start in range(0, n_tokens, chunk_tokens):
        yield start, min(start + chunk_tokens, n_tokens)


def _targets(labels: Tensor) -> tuple[Tensor, Tensor]:
    """``(valid, safe)``: which tokens count, and their labels with ignored ones replaced by 0."""
    valid = labels != IGNORE_INDEX
    return valid, labels.masked_fill(~valid, 0)


class _ChunkedCrossEntropy(torch.autograd.Function):
    """forward: ``sum over valid tokens of (lse - target logit)`` (a stats-dtype scalar). With ``fused``
    (gradients wanted) the same pass over each chunk's logits also turns them into ``softmax - onehot``
    (0 for ignored tokens) and pushes that through the head: the gradients for a unit upstream gradient,
    kept on ``ctx`` (they are the gradients the backward returns, computed early, not activations).
    backward: those gradients times the upstream gradient, in place. One matmul per chunk fewer than
    recomputing the logits in backward (three instead of four: as many as the unchunked loss). With
    ``norm_weight`` the final RMSNorm runs per chunk first (``hidden`` is its input) and its backward too, so
    neither the norm's input nor its output is kept: only the input's gradient (docs/memory.md)."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, norm_weight: Tensor | None,
                labels: Tensor, config: tuple[int, torch.dtype, bool, float, torch.dtype | None]) -> Tensor:
        """``config``: ``(chunk_tokens, compute dtype, fused, norm eps, norm statistics dtype)``."""
        chunk_tokens, compute, fused, eps, norm_stats = config
        stats = _stats_dtype(compute)
        need_h, need_w, need_b, need_n = (fused and t is not None and t.requires_grad
                                          for t in (hidden, weight, bias, norm_weight))
        grad_hidden = torch.empty_like(hidden) if need_h else None
        grad_weight = torch.zeros_like(weight) if need_w else None
        grad_bias = torch.zeros_like(bias) if need_b else None
        grad_norm = (torch.zeros(norm_weight.shape, dtype=_stats_dtype(norm_weight.dtype), device=norm_weight.device)
                     if need_n else None)
        local_sum = torch.zeros((), dtype=stats, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(compute)
            for start, stop in _chunks(hidden.shape[0], chunk_tokens):
                valid, safe = _targets(labels[start:stop])
                x = hidden[start:stop]
                normed, rstd = rms_norm_forward(x, norm_weight, eps, norm_stats) if norm_weight is not None \
                    else (x, None)
                h = normed.to(compute)
                z = _chunk_logits(h, w, bias, compute).to(stats)
                target = z.gather(1, safe[:, None]).squeeze(1)
                peak = z.amax(dim=1)
                # in place: z becomes exp(z - max), so the chunk never needs a second [c, V] buffer
                total = z.sub_(peak[:, None]).exp_().sum(dim=1)
                local_sum += torch.where(valid, peak + total.log() - target, 0).sum()
                if not (need_h or need_w or need_b or need_n):
                    continue
                # in place, z becomes d(local_sum)/d(logits) = softmax - onehot, 0 if ignored
                z.div_(total[:, None])
                z[torch.arange(stop - start, device=z.device), safe] -= 1
                z.mul_(valid[:, None])
                grad_z = z.to(compute)
                del z
                if rstd is not None and (need_h or need_n):  # through the norm: d(hidden) and d(norm weight)
                    gx, gn = rms_norm_backward((grad_z @ w).to(normed.dtype), x, norm_weight, rstd, need_h, need_n,
                                               weight_grad_dtype=None if grad_norm is None else grad_norm.dtype)
                    if need_h:
                        grad_hidden[start:stop] = gx
                    if need_n:
                        grad_norm += gn
                elif need_h:
                    grad_hidden[start:stop] = grad_z @ w
                if need_w:
                    _accumulate(grad_weight, grad_z.T, h)
                if need_b:
                    grad_bias += grad_z.sum(dim=0, dtype=stats).to(grad_bias.dtype)
                del grad_z  # before the next chunk's logits exist
        if grad_norm is not None:
            grad_norm = grad_norm.to(norm_weight.dtype)
        grads = (grad_hidden, grad_weight, grad_bias, grad_norm)
        ctx.present = tuple(g is not None for g in grads)
        # saved as tensors, so saved-tensor hooks (the memory report) see what the loss holds until backward
        ctx.save_for_backward(*(g for g in grads if g is not None))
        return local_sum

    @staticmethod
    def backward(ctx, grad_sum: Tensor):
        saved = iter(ctx.saved_tensors)
        grads = [next(saved) if present else None for present in ctx.present]
        out = tuple(g.mul_(grad_sum.to(g.dtype)) if g is not None else None for g in grads)
        return (*out, None, None)


def _accumulate(out: Tensor, a: Tensor, b: Tensor) -> None:
    """``out += a @ b`` for ``a [V, c]``: in place when the dtypes agree, else a block of rows at a time,
    each block's product no larger than ``a`` itself (so never a whole ``V x d`` temporary)."""
    if out.dtype == a.dtype:
        out.addmm_(a, b)
        return
    rows = max(1, a.numel() // b.shape[1])
    for start in range(0, out.shape[0], rows):
        out[start:start + rows] += a[start:start + rows] @ b


def chunked_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    mesh: Mesh | None,
    *,
    chunk_tokens: int | None = None,
    bias: Tensor | None = None,
    norm: FinalNorm | None = None,
) -> tuple[Tensor, Tensor]:
    """``(loss_for_backward, loss_value)`` for this rank's ``hidden [..., d]`` through the head ``weight [V, d]``.

    Same contract as ``sharded_cross_entropy(F.linear(hidden, weight, bias), labels, mesh)``: the
    replica loss is ``sum over the replica's valid tokens / their count`` (labels equal to
    ``IGNORE_INDEX`` = -100 are ignored); ``loss_for_backward = local_sum / replica_count``, so summing
    gradients over the sp ranks gives the exact full-sequence gradient; ``loss_value`` is the detached
    replica loss, identical on every sp rank. ``chunk_tokens`` defaults to
    :func:`default_chunk_tokens`. ``norm``: the final RMSNorm (:class:`FinalNorm`), applied a chunk at a time
    to ``hidden`` (then the norm's *input*), its backward too, so the loss keeps only ``hidden``'s gradient
    (same values as ``rms_norm`` before the loss, the gradients to rounding). Communication: forward, one
    all-reduce (sum) of two scalars over ``mesh.sp_group`` (none when ``mesh`` is None or ``sp == 1``);
    backward, none.
    """
    local_sum = chunked_token_sum(hidden, weight, labels, chunk_tokens=chunk_tokens, bias=bias, norm=norm)
    return replica_mean(local_sum, (labels != IGNORE_INDEX).sum(), mesh)


def chunked_token_sum(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    chunk_tokens: int | None = None,
    bias: Tensor | None = None,
    norm: FinalNorm | None = None,
) -> Tensor:
    """``sum over this rank's valid tokens of (lse - target logit)``: the differentiable local sum of
    :func:`chunked_cross_entropy` (statistics dtype), before any normalisation (arguments as there; the
    gradients computed in the forward, module docstring). Communication: none."""
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"hidden shape {tuple(hidden.shape)} must be labels shape {tuple(labels.shape)} + (dim,)"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight shape {tuple(weight.shape)} must be (vocab, {hidden.shape[-1]}) for hidden dim {hidden.shape[-1]}"
        )
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias shape {tuple(bias.shape)} must be ({weight.shape[0]},)")
    if isinstance(weight, DTensor) or isinstance(bias, DTensor):
        raise ValueError(
            "chunked_cross_entropy needs the gathered LM head weight, got a sharded DTensor: call it while "
            "FSDP2 holds the root unsharded (fully_shard(model, reshard_after_forward=False) for the root)"
        )
    if chunk_tokens is None:
        chunk_tokens = default_chunk_tokens(weight.shape[0])
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1")
    compute = _compute_dtype(hidden, weight)
    fused = torch.is_grad_enabled()  # the forward computes the gradients only when a backward may follow
    if norm is not None and (norm.weight.shape != hidden.shape[-1:] or isinstance(norm.weight, DTensor)):
        raise ValueError(f"norm weight shape {tuple(norm.weight.shape)} must be ({hidden.shape[-1]},), gathered")
    norm_weight, eps, stats = (norm.weight, norm.eps, norm.stats_dtype) if norm is not None else (None, 0.0, None)
    return _ChunkedCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, bias, norm_weight, labels.reshape(-1),
        (chunk_tokens, compute, fused, eps, stats),
    )


def chunked_loss_peak_bytes(
    tokens: int, vocab_size: int, dim: int, *, chunk_tokens: int | None = None,
    compute_bytes: int = 2, weight_bytes: int = 4, stats_bytes: int = 4,
) -> int:
    """Predicted peak bytes the chunked loss allocates beyond its inputs and the gradients it returns.

    With ``c = min(tokens, chunk_tokens)``, ``b`` compute, ``s`` stats and ``w`` weight bytes:
    ``tokens * s`` (a per-token log-sum-exp: the fused pass keeps none, so this term is a small
    over-estimate, kept so that the bound is unchanged) + ``[b != w] * V * d * b`` (the weight cast to the
    compute dtype, live through the forward) + ``c * V * (b + s)`` (one chunk's logits and their stats copy;
    ``c * V * s`` when ``b == s``). The chunk's other stage (the logit gradient and a weight-gradient block,
    ``<= 2 * c * V * b``) is never larger when ``b <= s``.
    """
    chunk = min(tokens, chunk_tokens or default_chunk_tokens(vocab_size))
    weight_copy = vocab_size * dim * compute_bytes if compute_bytes != weight_bytes else 0
    per_logit = stats_bytes + (compute_bytes if compute_bytes != stats_bytes else 0)
    return tokens * stats_bytes + weight_copy + chunk * vocab_size * per_logit


@torch.no_grad()
def chunked_token_losses(
    hidden: Tensor, weight: Tensor, labels: Tensor, *, chunk_tokens: int | None = None, bias: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``(loss, argmax)`` per token of this rank's ``hidden [..., d]`` through the head ``weight [V, d]``:
    forward only (no graph, nothing saved), a chunk of tokens at a time, in the precision of
    :func:`chunked_cross_entropy` (logits in the compute dtype, statistics in float32, float64 for
    float64 inputs). ``loss [...]`` is ``lse - logit[label]`` (0 where the label is ``IGNORE_INDEX``),
    ``argmax [...]`` the greedy token (teacher-forced). Communication: none (the caller reduces)."""
    if hidden.shape[:-1] != labels.shape or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"hidden {tuple(hidden.shape)}, labels {tuple(labels.shape)} and weight "
                         f"{tuple(weight.shape)} must be [..., d], [...] and (vocab, d)")
    compute = _compute_dtype(hidden, weight)
    stats = _stats_dtype(compute)
    flat, flat_labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    chunk_tokens = chunk_tokens or default_chunk_tokens(weight.shape[0])
    losses = torch.empty(flat.shape[0], dtype=stats, device=hidden.device)
    argmax = torch.empty(flat.shape[0], dtype=torch.int64, device=hidden.device)
    with torch.autocast(hidden.device.type, enabled=False):
        w = weight.to(compute)
        for start, stop in _chunks(flat.shape[0], chunk_tokens):
            valid, safe = _targets(flat_labels[start:stop])
            z = _chunk_logits(flat[start:stop], w, bias, compute).to(stats)
            argmax[start:stop] = z.argmax(dim=1)
            target = z.gather(1, safe[:, None]).squeeze(1)
            losses[start:stop] = torch.where(valid, torch.logsumexp(z, dim=1) - target, 0)
    return losses.reshape(labels.shape), argmax.reshape(labels.shape)
