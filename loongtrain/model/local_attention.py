"""The model's default attention core and the protocol every replacement follows (docs/design.md §7).

Each attention module stores its core as a plain attribute ``attention_fn`` and calls it as::

    attention_fn(q, k, v, causal=True)      # q [B, S, H, D], k, v [B, S, Hkv, D] -> [B, S, H, D]

A replacement must accept the same arguments (plus the keyword ``softmax_scale``, default
``1/sqrt(D)``) and return the same shape; query head ``h`` attends with KV head
``h // (H / Hkv)`` (GQA). Parallelism is applied by swapping the attribute from outside
(``loongtrain.apply_2d_attention``); the model itself never communicates.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


class AttentionFn(Protocol):
    """``(q [B, S, H, D], k, v [B, S, Hkv, D], *, causal, softmax_scale) -> [B, S, H, D]``."""

    def __call__(
        self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True, softmax_scale: float | None = None
    ) -> Tensor: ...


def local_attention(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True, softmax_scale: float | None = None
) -> Tensor:
    """Softmax attention over the whole (unsharded) sequence held by this process.

    ``q [B, S, H, D]``, ``k, v [B, S, Hkv, D]`` with ``H`` a multiple of ``Hkv`` -> ``[B, S, H, D]``.
    Causal masking is by index in the given order (the tokens must be in sequence order).
    """
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(
            f"q must be [B, S, H, D] and k, v equal [B, S, Hkv, D]; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"num_heads={q.shape[2]} must be a multiple of num_kv_heads={k.shape[2]}")
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        is_causal=causal, scale=softmax_scale, enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)
