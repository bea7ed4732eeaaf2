"""LLaMA-style decoder (RMSNorm, RoPE on given position ids, SwiGLU, GQA), plain PyTorch.

The model knows nothing of meshes or process groups. Each :class:`Attention` calls its replaceable
``attention_fn`` (default :func:`~loongtrain.model.local_attention.local_attention`); the training
stack swaps it for 2D-Attention from outside with :func:`loongtrain.apply_2d_attention`
(docs/memory.md). Sharded, each rank then holds its own ``S/sp`` tokens (the zigzag shard of
:func:`loongtrain.shard_sequence`, not contiguous) with their *global* ``position_ids``; the forward
is the same code.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from loongtrain.model.config import ModelConfig
from loongtrain.model.local_attention import AttentionFn, local_attention
from loongtrain.model.mla import LatentAttention
from loongtrain.model.moe import ExpertWeights, MoESpec, RouterStats, moe_forward
from loongtrain.model.rms_norm import rms_norm
from loongtrain.model.rope import apply_rope, rope_cos_sin

Tensor = torch.Tensor

INIT_STD = 0.02


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (statistics in float32, output in the input dtype); one autograd function
    that saves only its input and the per-token scale (:func:`loongtrain.model.rms_norm.rms_norm`)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """GQA self-attention; its core is the replaceable ``attention_fn`` (docs/memory.md). Layer ``layer``'s window
    comes from the config's ``layer_types`` (:meth:`ModelConfig.layer_window`); with ``attention_sinks`` it
    holds a learned logit per query head, ``sinks`` (docs/attention.md#attention-sinks). The values' head dim is
    ``v_head_dim`` (``head_dim`` unless set)."""

    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_heads, config.num_kv_heads, config.head_dim,
        )
        self.v_head_dim = config.v_head_dim
        self.attention_fn: AttentionFn = local_attention
        self.sliding_window = config.layer_window(layer)  # Mistral's convention: i - w < j <= i
        bias = config.attention_bias
        self.wq = nn.Linear(config.dim, config.num_heads * config.head_dim, bias=bias)
        self.wk = nn.Linear(config.dim, config.num_kv_heads * config.head_dim, bias=bias)
        self.wv = nn.Linear(config.dim, config.num_kv_heads * config.v_head_dim, bias=bias)
        self.wo = nn.Linear(config.num_heads * config.v_head_dim, config.dim, bias=bias)
        self.sinks = nn.Parameter(torch.zeros(config.num_heads)) if config.attention_sinks else None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cu_seqlens: Any = None, chunk_order: Any = None) -> Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, self.num_heads, self.head_dim)
        k = self.wk(x).view(batch, seq, self.num_kv_heads, self.head_dim)
        v = self.wv(x).view(batch, seq, self.num_kv_heads, self.v_head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        masks = {}  # only what is set, so attention_fns without these keywords keep working
        if cu_seqlens is not None:
            masks["cu_seqlens"] = cu_seqlens
        if chunk_order is not None:  # the tokens' sharded layout, for a sharded attention_fn
            masks["chunk_order"] = chunk_order
        if self.sliding_window:
            masks["sliding_window"] = self.sliding_window
        if self.sinks is not None:
            masks["sinks"] = self.sinks
        out = self.attention_fn(q, k, v, causal=True, **masks)
        return self.wo(out.reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, ffn_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoEFeedForward(nn.Module):
    """Mixture of SwiGLU experts (:func:`loongtrain.model.moe.moe_forward`): ``router [E, dim]``, ``gate_up
    [E, 2 moe_ffn_dim, dim]`` (each expert's w1 rows, then its w3 rows), ``down [E, dim, moe_ffn_dim]``; softmax
    routing to the top k, renormalized; with ``shared_ffn_dim`` a shared SwiGLU MLP (``shared``) every token also
    runs through, added. ``stats``: where the router's statistics go; ``grouped``: as ``moe_forward``'s (None:
    grouped GEMMs where the device supports them)."""

    def __init__(self, config: ModelConfig, stats: RouterStats | None = None) -> None:
        super().__init__()
        e, d, f = config.num_experts, config.dim, config.moe_ffn_dim
        self.spec = MoESpec(e, config.top_k)
        self.router = nn.Linear(d, e, bias=False)
        self.gate_up = nn.Parameter(torch.empty(e, 2 * f, d))
        self.down = nn.Parameter(torch.empty(e, d, f))
        self.shared = FeedForward(d, config.shared_ffn_dim) if config.shared_ffn_dim else None
        self.stats, self.grouped = stats, None

    def forward(self, x: Tensor) -> Tensor:
        weights = ExpertWeights(self.router.weight, self.gate_up, self.down)
        out = moe_forward(x, weights, self.spec, self.stats, grouped=self.grouped)
        return out if self.shared is None else out + self.shared(x)


class TransformerBlock(nn.Module):
    """Pre-norm decoder block: ``h = x + attention(norm(x)); out = h + feed_forward(norm(h))``; with
    ``stats``, the feed-forward is the experts (:class:`MoEFeedForward`) recording into it."""

    def __init__(self, config: ModelConfig, stats: RouterStats | None = None, layer: int = 0) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention: nn.Module = (LatentAttention(config, layer) if config.latent_attention
                                     else Attention(config, layer))
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward: nn.Module = (FeedForward(config.dim, config.ffn_dim) if stats is None
                                        else MoEFeedForward(config, stats))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cu_seqlens: Any = None, chunk_order: Any = None) -> Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, cu_seqlens, chunk_order)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Decoder LM: ``forward(input_ids [B, S], position_ids [B, S] = arange) -> logits [B, S, V]``.

    Weights are initialised deterministically from ``seed`` (pass ``seed=None`` to skip, e.g. when
    loading a checkpoint); every rank must use the same seed. When the sequence is sharded, pass
    each token's global ``position_ids`` (the default ``arange`` is only right for whole sequences).
    """

    def __init__(self, config: ModelConfig, *, seed: int | None = 0) -> None:
        super().__init__()
        if config.linear_layers or config.attention_output_gate:
            raise ValueError("loongtrain's decoder has no linear-attention layers or gated attention outputs (a "
                             "hybrid's shape, e.g. Qwen3.5's): train its Hugging Face model (docs/linear-attention.md)")
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        #: the router's statistics of the MoE layers (None for a dense model; loongtrain/loss/router.py)
        self.router_stats = RouterStats() if config.moe_layers else None
        self.layers = nn.ModuleList(
            TransformerBlock(config, self.router_stats if i in config.moe_layers else None, i)
            for i in range(config.num_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = None if config.tie_embeddings else nn.Linear(config.dim, config.vocab_size, bias=False)
        if seed is not None:
            self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Norm weights = 1; every other weight ~ N(0, 0.02) drawn from a generator seeded with ``seed``.

        Parameters are filled in name order, so the result depends only on (config, seed, device
        type). Call it before wrapping with FSDP (it writes whole, unsharded tensors).
        """
        for name, param in sorted(self.named_parameters(), key=lambda kv: kv[0]):
            if param.device.type == "meta":
                continue
            param.copy_(initial_weight(name, param.shape, seed, param.device))

    def head_weight(self) -> Tensor:
        """The LM head's ``[vocab, dim]`` weight: the embedding's when tied, else ``output``'s."""
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None, *,
                return_hidden: bool = False, cu_seqlens: Any = None, chunk_order: Any = None,
                final_norm: bool = True) -> Tensor:
        """Logits ``[B, S, V]``, or with ``return_hidden`` the final normed hidden states ``[B, S, dim]``
        (the head's input: ``logits = hidden @ head_weight().T``), or with ``final_norm=False`` too the
        hidden states before the final norm (the trainer's chunked loss applies ``self.norm`` itself).
        ``cu_seqlens``: packed documents' boundaries of the full sequence (one per row, flash-attn's
        convention; see :func:`loongtrain.attention`), handed to every ``attention_fn``: tokens attend only
        inside their document (then pass per-document ``position_ids``, e.g. ``loongtrain.packed_inputs``).
        ``chunk_order``: the layout the inputs were sharded with (``loongtrain.shard_sequence(...,
        chunk_order=)``), handed to every ``attention_fn`` too (only a sharded one can take it)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq]; got shape {tuple(input_ids.shape)}")
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        if position_ids.shape != input_ids.shape:
            raise ValueError(
                f"position_ids shape {tuple(position_ids.shape)} != input_ids shape {tuple(input_ids.shape)}"
            )
        h = self.tok_embeddings(input_ids)
        c = self.config
        cos, sin = rope_cos_sin(position_ids, c.rope_dim, c.rope_theta, h.dtype, c.rope_scaling)
        for layer in self.layers:
            if cu_seqlens is None and chunk_order is None:
                h = layer(h, cos, sin)
            else:
                h = layer(h, cos, sin, cu_seqlens, chunk_order)
        if return_hidden and not final_norm:
            return h
        h = self.norm(h)
        if return_hidden:
            return h
        return F.linear(h, self.head_weight())


@torch.no_grad()
def initial_weight(name: str, shape: torch.Size | tuple[int, ...], seed: int,
                   device: torch.device | str = "cpu") -> Tensor:
    """The initial value (float32, whole tensor) of parameter ``name``: ones for norm weights, else
    N(0, 0.02) from a generator seeded with ``seed`` and the name. Sharded set-ups build the model on
    the meta device and copy each rank's shard of this tensor (loongtrain.parallelize.compose)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.float32, device=device)
    gen = torch.Generator(device=device).manual_seed(seed + _stable_hash(name))
    return torch.empty(shape, dtype=torch.float32, device=device).normal_(0.0, INIT_STD, generator=gen)


def _stable_hash(name: str) -> int:
    """A process-independent hash of a parameter name (Python's ``hash`` is salted per process)."""
    value = 0
    for byte in name.encode():
        value = (value * 131 + byte) % (2**31 - 1)
    return value
