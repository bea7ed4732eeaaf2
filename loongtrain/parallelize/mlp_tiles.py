"""Sequence-tiled feed-forward: the MLP and its norm over tiles of the local sequence (docs/memory.md).

``--mlp-tiles N|auto`` wraps every decoder block's feed-forward from outside (the model stays plain):
the block's ``norm -> MLP`` runs as one :class:`TiledMLP` over ``N`` tiles of the rank's local
tokens (dim 1 of ``[B, S/sp, dim]``). Its forward runs each tile without autograd and keeps only the
input; its backward recomputes one tile at a time (norm, projections, activation) and back-propagates
it, so the ``[S/sp, ffn_dim]`` intermediates exist only for one tile (``[S/(sp*N), ffn_dim]``).
Gradients are exact: the input's tiles' gradients are written into one tensor, the weights' summed
over the tiles and returned to autograd (which accumulates them into ``.grad`` as usual, FSDP2's
unsharded parameters included). ``auto`` is :func:`loongtrain.parallel.config.mlp_tile_count`'s rule.

The block keeps calling ``mlp(norm(h))``: the norm's ``forward`` becomes the identity on the instance
and the MLP's runs both, so parameter names (and checkpoints) are unchanged. Blocks are found by
:func:`loongtrain.hf.families.decoder_layers`; the (norm, MLP) pair by :data:`NORM_AND_MLP`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from loongtrain.hf.families import decoder_layers
from loongtrain.model.config import mlp_width
from loongtrain.model.memory import MemoryTerm, StepShape
from loongtrain.parallel.config import mlp_tile_count

Tensor = torch.Tensor

#: attribute names of (the norm before the MLP, the MLP) in a decoder block: loongtrain's, Hugging Face's
NORM_AND_MLP = (("ffn_norm", "feed_forward"), ("post_attention_layernorm", "mlp"))


class TiledMLP(torch.autograd.Function):
    """``fn(x)`` over ``tiles`` slices of dim 1, recomputed tile by tile in backward.

    Forward: ``(fn, tiles, x, *params) -> fn(x)`` computed per tile without autograd; saves ``x``.
    Backward: per tile, ``fn`` again with autograd (under the forward's autocast state), then its
    gradients: ``dx`` tile by tile, ``d params`` summed over the tiles. ``params`` are the tensors
    ``fn`` reads that require grad (so autograd accumulates their gradients).
    """

    @staticmethod
    def forward(ctx: Any, fn: Callable[[Tensor], Tensor], tiles: int, x: Tensor, *params: Tensor) -> Tensor:
        ctx.fn, ctx.tiles, ctx.params = fn, tiles, params
        kind = x.device.type
        ctx.autocast = (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
        ctx.save_for_backward(x)
        with torch.no_grad():
            return run_tiles(fn, x, tiles)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Any, ...]:
        (x,) = ctx.saved_tensors
        kind, enabled, dtype = ctx.autocast
        grad_x = torch.empty_like(x)
        grads: list[Tensor | None] = [None] * len(ctx.params)
        bounds = tile_bounds(x.shape[1], ctx.tiles)
        with torch.enable_grad(), torch.autocast(kind, dtype=dtype, enabled=enabled):
            for lo, hi in bounds:
                tile = x[:, lo:hi].detach().requires_grad_(x.requires_grad)
                out = ctx.fn(tile)
                inputs = ((tile,) if x.requires_grad else ()) + tuple(ctx.params)
                got = torch.autograd.grad(out, inputs, grad_out[:, lo:hi])
                if x.requires_grad:
                    grad_x[:, lo:hi] = got[0]
                    got = got[1:]
                grads = [g if acc is None else acc + g for acc, g in zip(grads, got, strict=True)]
        return (None, None, grad_x if x.requires_grad else None, *grads)




def tile_bounds(tokens: int, tiles: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` of ``min(tiles, tokens)`` near-equal tiles of ``tokens`` (equal when it divides)."""
    n = max(1, min(tiles, tokens))
    edges = [tokens * i // n for i in range(n + 1)]
    return list(zip(edges[:-1], edges[1:], strict=True))


def run_tiles(fn: Callable[[Tensor], Tensor], x: Tensor, tiles: int) -> Tensor:
    """``fn`` over the tiles of dim 1 of ``x``, written into one output tensor."""
    out: Tensor | None = None
    for lo, hi in tile_bounds(x.shape[1], tiles):
        part = fn(x[:, lo:hi])
        if out is None:
            out = part.new_empty((*x.shape[:2], *part.shape[2:]))
        out[:, lo:hi] = part
    assert out is not None
    return out


def _tiled_forward(spec: str, ffn_dim: int, fn: Callable[[Tensor], Tensor], modules: tuple[nn.Module, ...],
                   x: Tensor) -> Tensor:
    tiles = mlp_tile_count(spec, x.shape[1], x.shape[-1], ffn_dim, strict=False)
    if not torch.is_grad_enabled():
        return run_tiles(fn, x, tiles)
    params = [p for m in modules for p in m.parameters() if p.requires_grad]
    return TiledMLP.apply(fn, tiles, x, *params)


def _identity(x: Tensor) -> Tensor:
    return x


def norm_and_mlp(block: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The block's (norm before the MLP, MLP) by :data:`NORM_AND_MLP`; ValueError naming the block."""
    for norm, mlp in NORM_AND_MLP:
        if isinstance(getattr(block, norm, None), nn.Module) and isinstance(getattr(block, mlp, None), nn.Module):
            return getattr(block, norm), getattr(block, mlp)
    raise ValueError(f"--mlp-tiles: {type(block).__name__} has none of the (norm, MLP) attribute pairs "
                     f"{NORM_AND_MLP}")


def ffn_dim_of(mlp: nn.Module) -> int:
    """The MLP's intermediate width: ``intermediate_size`` (Hugging Face) or its first projection's."""
    size = getattr(mlp, "intermediate_size", None)
    if isinstance(size, int):
        return size
    for name in ("w1", "gate_proj", "up_proj"):
        proj = getattr(mlp, name, None)
        if isinstance(proj, nn.Linear):
            return proj.out_features
    raise ValueError(f"--mlp-tiles: cannot tell the intermediate size of {type(mlp).__name__}")


def apply_mlp_tiling(model: nn.Module, mlp_tiles: str) -> int:
    """Tile every block's ``norm -> MLP`` over ``mlp_tiles`` ("1": nothing, "N", "auto"); returns the
    number of blocks tiled. Idempotent (a tiled block is left as it is)."""
    if mlp_tiles == "1":
        return 0
    mlp_tile_count(mlp_tiles, 1, 1, 1, strict=False)  # validates the spelling
    tiled = 0
    for block in decoder_layers(model):
        norm, mlp = norm_and_mlp(block)
        if "_loongtrain_tiles" not in mlp.__dict__:
            fn = _compose(mlp.forward, norm.forward)
            mlp.forward = functools.partial(_tiled_forward, mlp_tiles, ffn_dim_of(mlp), fn, (norm, mlp))
            norm.forward = _identity
            mlp._loongtrain_tiles = mlp_tiles
        tiled += 1
    return tiled


def _compose(mlp: Callable[[Tensor], Tensor], norm: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    def norm_then_mlp(x: Tensor) -> Tensor:
        return mlp(norm(x))

    return norm_then_mlp


class TiledMlpMemory(MemoryTerm):
    """The tiled MLP's memory term (the protocol: loongtrain/model/memory.py): the feed-forward runs over
    :func:`~loongtrain.parallel.config.mlp_tile_count` tiles of the rank's tokens (the trainer's own rule, here
    on the model's average MLP width), so of SwiGLU's intermediates and the MLP norm's output only one tile's
    exist at a time; the planner's kept sets and the MLP's backward divide them by :attr:`StepShape.tiles`."""

    name = "mlp tiles"

    def __init__(self, mlp_tiles: str) -> None:
        self.mlp_tiles = mlp_tiles

    def tiles(self, s: StepShape) -> int:
        m = s.model
        return mlp_tile_count(self.mlp_tiles, int(s.tokens), m.dim, round(mlp_width(m)), strict=False)
