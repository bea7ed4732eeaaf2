"""Model configuration, presets, parameter counts and training FLOPs per token."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from loongtrain.model.rope_scaling import RopeScaling, rope_scaling_from_mapping


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a LLaMA-style decoder (RMSNorm, RoPE, SwiGLU, GQA)."""

    vocab_size: int
    dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_dim: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    #: width of one attention head; 0 means ``dim // num_heads`` (set explicitly, e.g. Qwen3, it may differ)
    head_dim: int = 0
    #: each token attends to at most this many tokens (itself included); None: no window
    sliding_window: int | None = None
    #: RoPE scaling (linear, yarn, llama3; None: plain RoPE with ``rope_theta``); a dict of HF's keys
    #: (a checkpoint's record) is read as one
    rope_scaling: RopeScaling | None = None
    #: mixture of experts (docs/moe-and-gpt-oss.md#mixture-of-experts): experts per MoE layer (0: a dense model)
    num_experts: int = 0
    #: experts each token runs through
    top_k: int = 0
    #: one expert's FFN width
    moe_ffn_dim: int = 0
    #: the layers whose MLP is the experts (the others: the dense ``ffn_dim`` MLP)
    moe_layers: tuple[int, ...] = ()
    #: each layer's attention, HF's ``layer_types``: ``"sliding_attention"`` (``sliding_window``) or
    #: ``"full_attention"`` (never windowed); None: every layer uses ``sliding_window`` (if any)
    layer_types: tuple[str, ...] | None = None
    #: gpt-oss's attention sinks: a learned logit per query head in the softmax denominator
    attention_sinks: bool = False
    #: biases on the q, k, v and output projections (gpt-oss)
    attention_bias: bool = False
    #: a sigmoid gate on each attention head's output from a second half of q_proj (Qwen3.5, Qwen3-Next)
    attention_output_gate: bool = False
    #: the Gated DeltaNet of the ``"linear_attention"`` layers (docs/linear-attention.md; HF's names): key and
    #: value heads, their widths, the short convolution's kernel
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    #: MLA (multi-head latent attention, DeepSeek-V3; docs/attention.md#mla): the rank of the keys' and values'
    #: joint latent (0: plain GQA attention). Then ``head_dim`` is the queries' and keys' head dim, of which the last
    #: ``qk_rope_head_dim`` carry RoPE (one key part shared by all heads)
    kv_lora_rank: int = 0
    #: MLA: the rank of the queries' latent (0: the queries are projected from the hidden states directly)
    q_lora_rank: int = 0
    #: MLA: the part of ``head_dim`` that carries RoPE
    qk_rope_head_dim: int = 0
    #: the values' head dim (0: ``head_dim``); MLA's is smaller than the queries' and keys'
    v_head_dim: int = 0
    #: mixture of experts: the width of the shared experts every token of an MoE layer also runs through (0: none)
    shared_ffn_dim: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", rope_scaling_from_mapping(self.rope_scaling))
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(f"rope_scaling={self.rope_scaling!r} must be a RopeScaling, a dict of its keys or None")
        for name in ("vocab_size", "dim", "num_layers", "num_heads", "num_kv_heads", "ffn_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int) or self.head_dim < 0:
            raise ValueError(f"head_dim={self.head_dim!r} must be a non-negative integer (0: dim // num_heads)")
        if self.sliding_window == 0:  # model records written before sliding_window became None-for-none
            object.__setattr__(self, "sliding_window", None)
        window = self.sliding_window
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"sliding_window={window!r} must be None (no window) or a positive integer")
        self._check_layer_types()
        if self.head_dim == 0:
            if self.dim % self.num_heads != 0:
                raise ValueError(f"dim={self.dim} must be divisible by num_heads={self.num_heads} "
                                 f"(or give head_dim)")
            object.__setattr__(self, "head_dim", self.dim // self.num_heads)
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if not (isinstance(self.rope_theta, (int, float)) and math.isfinite(self.rope_theta) and self.rope_theta > 0):
            raise ValueError(f"rope_theta={self.rope_theta!r} must be a positive finite number")
        if self.rope_scaling is not None and self.rope_scaling.rope_type == "yarn" and not self.rope_theta > 1:
            raise ValueError(f"rope_theta={self.rope_theta!r} must exceed 1 for yarn scaling")
        if not self.norm_eps > 0:
            raise ValueError(f"norm_eps={self.norm_eps!r} must be positive")
        self._check_latent_attention()
        self._check_experts()

    def _check_latent_attention(self) -> None:
        for name in ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "shared_ffn_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r} must be a non-negative integer")
        if self.v_head_dim == 0:
            object.__setattr__(self, "v_head_dim", self.head_dim)
        if not self.kv_lora_rank:
            if self.q_lora_rank or self.qk_rope_head_dim:
                raise ValueError(f"q_lora_rank={self.q_lora_rank}, qk_rope_head_dim={self.qk_rope_head_dim}: MLA's "
                                 f"settings need kv_lora_rank > 0 (the latent of keys and values)")
            return
        rope = self.qk_rope_head_dim
        if not 0 < rope < self.head_dim or rope % 2:
            raise ValueError(f"qk_rope_head_dim={rope} must be even and between 0 and head_dim={self.head_dim} "
                             f"(MLA: the RoPE part of the queries' and keys' head dim)")
        if self.num_kv_heads != self.num_heads:
            raise ValueError(f"num_kv_heads={self.num_kv_heads} must equal num_heads={self.num_heads} with MLA (its "
                             f"keys and values come per head out of the latent)")
        if self.attention_sinks or self.attention_bias:
            raise ValueError("attention_sinks and attention_bias have no MLA form; use kv_lora_rank=0")

    @property
    def latent_attention(self) -> bool:
        """Whether the attention is MLA (``kv_lora_rank > 0``)."""
        return self.kv_lora_rank > 0

    @property
    def rope_dim(self) -> int:
        """The head dim RoPE rotates: ``qk_rope_head_dim`` with MLA, else ``head_dim``."""
        return self.qk_rope_head_dim if self.kv_lora_rank else self.head_dim

    def _check_experts(self) -> None:
        object.__setattr__(self, "moe_layers", tuple(self.moe_layers))  # a checkpoint's record holds a list
        if not self.num_experts and not self.moe_layers:
            if self.shared_ffn_dim:
                raise ValueError(f"shared_ffn_dim={self.shared_ffn_dim}: shared experts need an MoE model "
                                 f"(num_experts, moe_layers)")
            return
        for name in ("num_experts", "top_k", "moe_ffn_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer in a model with experts")
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be at most num_experts={self.num_experts}")
        bad = [i for i in self.moe_layers if not 0 <= i < self.num_layers]
        if not self.moe_layers or bad or len(set(self.moe_layers)) != len(self.moe_layers):
            raise ValueError(f"moe_layers={list(self.moe_layers)} must name distinct layers in [0, {self.num_layers})")


    def _check_layer_types(self) -> None:
        if self.layer_types is None:
            return
        if isinstance(self.layer_types, str) or not isinstance(self.layer_types, (list, tuple)):
            raise ValueError(f"layer_types={self.layer_types!r} must be a list of {list(LAYER_TYPES)}, one per layer")
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for num_layers={self.num_layers}")
        for i, kind in enumerate(self.layer_types):
            if kind not in LAYER_TYPES:
                raise ValueError(f"layer_types[{i}]={kind!r} is not one of {list(LAYER_TYPES)}")
        if "linear_attention" in self.layer_types:
            for name in LINEAR_FIELDS:
                value = getattr(self, name)
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ValueError(f"{name}={value!r} must be a positive integer in a model with linear-attention "
                                     f"layers")
            if self.linear_num_value_heads % self.linear_num_key_heads:
                raise ValueError(f"linear_num_value_heads={self.linear_num_value_heads} must be a multiple of "
                                 f"linear_num_key_heads={self.linear_num_key_heads}")
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            i = self.layer_types.index("sliding_attention")
            raise ValueError(f"layer_types[{i}]='sliding_attention' needs a sliding_window (a sliding layer is never "
                             f"full)")

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """The ``"linear_attention"`` layers (none without ``layer_types``)."""
        return tuple(i for i, kind in enumerate(self.layer_types or ()) if kind == "linear_attention")

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer ``layer``: None for a ``full_attention`` layer, else ``sliding_window``."""
        if self.layer_types is not None and self.layer_types[layer] == "full_attention":
            return None
        return self.sliding_window

    @property
    def uniform_window(self) -> int | None:
        """The window every layer uses; None when some layer is full."""
        windows = self.layer_windows()
        return next(iter(windows)) if len(windows) == 1 else None

    def layer_windows(self) -> dict[int | None, int]:
        """Each distinct layer window (None: full attention) and how many softmax-attention layers have it, in layer
        order (linear-attention layers have none)."""
        counts: dict[int | None, int] = {}
        linear = set(self.linear_layers)
        for i in range(self.num_layers):
            if i in linear:
                continue
            window = self.layer_window(i)
            counts[window] = counts.get(window, 0) + 1
        return counts


#: the kinds of attention layer a :class:`ModelConfig`'s ``layer_types`` names (HF's names)
LAYER_TYPES = ("sliding_attention", "full_attention", "linear_attention")
#: the shape of a model's linear-attention layers
LINEAR_FIELDS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                 "linear_conv_kernel_dim")


PRESETS: dict[str, ModelConfig] = {
    # Byte-level vocabulary; trains in seconds on CPU at seq_len 8192.
    "tiny": ModelConfig(
        vocab_size=256, dim=128, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=384,
        tie_embeddings=True,
    ),
    "1b": ModelConfig(
        vocab_size=32000, dim=2048, num_layers=22, num_heads=32, num_kv_heads=4, ffn_dim=5632,
        rope_theta=500000.0,
    ),
    "7b-mha": ModelConfig(
        vocab_size=32000, dim=4096, num_layers=32, num_heads=32, num_kv_heads=32, ffn_dim=11008,
        rope_theta=500000.0,
    ),
    "7b-gqa": ModelConfig(
        vocab_size=32000, dim=4096, num_layers=32, num_heads=32, num_kv_heads=8, ffn_dim=11008,
        rope_theta=500000.0,
    ),
    "13b": ModelConfig(
        vocab_size=32000, dim=5120, num_layers=40, num_heads=40, num_kv_heads=40, ffn_dim=13824,
        rope_theta=500000.0,
    ),
    # DeepSeek-V3's shape (671.0B parameters, 37.6B active; its multi-token-prediction layer left out): MLA (q/k head
    # dim 192 = 128 + 64 RoPE, values 128, latents of 1536 and 512), 3 dense layers, then 256 experts, top 8, and a
    # shared expert. loongtrain's decoder routes by softmax (DeepSeek-V3 by biased sigmoid scores in groups: HF's
    # model, docs/moe-and-gpt-oss.md#deepseek-v3-and-mla): the same shapes, FLOPs and memory.
    "deepseek-v3-like": ModelConfig(
        vocab_size=129280, dim=7168, num_layers=61, num_heads=128, num_kv_heads=128, ffn_dim=18432, head_dim=192,
        norm_eps=1e-6, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, num_experts=256,
        top_k=8, moe_ffn_dim=2048, moe_layers=tuple(range(3, 61)), shared_ffn_dim=2048,
    ),
}


def first_difference(a: ModelConfig, b: ModelConfig) -> str | None:
    """The first field (in declaration order) on which ``a`` and ``b`` differ, their RoPE aside (a continued
    run may change it); None when they are the same model."""
    for field in fields(ModelConfig):
        if field.name not in ("rope_theta", "rope_scaling") and getattr(a, field.name) != getattr(b, field.name):
            return field.name
    return None


def get_preset(name: str, **overrides: object) -> ModelConfig:
    """The preset ``name``, optionally with fields replaced (e.g. ``vocab_size=...``)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; valid presets: {sorted(PRESETS)}")
    return replace(PRESETS[name], **overrides) if overrides else PRESETS[name]


def mlp_params(config: ModelConfig, *, active: bool = False) -> int:
    """Parameters of every layer's MLP: the dense ``3 d f``, an MoE layer's router ``E d``, its shared experts
    ``3 d f_shared`` and its experts, all ``E`` of them (memory), or with ``active`` the ``top_k`` a token runs
    through (FLOPs)."""
    d, moe = config.dim, len(config.moe_layers)
    experts = config.top_k if active else config.num_experts
    per_moe = config.num_experts * d + experts * 3 * d * config.moe_ffn_dim + 3 * d * config.shared_ffn_dim
    return (config.num_layers - moe) * 3 * d * config.ffn_dim + moe * per_moe


def mlp_width(config: ModelConfig) -> float:
    """The intermediate width a token's MLP computes, averaged over the layers: ``ffn_dim`` in a dense layer,
    ``top_k * moe_ffn_dim + shared_ffn_dim`` in an MoE layer (the activations' and the tiles' width)."""
    moe = len(config.moe_layers)
    moe_width = config.top_k * config.moe_ffn_dim + config.shared_ffn_dim
    return ((config.num_layers - moe) * config.ffn_dim + moe * moe_width) / config.num_layers


def attention_weights(config: ModelConfig) -> tuple[int, ...]:
    """The elements of one layer's attention projection weights, in the order the module defines them: ``wq, wk,
    wv, wo``, or with MLA ``wq`` (or ``wq_a, wq_b``), ``wkv_a, wkv_b, wo``."""
    d, hd, dv, h, hkv = config.dim, config.head_dim, config.v_head_dim, config.num_heads, config.num_kv_heads
    if config.latent_attention:
        qr, kr, rope = config.q_lora_rank, config.kv_lora_rank, config.qk_rope_head_dim
        q = (d * qr, qr * h * hd) if qr else (d * h * hd,)
        return (*q, d * (kr + rope), kr * h * (hd - rope + dv), h * dv * d)
    gate = 2 if config.attention_output_gate else 1  # the queries' projection also gives the output gate
    return gate * d * h * hd, d * hkv * hd, d * hkv * dv, h * dv * d


def _attention_params(config: ModelConfig, *, norms: bool = True) -> int:
    """One layer's attention parameters (``norms``: with MLA's latent norms, which are no matmul)."""
    hd, dv, h, hkv = config.head_dim, config.v_head_dim, config.num_heads, config.num_kv_heads
    weights = sum(attention_weights(config))
    if config.latent_attention:
        return weights + ((config.q_lora_rank + config.kv_lora_rank) if norms else 0)
    biases = (h + hkv) * hd + hkv * dv + config.dim if config.attention_bias else 0
    return weights + biases + (h if config.attention_sinks else 0)


def linear_channels(config: ModelConfig) -> int:
    """Channels of a linear-attention layer's ``cat(q, k, v)`` (its convolution's width)."""
    return (2 * config.linear_num_key_heads * config.linear_key_head_dim
            + config.linear_num_value_heads * config.linear_value_head_dim)


def _linear_matmul_params(config: ModelConfig) -> int:
    """A Gated DeltaNet layer's projections: q, k, v; the output gate z; beta and the decay's input (one per value
    head each); the output."""
    d, values = config.dim, config.linear_num_value_heads * config.linear_value_head_dim
    return d * linear_channels(config) + d * values + 2 * d * config.linear_num_value_heads + values * d


def _mixer_params(config: ModelConfig) -> int:
    """Every layer's token mixer: softmax attention, or a linear-attention layer's projections, its convolution,
    ``A_log`` and ``dt_bias`` per value head and its gated norm's weight."""
    linear = len(config.linear_layers)
    own = (linear_channels(config) * config.linear_conv_kernel_dim + 2 * config.linear_num_value_heads
           + config.linear_value_head_dim)
    return (config.num_layers - linear) * _attention_params(config) + linear * (_linear_matmul_params(config) + own)


def num_params(config: ModelConfig, *, include_embeddings: bool = True) -> int:
    """Exact number of parameters of :class:`loongtrain.model.llama.Transformer` for ``config`` (every expert); of a
    hybrid's Hugging Face model without its q/k norms."""
    d = config.dim
    total = _mixer_params(config) + config.num_layers * 2 * d + mlp_params(config) + d  # norms, final norm
    if include_embeddings:
        total += config.vocab_size * d  # token embedding
        if not config.tie_embeddings:
            total += config.vocab_size * d  # separate lm head
    return total


def active_params(config: ModelConfig) -> int:
    """The parameters one token's forward uses: :func:`num_params` with only ``top_k`` experts per MoE layer."""
    return num_params(config) - mlp_params(config) + mlp_params(config, active=True)


def matmul_params(config: ModelConfig) -> int:
    """Parameters that take part in a matmul per token: all linear layers (of an MoE layer, its router and the
    ``top_k`` experts a token runs through) plus the lm head."""
    linear = len(config.linear_layers)
    return ((config.num_layers - linear) * _attention_params(config, norms=False)
            + linear * _linear_matmul_params(config) + mlp_params(config, active=True) + config.vocab_size * config.dim)


#: tokens per chunk of the delta rule's chunked form (loongtrain/model/delta_rule.py, fla's kernels)
DELTA_RULE_CHUNK = 64


def linear_layer_forward_flops(config: ModelConfig, widened: bool = False) -> float:
    """Forward FLOPs per token of one linear-attention layer beyond its projections: the short convolution ``2 K C``
    and, per value head, the chunked delta rule with chunks of ``c = 64``: the chunk's ``k k^T`` and ``q k^T``
    (``4 c Dk``), the triangular solve for the values and the decayed keys (``c (Dv + Dk)``), the intra-chunk
    output (``2 c Dv``) and the three products with the state (``6 Dk Dv``). ``widened``: with the ``Dk``
    transition columns a sharded run adds (``Dv + Dk`` for ``Dv``; docs/linear-attention.md#the-context-ranks)."""
    c, dk = DELTA_RULE_CHUNK, config.linear_key_head_dim
    dv = config.linear_value_head_dim + (dk if widened else 0)
    per_head = 4 * c * dk + c * (dv + dk) + 2 * c * dv + 6 * dk * dv
    return float(2 * config.linear_conv_kernel_dim * linear_channels(config) + config.linear_num_value_heads * per_head)


def linear_flops_per_token(config: ModelConfig) -> float:
    """Training FLOPs (forward + backward, 3x the forward) per token of the linear-attention layers beyond their
    projections, summed over them (:func:`linear_layer_forward_flops`, the model's own work: no transition
    columns). Independent of the sequence length."""
    return 3.0 * linear_layer_forward_flops(config) * len(config.linear_layers)


def flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), averaged over a causal sequence of ``seq_len``.

    ``6 * N_matmul + 3 * L * S * H * (D + Dv)`` where ``N_matmul`` = linear-layer weights + lm head (the
    embedding lookup is not a matmul; norms are ignored). Attention: forward causal per token per
    layer is ``2 (multiply-add) * S/2 (causal) * H * (D + Dv)`` (``QK^T`` over the queries' and keys' head dim
    ``D``, ``PV`` over the values' ``Dv``: both ``D`` but for MLA), and forward + backward is 3x that. In a layer
    with a sliding window ``w < S`` (``layer_types``) a token attends to ``w * (1 - w / (2S))`` keys on average
    instead of ``S / 2``. Linear-attention layers add :func:`linear_flops_per_token` (no term in ``S``).
    """
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be positive")
    attended = 0.0  # mean keys per query (S / 2 without a window), summed over the layers
    for window, layers in config.layer_windows().items():
        w = min(window or seq_len, seq_len)
        attended += layers * w * (1 - w / (2 * seq_len))
    attn = 3 * 4 * attended * config.num_heads * (config.head_dim + config.v_head_dim) / 2
    return float(6 * matmul_params(config) + attn + linear_flops_per_token(config))


def step_flops(model_config, tokens: int, visible: int) -> float:
    """Training FLOPs (forward + backward) of a step of ``tokens`` tokens whose attention computes
    ``visible`` (query, key) pairs per layer and head (summed over rows): ``6 N_matmul`` per token as in
    :func:`loongtrain.model.config.flops_per_token`, attention ``3 * 2 * H * (D + Dv) * L`` per visible pair (``L``
    the softmax-attention layers), so masked-out pairs (other documents, outside the window) are not counted, and
    the linear-attention layers' :func:`linear_flops_per_token`."""
    c = model_config
    layers = c.num_layers - len(c.linear_layers)
    return float((6 * matmul_params(c) + linear_flops_per_token(c)) * tokens
                 + 6 * c.num_heads * (c.head_dim + c.v_head_dim) * layers * visible)


def dense_prefix(config: ModelConfig) -> int:
    """How many dense layers come before the MoE layers when those are all the rest (DeepSeek-V3's
    ``first_k_dense_replace``; 0 when every layer is one kind); ValueError for any other mix (its blocks are not
    alike after a prefix, so the simulation by depth cannot take it)."""
    if not config.moe_layers:
        return 0
    first = config.num_layers - len(config.moe_layers)
    if config.moe_layers != tuple(range(first, config.num_layers)):
        raise ValueError(f"moe_layers={list(config.moe_layers)} of {config.num_layers} layers: a mix of dense and "
                         f"MoE blocks other than dense layers first cannot be simulated by depth")
    return first


def with_depth(config: ModelConfig, num_layers: int) -> ModelConfig:
    """``config`` with ``num_layers`` layers (the simulation by depth): its dense first layers
    (:func:`dense_prefix`) kept, every other layer an MoE layer when ``config``'s are, so the blocks past the prefix
    are alike; ValueError for another mix, a depth that leaves no layer past the prefix, and a hybrid with
    linear-attention layers (loongtrain's decoder has none)."""
    if config.linear_layers or config.attention_output_gate:
        raise ValueError("the simulation runs loongtrain's own decoder, which has no linear-attention layers or gated "
                         "attention outputs: a hybrid is planned, not simulated (docs/linear-attention.md#planning)")
    if not config.moe_layers:
        return replace(config, num_layers=num_layers)
    prefix = dense_prefix(config)
    if prefix and num_layers <= prefix:
        raise ValueError(f"{num_layers} layers leave none after the {prefix} dense first layers")
    return replace(config, num_layers=num_layers, moe_layers=tuple(range(prefix, num_layers)))
