"""loongtrain: long-sequence LLM training with 2D-Attention (head-parallel x context-parallel)."""

from loongtrain.attn.api import attention
from loongtrain.parallel.layout import Layout
from loongtrain.parallel.mesh import Mesh, init_mesh, single_process_mesh
from loongtrain.parallel.sharding import gather_sequence, shard_sequence

__all__ = [
    "Layout",
    "Mesh",
    "attention",
    "gather_sequence",
    "init_mesh",
    "shard_sequence",
    "single_process_mesh",
]
__version__ = "0.1.0"
