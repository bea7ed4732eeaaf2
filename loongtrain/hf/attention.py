"""2D-Attention inside Hugging Face causal LMs, through transformers' attention interface (docs/memory.md).

:func:`apply_to_hf` registers the ``"loongtrain"`` attention implementation (and a mask function
that builds no dense mask), switches the model to it, and gives each attention module the same
replaceable ``attention_fn`` (a :class:`~loongtrain.attn.apply.MeshAttention` bound to the mesh)
that loongtrain's own model uses. Every layer then calls::

    module.attention_fn(q [B, S_local, H, D], k, v [B, S_local, Hkv, D], causal=..., softmax_scale=...
                        [, sliding_window=w] [, cu_seqlens=...] [, chunk_order=...])

Inputs must be each rank's zigzag shard (:func:`loongtrain.shard_sequence`; or the layout of a
``chunk_order=`` passed to the model's forward, e.g. the balanced one for packed documents) of ``input_ids`` with
the *global* ``position_ids`` of one unbroken sequence, or, for packed documents, the documents'
boundaries passed to the model's forward as ``cu_seqlens=`` (loongtrain.attention's convention; the
trainer does this under ``--doc-mask on``), with position ids that may restart per document. Padding
masks, position ids that restart without ``cu_seqlens``, attention dropout and KV caches are rejected
with a ValueError; each layer's sliding window (Mistral's, or a ``sliding_attention`` layer of ``layer_types``:
HF passes ``None`` for a full layer) goes to ``loongtrain.attention(..., sliding_window=)``, gpt-oss's sinks
(``s_aux``) to ``sinks=``. Never pass
``labels=`` to the sharded model (HF would shift them inside the local shard): shift the labels
of the full sequence first, shard them too, and use ``loongtrain.loss.sharded.sharded_cross_entropy``.
"""

from __future__ import annotations

import torch
from torch import nn

from loongtrain.attn.apply import ATTENTION_FN_ATTR, MeshAttention
from loongtrain.hf.families import check_architecture, decoder_layers, is_hf_model
from loongtrain.hf.linear import bind_linear_attention, linear_kind
from loongtrain.parallel.mesh import Mesh
from loongtrain.parallel.zigzag import shard_indices

Tensor = torch.Tensor

ATTN_IMPLEMENTATION = "loongtrain"
_CHECKS_POSITIONS = "_loongtrain_checks_positions"  # set on the first attention module by apply_to_hf


def hf_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    is_causal: bool | None = None,
    **kwargs: object,
) -> tuple[Tensor, None]:
    """transformers' attention-interface signature: ``query [B, H, S, D]``, ``key, value [B, Hkv, S, D]``
    -> ``(out [B, S, H, D], None)``, computed by ``module.attention_fn`` on this rank's shard."""
    attention_fn = getattr(module, ATTENTION_FN_ATTR, None)
    if attention_fn is None:
        raise ValueError(
            f"{type(module).__name__} has no {ATTENTION_FN_ATTR}: call loongtrain.apply_2d_attention(model, mesh) "
            f"before running a model with attn_implementation={ATTN_IMPLEMENTATION!r}"
        )
    if attention_mask is not None:
        raise ValueError("loongtrain attention takes no attention mask (causal attention only)")
    if dropout:
        raise ValueError(f"attention dropout={dropout} is not supported by loongtrain attention; use 0.0")
    for name in ("softcap", "cu_seq_lens_q", "cu_seq_lens_k"):
        if kwargs.get(name) is not None:
            raise ValueError(f"{name} is not supported by loongtrain attention")
    if key.shape[2] != query.shape[2]:
        raise ValueError(
            f"keys ({key.shape[2]}) and queries ({query.shape[2]}) differ in length: KV caches are not "
            f"supported by loongtrain attention; run with use_cache=False"
        )
    mesh = getattr(attention_fn, "mesh", None)
    seq_len = query.shape[2] * (mesh.sp if mesh is not None else 1)
    # HF's window (masking_utils.sliding_window_overlay: kv_idx > q_idx - w) is loongtrain's (i - w < j <= i);
    # a window >= the sequence length is a no-op
    window = {"sliding_window": sliding_window} if sliding_window is not None and sliding_window < seq_len else {}
    cu_seqlens = kwargs.get("cu_seqlens")  # packed documents (full-sequence boundaries, loongtrain.attention's)
    documents = {"cu_seqlens": cu_seqlens} if cu_seqlens is not None else {}
    if kwargs.get("chunk_order") is not None:  # the layout the inputs were sharded with (default zigzag)
        documents["chunk_order"] = kwargs["chunk_order"]
    if kwargs.get("s_aux") is not None:  # gpt-oss's attention sinks, one logit per head
        documents["sinks"] = kwargs["s_aux"]
    position_ids = kwargs.get("position_ids")
    # a value check (host-side) in the first attention layer: eager only, and the flag is not read while compiling
    # (an int attribute is a constant to dynamo: reading it would give every layer a graph; docs/compile.md)
    if (not torch.compiler.is_compiling() and isinstance(position_ids, Tensor) and "cu_seqlens" not in documents
            and module.__dict__.get(_CHECKS_POSITIONS, False)):
        _check_positions(position_ids, mesh, seq_len, documents.get("chunk_order"))
    causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
    out = attention_fn(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
        causal=causal, softmax_scale=scaling, **window, **documents,
    )
    return out, None


def _check_positions(position_ids: Tensor, mesh: Mesh | None, seq_len: int, chunk_order=None) -> None:
    """Raise ValueError unless each row is ``offset + (this rank's shard of arange(seq_len))`` (zigzag, or
    ``chunk_order``'s layout)."""
    if mesh is None or mesh.sp == 1:
        expected = torch.arange(seq_len)
    else:
        order = tuple(chunk_order) if chunk_order is not None else None
        expected = shard_indices(seq_len, mesh.hp, mesh.cp, mesh.cp_rank, mesh.hp_rank, order)
    offset = position_ids - expected.to(position_ids.device)
    if not bool((offset == offset[..., :1]).all()):
        raise ValueError(
            "position_ids must be the global positions of one unbroken sequence, sharded like the inputs "
            "(loongtrain.shard_sequence(arange(S), mesh, dim=-1)); positions that restart (packed documents) "
            "need the documents' boundaries: pass cu_seqlens=... to the model's forward"
        )


def no_dense_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: object = None,
    attention_mask: Tensor | None = None,
    **kwargs: object,
) -> None:
    """transformers' mask-interface signature: builds no mask (causality is loongtrain attention's job).

    Raises ValueError for a padding mask that masks anything (padding is not supported)."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError(
            "attention_mask masks some tokens: loongtrain attention does not support padding; pack "
            "full-length sequences and pass attention_mask=None"
        )
    return None


def register_attention() -> None:
    """Register ``"loongtrain"`` in transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, hf_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, no_dense_mask)


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The softmax self-attention module of every decoder layer of a supported HF causal LM that has one (a
    linear-attention layer's block is not one: loongtrain/hf/linear.py)."""
    layers = decoder_layers(model)
    mixers = [getattr(layer, "self_attn", None) or getattr(layer, "linear_attn", None) for layer in layers]
    if not all(isinstance(m, nn.Module) for m in mixers):
        raise ValueError(f"{type(model).__name__} has no decoder layers with a self_attn module")
    return [m for m in mixers if linear_kind(m) is None]


def apply_to_hf(model: nn.Module, mesh: Mesh) -> nn.Module:
    """Run every attention layer of the HF causal LM ``model`` through 2D-Attention on ``mesh``.

    Registers the ``"loongtrain"`` attention implementation, selects it on ``model`` (and its
    config), turns the KV cache off (training), sets each layer's ``attention_fn`` to
    ``MeshAttention(mesh)`` and runs each linear-attention block through ``loongtrain.linear_attention`` on
    ``mesh`` (:func:`~loongtrain.hf.linear.bind_linear_attention`). Returns ``model`` (changed in place);
    applying again rebinds.
    Raises ValueError for a non-HF model, one whose layers do not match (naming what differs) or a non-Mesh
    ``mesh``.
    """
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a loongtrain Mesh (init_mesh / single_process_mesh); got {mesh!r}")
    if not is_hf_model(model):
        raise ValueError(f"expected a transformers PreTrainedModel; got {type(model).__name__}")
    check_architecture(type(model).__name__, model)  # by structure (docs/hf-models.md#families)
    register_attention()
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION
    model.config.use_cache = False
    for i, module in enumerate(attention_modules(model)):
        setattr(module, ATTENTION_FN_ATTR, MeshAttention(mesh))
        module.__dict__[_CHECKS_POSITIONS] = i == 0  # the first attention layer checks the position ids
    bind_linear_attention(model, mesh)
    return model
