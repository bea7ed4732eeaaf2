"""``apply_2d_attention``: give any model 2D-Attention from outside (docs/memory.md).

One entry point for both kinds of model: a Hugging Face causal LM routes its attention through
transformers' attention interface (:func:`loongtrain.hf.attention.apply_to_hf`); any other module tree
follows the ``attention_fn`` protocol (:func:`loongtrain.attn.apply.bind_attention_fn`). It lives in
``hf/`` because it is the lowest package that knows both.
"""

from __future__ import annotations

from torch import nn

from loongtrain.attn.apply import bind_attention_fn
from loongtrain.hf.attention import apply_to_hf
from loongtrain.hf.families import is_hf_model
from loongtrain.parallel.mesh import Mesh


def apply_2d_attention(model: nn.Module, mesh: Mesh) -> nn.Module:
    """Route every attention core of ``model`` through 2D-Attention on ``mesh``; returns ``model`` (changed
    in place; applying again rebinds). ValueError if ``mesh`` is not a
    :class:`~loongtrain.parallel.mesh.Mesh`, ``model`` is not a module, or it has no attention to route."""
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a loongtrain Mesh (init_mesh / single_process_mesh); got {mesh!r}")
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    if is_hf_model(model):
        return apply_to_hf(model, mesh)
    return bind_attention_fn(model, mesh)
