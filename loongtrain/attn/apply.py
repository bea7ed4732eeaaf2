"""``bind_attention_fn``: give a model that follows the ``attention_fn`` protocol 2D-Attention by swapping its
attention core (docs/memory.md); :func:`loongtrain.apply_2d_attention` (``hf/apply.py``) calls it for
every model that is not a Hugging Face one.

Protocol: a model takes part when every attention module routes its core through one replaceable
attribute ``attention_fn`` (an instance or class attribute, not a submodule), called as::

    attention_fn(q, k, v, causal=True[, softmax_scale=s][, cu_seqlens=c][, sliding_window=w][, chunk_order=o]
                 [, sinks=t])
        q [B, S_local, H, D], k, v [B, S_local, Hkv, D] -> out [B, S_local, H, D]

(``cu_seqlens``: packed documents of the full sequence; ``sliding_window``: Mistral's window;
``chunk_order``: the layout the tokens were sharded with, default zigzag; ``sinks``: gpt-oss's attention sinks
``[H]``; all as in
:func:`loongtrain.attention`, passed only when set)

with query head ``h`` using KV head ``h // (H / Hkv)`` (GQA) and ``softmax_scale`` defaulting to
``1/sqrt(D)``. Everything else in the model must be token-wise (norms, MLPs, RoPE on the given
global ``position_ids``), so feeding each rank its zigzag shard (:func:`loongtrain.shard_sequence`)
and these global positions gives the exact result of the unsharded model. ``loongtrain.model``'s
decoder follows the protocol; Hugging Face models reach it through transformers' attention interface.
"""

from __future__ import annotations

import torch
from torch import nn

from loongtrain.attn.api import attention
from loongtrain.parallel.mesh import Mesh

ATTENTION_FN_ATTR = "attention_fn"


class MeshAttention:
    """An ``attention_fn`` bound to ``mesh``: calls :func:`loongtrain.attention` on it.

    A plain object (no closure), so it pickles whenever its mesh does (a single-process mesh) and
    ``copy.deepcopy`` of a model shares the mesh and its process groups instead of copying them.
    """

    __slots__ = ("mesh",)

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: bool = True,
        softmax_scale: float | None = None,
        cu_seqlens=None,
        sliding_window: int | None = None,
        chunk_order=None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return attention(q, k, v, self.mesh, causal=causal, softmax_scale=softmax_scale, cu_seqlens=cu_seqlens,
                         sliding_window=sliding_window, chunk_order=chunk_order, sinks=sinks)

    def __getstate__(self) -> Mesh:
        return self.mesh

    def __setstate__(self, mesh: Mesh) -> None:
        self.mesh = mesh

    def __deepcopy__(self, memo: dict) -> MeshAttention:
        return MeshAttention(self.mesh)

    def __repr__(self) -> str:
        return f"MeshAttention({self.mesh!r})"


def bind_attention_fn(model: nn.Module, mesh: Mesh) -> nn.Module:
    """Route every ``attention_fn`` in ``model``'s module tree through 2D-Attention on ``mesh``.

    Sets ``module.attention_fn = MeshAttention(mesh)`` on each module that has the attribute (see the
    module docstring for the protocol) and returns ``model`` (changed in place). Idempotent:
    applying again, with the same or another mesh, rebinds. Raises ValueError if no module of ``model``
    has an ``attention_fn``, or one that is not a plain callable.
    """
    targets = [m for m in model.modules() if hasattr(m, ATTENTION_FN_ATTR)]
    if not targets:
        raise ValueError(
            f"{type(model).__name__} has no module with an '{ATTENTION_FN_ATTR}' attribute: its attention "
            f"must call a replaceable attention_fn(q, k, v, causal=...) (docs/memory.md)"
        )
    for module in targets:
        current = getattr(module, ATTENTION_FN_ATTR)
        if isinstance(current, nn.Module) or not callable(current):
            raise ValueError(
                f"{type(module).__name__}.{ATTENTION_FN_ATTR} must be a plain callable, "
                f"got {type(current).__name__}"
            )
        setattr(module, ATTENTION_FN_ATTR, MeshAttention(mesh))
    return model
