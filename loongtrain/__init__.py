"""loongtrain: long-sequence LLM training with 2D-Attention (head-parallel x context-parallel)."""

from loongtrain.attn.api import attention
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
    "packed_inputs",
    "run_local",
    "shard_sequence",
    "single_process_mesh",
    "validate_parallel",
]
__version__ = "0.1.0"

