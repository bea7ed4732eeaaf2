"""loongtrain: long-sequence LLM training with 2D-Attention (head-parallel x context-parallel).

The names below are imported when first used (PEP 562), so ``import loongtrain.commands`` does not import
torch: the ``loongtrain`` command's Ctrl-C while torch loads is its one line (commands/errors.py)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the same imports, for type checkers and the import-graph test
    from loongtrain.attn.api import attention
    from loongtrain.attn.linear.api import linear_attention
    from loongtrain.hf.apply import apply_2d_attention
    from loongtrain.parallel.config import ParallelConfig, validate_parallel
    from loongtrain.parallel.documents import (
        balanced_chunk_order,
        cu_seqlens_from_eos,
        document_position_ids,
        packed_inputs,
    )
    from loongtrain.parallel.layout import Layout
    from loongtrain.parallel.mesh import Mesh, destroy_mesh, init_mesh, single_process_mesh
    from loongtrain.parallel.sharding import gather_sequence, shard_sequence
    from loongtrain.parallel.workers import run_local

#: public name -> the module defining it
_HOME = {"attention": "loongtrain.attn.api", "linear_attention": "loongtrain.attn.linear.api",
         "apply_2d_attention": "loongtrain.hf.apply",
         "ParallelConfig": "loongtrain.parallel.config", "validate_parallel": "loongtrain.parallel.config",
         "balanced_chunk_order": "loongtrain.parallel.documents",
         "cu_seqlens_from_eos": "loongtrain.parallel.documents",
         "document_position_ids": "loongtrain.parallel.documents", "packed_inputs": "loongtrain.parallel.documents",
         "Layout": "loongtrain.parallel.layout", "Mesh": "loongtrain.parallel.mesh",
         "destroy_mesh": "loongtrain.parallel.mesh", "init_mesh": "loongtrain.parallel.mesh",
         "single_process_mesh": "loongtrain.parallel.mesh", "gather_sequence": "loongtrain.parallel.sharding",
         "shard_sequence": "loongtrain.parallel.sharding", "run_local": "loongtrain.parallel.workers"}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'loongtrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOME[name]), name)
    globals()[name] = value
    return value


__all__ = [
    "Layout",
    "Mesh",
    "ParallelConfig",
    "apply_2d_attention",
    "attention",
    "balanced_chunk_order",
    "cu_seqlens_from_eos",
    "document_position_ids",
    "destroy_mesh",
    "gather_sequence",
    "init_mesh",
    "linear_attention",
    "packed_inputs",
    "run_local",
    "shard_sequence",
    "single_process_mesh",
    "validate_parallel",
]
__version__ = "0.1.0"

