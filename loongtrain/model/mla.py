"""Multi-head latent attention (MLA, DeepSeek-V2/V3; docs/attention.md#mla), plain PyTorch, no meshes.

Keys and values come per head out of one low-rank latent of the hidden state, and queries and keys carry RoPE
in a decoupled part of their head dim, one key part shared by all heads::

    q = wq(x)  or  wq_b(q_norm(wq_a(x)))                [B, S, H, D]     D = nope + rope
    latent, k_rope = wkv_a(x)                           [B, S, kv_lora_rank], [B, S, rope]
    k_nope, v = wkv_b(kv_norm(latent))                  [B, S, H, nope], [B, S, H, Dv]
    q = [q_nope ; RoPE(q_rope)],  k = [k_nope ; RoPE(k_rope) for every head]
    out = wo(attention_fn(q, k, v))                     values of head dim Dv, so out [B, S, H, Dv]

Its core is the same replaceable ``attention_fn`` as :class:`~loongtrain.model.llama.Attention`'s, called with
``Dv != D``; 2D-Attention runs it as it is. RoPE uses the split-halves convention on the ``rope`` part (HF's
DeepSeek-V3 with ``rope_interleave=False``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from loongtrain.model.config import ModelConfig
from loongtrain.model.local_attention import AttentionFn, local_attention
from loongtrain.model.rms_norm import rms_norm
from loongtrain.model.rope import apply_rope

Tensor = torch.Tensor


#: the latents' RMSNorm epsilon: DeepSeek-V3's, whatever the model's ``norm_eps`` (HF builds them with its default)
LATENT_NORM_EPS = 1e-6


class LatentNorm(nn.Module):
    """The RMSNorm of a latent (``q_norm``, ``kv_norm``): weight ``[rank]``, statistics in float32."""

    def __init__(self, dim: int, eps: float = LATENT_NORM_EPS) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


class LatentAttention(nn.Module):
    """MLA for :class:`~loongtrain.model.config.ModelConfig` with ``kv_lora_rank > 0`` (module docstring); layer
    ``layer``'s window from ``layer_types`` as plain attention's."""

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        d, h, hd, dv = config.dim, config.num_heads, config.head_dim, config.v_head_dim
        self.num_heads, self.head_dim, self.v_head_dim = h, hd, dv
        self.rope_dim, self.kv_lora_rank = config.qk_rope_head_dim, config.kv_lora_rank
        self.attention_fn: AttentionFn = local_attention
        self.sliding_window = config.layer_window(layer)
        if config.q_lora_rank:
            self.wq_a = nn.Linear(d, config.q_lora_rank, bias=False)
            self.q_norm = LatentNorm(config.q_lora_rank)
            self.wq_b = nn.Linear(config.q_lora_rank, h * hd, bias=False)
        else:
            self.wq = nn.Linear(d, h * hd, bias=False)
        self.wkv_a = nn.Linear(d, config.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_norm = LatentNorm(config.kv_lora_rank)
        self.wkv_b = nn.Linear(config.kv_lora_rank, h * (hd - self.rope_dim + dv), bias=False)
        self.wo = nn.Linear(h * dv, d, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cu_seqlens: Any = None, chunk_order: Any = None) -> Tensor:
        batch, seq, _ = x.shape
        h, nope = self.num_heads, self.head_dim - self.rope_dim
        q = self.wq(x) if hasattr(self, "wq") else self.wq_b(self.q_norm(self.wq_a(x)))
        q_nope, q_rope = q.view(batch, seq, h, self.head_dim).split([nope, self.rope_dim], dim=-1)
        latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        k_nope, v = self.wkv_b(self.kv_norm(latent)).view(batch, seq, h, nope + self.v_head_dim).split(
            [nope, self.v_head_dim], dim=-1)
        k_rope = apply_rope(k_rope.unsqueeze(2), cos, sin).expand(batch, seq, h, self.rope_dim)
        q = torch.cat([q_nope, apply_rope(q_rope.contiguous(), cos, sin)], dim=-1)
        k = torch.cat([k_nope, k_rope], dim=-1)
        masks = {}  # only what is set, so attention_fns without these keywords keep working
        if cu_seqlens is not None:
            masks["cu_seqlens"] = cu_seqlens
        if chunk_order is not None:
            masks["chunk_order"] = chunk_order
        if self.sliding_window:
            masks["sliding_window"] = self.sliding_window
        out = self.attention_fn(q, k, v.contiguous(), causal=True, **masks)
        return self.wo(out.reshape(batch, seq, -1))
