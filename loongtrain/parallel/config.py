"""``ParallelConfig``: the degrees and memory modes of a run, and the one function that validates them.

One frozen object carries hp, cp, the double ring's inner-ring size, the rank placement, ZeRO and activation
checkpointing from the command line (``loongtrain train``) or the planner (``loongtrain plan``) to the
mesh, the trainer's :func:`~loongtrain.parallelize.compose.parallelize` and the cost model
(docs/configuration.md). :func:`validate_parallel` checks every rule that the given facts allow (the world
size, the sequence length, the model's head counts) and raises ``ValueError`` naming the offending
value and the valid choices; :func:`effective_kv_heads` is the GQA rule (docs/attention.md#the-gqa-rule).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from loongtrain._options import option
from loongtrain.parallel.layout import PLACEMENTS, Layout
from loongtrain.parallel.zigzag import check_sequence_length, divisors

ZERO_MODES = ("none", "full", "hybrid")
RECOMPUTE_MODES = ("none", "full", "selective")
#: how a sequence's chunks are laid on the context ranks (``--chunk-order``; loongtrain/parallel/documents.py)
CHUNK_ORDERS = ("zigzag", "balanced")
#: ``--compile`` (loongtrain/parallelize/compile.py)
COMPILE_MODES = ("off", "on")

__all__ = [
    "RECOMPUTE_MODES", "PLACEMENTS", "ZERO_MODES", "ParallelConfig", "effective_kv_heads",
    "mlp_tile_count", "validate_parallel",
]


@dataclass(frozen=True)
class ParallelConfig:
    """How one run is parallelised (validated on construction, world-independent rules only).

    Layout: ``hp`` head-parallel degree, ``cp`` context-parallel degree, ``inner_ring`` ranks per inner ring of the
    double ring, ``placement`` and ``interleaved`` (docs/attention.md#rank-placement). Memory (docs/memory.md):
    ``zero`` none / full / hybrid FSDP2 sharding over groups of ``zero_shard_size`` ranks (0: all),
    ``reshard_after_forward``, ``recompute`` none / full / selective (LoongTrain's Selective Checkpoint++)
    on the first ``recompute_fraction`` of the blocks; the offload and tiling
    modes ``offload_activations`` (all recomputed blocks but the last ``offload_keep``), ``mlp_tiles`` and
    ``offload_params`` (docs/memory.md).
    """

    hp: int = option(1, group="layout (2D-Attention)", help="head-parallel degree (all-to-all group size)")
    cp: int = option(1, "context-parallel degree (ring size)")
    inner_ring: int = option(1, "ranks per inner ring of the double ring (must divide cp; 1: a single ring)")
    placement: str = option("head_first", "rank placement: head_first or context_first")
    interleaved: bool = option(False, "interleave ring members inside an inner ring (needs an even --inner-ring)")
    zero: str = option("none", group="memory (ZeRO, recompute, offload, tiles)",
                       help="ZeRO (FSDP2): none (replicated weights, all-reduced gradients), full "
                       "(shard over all dp*sp ranks) or hybrid (shard over --zero-shard-size ranks)")
    zero_shard_size: int = option(0, "ranks per shard group for --zero hybrid (0: all ranks)")
    reshard_after_forward: bool = option(True, "FSDP2: free gathered weights after each block's forward")
    recompute: str = option("none", "recompute in the backward: none (keep every activation), full (keep each block's "
                        "input), or selective (also keep the attention outputs: no attention or communication is "
                        "recomputed)")
    recompute_fraction: float = option(1.0, "fraction of the blocks (the first ones) that --recompute applies to")
    offload_activations: bool = option(False, "copy the tensors kept between forward and backward (recomputed "
                                     "blocks' inputs, selective recompute's attention outputs) to pinned host memory "
                                     "and bring each block's back one block ahead of its backward")
    offload_keep: int = option(0, "with --offload-activations: the last N recomputed blocks keep what they save on "
                             "the device (they run backward first): device memory traded for host memory")
    mlp_tiles: str = option("1", "sequence tiles of each feed-forward (with its norm): a positive integer (1: "
                          "untiled) or auto; the backward recomputes one tile at a time")
    offload_params: bool = option(False, "FSDP2 CPUOffloadPolicy: parameters, gradients and AdamW states on the "
                                "host, the optimizer step on the CPU")

    def __post_init__(self) -> None:
        validate_parallel(self)

    @classmethod
    def from_layout(cls, layout: Layout, **memory: Any) -> ParallelConfig:
        """The configuration of ``layout``'s degrees and placement (memory options from ``memory``)."""
        return cls(hp=layout.hp, cp=layout.cp, inner_ring=layout.inner_ring, placement=layout.placement,
                   interleaved=layout.interleaved, **memory)

    @property
    def sp(self) -> int:
        """Ranks sharing one sequence: ``hp * cp``."""
        return self.hp * self.cp

    def layout(self, world_size: int) -> Layout:
        """The rank layout on ``world_size`` ranks (ValueError when the world does not fit)."""
        layout = validate_parallel(self, world_size)
        assert layout is not None
        return layout

    def shard_size(self, world_size: int) -> int:
        """Ranks that shard one copy of the weights: 1 for ``none``, ``world_size`` for ``full``, else
        ``zero_shard_size`` (0: all ranks). ValueError unless it divides ``world_size`` and is >= 2."""
        if self.zero == "none":
            return 1
        if self.zero == "full" or self.zero_shard_size in (0, world_size):
            return world_size
        if self.zero_shard_size < 2 or world_size % self.zero_shard_size != 0:
            valid = [s for s in range(2, world_size + 1) if world_size % s == 0]
            raise ValueError(
                f"zero_shard_size={self.zero_shard_size} must divide the world size {world_size} and be "
                f">= 2 (valid: {valid}, or 0 for all)"
            )
        return self.zero_shard_size

    def label(self) -> str:
        """A short one-line description (planner output and logs)."""
        shard = f"/{self.zero_shard_size}" if self.zero_shard_size else ""
        inter = " interleaved" if self.interleaved else ""
        modes = "".join(f" {name}" for name in ("offload_activations", "offload_params") if getattr(self, name))
        tiles = f" mlp_tiles={self.mlp_tiles}" if self.mlp_tiles != "1" else ""
        keep = f" offload_keep={self.offload_keep}" if self.offload_keep else ""
        return (f"hp={self.hp} cp={self.cp} inner_ring={self.inner_ring} {self.placement}{inter} "
                f"zero={self.zero}{shard} recompute={self.recompute}{modes}{keep}{tiles}")


def effective_kv_heads(num_heads: int, num_kv_heads: int, hp: int) -> int:
    """The GQA rule (docs/attention.md#the-gqa-rule): ``He``, the KV heads entering the head all-to-all.

    ``hp`` must divide ``num_heads``; with ``num_kv_heads >= hp`` the KV heads are split (``hp`` must
    divide them, ``He = num_kv_heads``), otherwise each is replicated ``hp / num_kv_heads`` times
    (``hp`` must be a multiple of them, ``He = hp``). ValueError naming the value otherwise.
    """
    for name, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("hp", hp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    if num_heads % hp != 0:
        raise ValueError(f"num_heads={num_heads} must be divisible by hp={hp}")
    if num_kv_heads >= hp:
        if num_kv_heads % hp != 0:
            raise ValueError(
                f"num_kv_heads={num_kv_heads} >= hp={hp} must be divisible by hp (KV heads are split)"
            )
        return num_kv_heads
    if hp % num_kv_heads != 0:
        raise ValueError(
            f"hp={hp} > num_kv_heads={num_kv_heads} must be a multiple of num_kv_heads "
            f"(KV heads are replicated hp/num_kv_heads times)"
        )
    return hp


def mlp_tile_count(mlp_tiles: str, local_tokens: int, dim: int, ffn_dim: int, *, strict: bool = True) -> int:
    """Tiles of a rank's ``local_tokens`` for the sequence-tiled MLP (docs/memory.md).

    ``"N"``: ``N`` (with ``strict``, ValueError unless it divides ``local_tokens``). ``"auto"``: tiles of at most
    ``dim`` tokens (ALST's rule: ``ceil(local_tokens / dim)`` tiles) and at least ``ceil(ffn_dim / dim)`` of
    them, so one tile's ``[tokens / N, ffn_dim]`` intermediate is at most ``dim x ffn_dim`` elements (a
    constant, whatever the length) and never more than the block's hidden input ``[local_tokens, dim]``; at
    most ``local_tokens``. The tiles need not be equal (:func:`loongtrain.parallelize.mlp_tiles.tile_bounds`), so
    ``auto`` never falls back to one-token tiles when ``local_tokens`` has no divisor of the right size.
    """
    if mlp_tiles == "auto":
        need = max(-(-ffn_dim // dim), -(-local_tokens // dim), 1)
        return min(need, max(local_tokens, 1))
    if not (isinstance(mlp_tiles, str) and mlp_tiles.isdigit() and int(mlp_tiles) >= 1):
        raise ValueError(f"mlp_tiles={mlp_tiles!r} must be a positive integer or 'auto'")
    tiles = int(mlp_tiles)
    if strict and local_tokens % tiles:
        valid = divisors(local_tokens)
        shown = valid if len(valid) <= 24 else [*valid[:12], "...", *valid[-4:]]
        raise ValueError(f"mlp_tiles={tiles} must divide the {local_tokens} local tokens of a rank (seq_len / "
                         f"(hp*cp)); valid: {shown} or 'auto'")
    return tiles


def validate_parallel(
    cfg: ParallelConfig,
    world_size: int | None = None,
    *,
    seq_len: int | None = None,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
) -> Layout | None:
    """Check every rule that the given facts allow; return the Layout when ``world_size`` is given.

    Always: the modes (``zero``, ``recompute``, flags, ``recompute_fraction``, ``zero_shard_size``) and the layout
    rules that need no world (positive degrees, ``placement``, ``inner_ring`` divides ``cp``, an even inner ring
    for ``interleaved``; :class:`~loongtrain.parallel.layout.Layout` states them). With ``world_size``:
    ``hp*cp`` divides it and so does ``zero_shard_size``. With ``seq_len``: divisible by ``2*hp*cp``.
    With ``num_heads`` (and ``num_kv_heads``, default ``num_heads``): the GQA rule. Raises ValueError
    naming the offending value and the valid choices.
    """
    if cfg.zero not in ZERO_MODES:
        raise ValueError(f"zero={cfg.zero!r} is not one of {ZERO_MODES}")
    if isinstance(cfg.zero_shard_size, bool) or not isinstance(cfg.zero_shard_size, int) \
            or cfg.zero_shard_size < 0:
        raise ValueError(f"zero_shard_size={cfg.zero_shard_size!r} must be an integer >= 0 (0: all ranks)")
    if cfg.zero_shard_size and cfg.zero != "hybrid":
        raise ValueError(f"zero_shard_size={cfg.zero_shard_size} needs zero='hybrid' (got zero={cfg.zero!r})")
    if not isinstance(cfg.mlp_tiles, str) or not (cfg.mlp_tiles == "auto" or (
            cfg.mlp_tiles.isdigit() and int(cfg.mlp_tiles) >= 1)):
        raise ValueError(f"mlp_tiles={cfg.mlp_tiles!r} must be a positive integer or 'auto'")
    for name in ("interleaved", "reshard_after_forward", "offload_activations", "offload_params"):
        if not isinstance(getattr(cfg, name), bool):
            raise ValueError(f"{name}={getattr(cfg, name)!r} must be True or False")
    if cfg.recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute={cfg.recompute!r} is not one of {RECOMPUTE_MODES}")
    if isinstance(cfg.recompute_fraction, bool) or not isinstance(cfg.recompute_fraction, (int, float)) \
            or not 0.0 <= cfg.recompute_fraction <= 1.0:
        raise ValueError(f"recompute_fraction={cfg.recompute_fraction!r} must be a number in [0, 1]")
    _check_offload(cfg)
    for name in ("hp", "cp", "inner_ring"):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    world = cfg.sp if world_size is None else world_size
    layout = Layout(world, cfg.hp, cfg.cp, cfg.inner_ring, cfg.placement, cfg.interleaved)
    if world_size is not None:
        cfg.shard_size(world_size)
    if seq_len is not None:
        check_sequence_length(seq_len, cfg.hp, cfg.cp)
        if cfg.mlp_tiles != "auto":
            mlp_tile_count(cfg.mlp_tiles, seq_len // cfg.sp, 1, 1)
    if num_heads is not None:
        effective_kv_heads(num_heads, num_heads if num_kv_heads is None else num_kv_heads, cfg.hp)
    return layout if world_size is not None else None


def _check_offload(cfg: ParallelConfig) -> None:
    """The offload modes' prerequisites: what they move must exist (docs/memory.md)."""
    if cfg.offload_activations and (cfg.recompute == "none" or cfg.recompute_fraction == 0):
        raise ValueError(f"--offload-activations moves what recomputed blocks keep: it needs --recompute full or "
                         f"selective and --recompute-fraction > 0; got --recompute {cfg.recompute}, "
                         f"--recompute-fraction "
                         f"{cfg.recompute_fraction}")
    if isinstance(cfg.offload_keep, bool) or not isinstance(cfg.offload_keep, int) or cfg.offload_keep < 0:
        raise ValueError(f"offload_keep={cfg.offload_keep!r} must be an integer >= 0 (blocks kept on the device)")
    if cfg.offload_keep and not cfg.offload_activations:
        raise ValueError(f"--offload-keep {cfg.offload_keep} names blocks that --offload-activations leaves on the "
                         "device: add --offload-activations (or drop --offload-keep)")
    if cfg.offload_params and cfg.zero == "none":
        raise ValueError("--offload-params (FSDP2's CPUOffloadPolicy) needs --zero full or hybrid; got --zero none")
