"""The memory terms of a planned step, in the order they compose (docs/design.md#how-to-add-a-memory-term): the
model's (its expert layers: loongtrain/model/moe_memory.py; its linear-attention layers:
loongtrain/attn/linear/memory.py; its latent attention: loongtrain/attn/mla_memory.py), the run's features (LoRA's
adapters: loongtrain/model/lora_terms.py; the attention kernels' backward scratch: loongtrain/attn/kernel_memory.py; the
objective's phases, from its registry entry: loongtrain/objectives/), then the memory modes of the layout (the
tiled MLP: loongtrain/parallelize/mlp_tiles.py; activation and parameter offload:
loongtrain/parallelize/offload_memory.py). Each term lives beside its feature; the planner
(:func:`~loongtrain.plan.memory_model.memory_per_rank`), the trainer's start-up report and the simulation's
comparison all sum these."""

from __future__ import annotations

from collections.abc import Sequence

from loongtrain.attn.cuda_kernels import SM_COUNT
from loongtrain.attn.kernel_memory import kernel_memory
from loongtrain.attn.linear.memory import linear_memory
from loongtrain.attn.mla_memory import latent_attention_memory
from loongtrain.model.config import ModelConfig
from loongtrain.model.lora import LoraConfig
from loongtrain.model.lora_terms import lora_memory
from loongtrain.model.memory import MemoryTerm
from loongtrain.model.moe_memory import moe_memory
from loongtrain.parallel.config import ParallelConfig
from loongtrain.parallelize.mlp_tiles import TiledMlpMemory
from loongtrain.parallelize.offload_memory import ActivationOffload, ParamOffload


def feature_terms(lora: LoraConfig | None = None, kernels: tuple[str, ...] = (),
                  phases: Sequence[MemoryTerm] = (), deterministic: bool = False,
                  sm_count: int = SM_COUNT) -> tuple[MemoryTerm, ...]:
    """A run's features' terms: ``lora``'s adapters, the backward scratch of the CUDA ``kernels`` the device may
    pick (``Cluster.attention_kernels``; none on CPU; ``deterministic``: FA2's deterministic dQ accumulators on
    ``sm_count`` SMs), and its objective's ``phases`` (its registry entry's)."""
    return (*lora_memory(lora), *kernel_memory(kernels, deterministic, sm_count), *phases)


def mode_terms(config: ParallelConfig) -> tuple[MemoryTerm, ...]:
    """The terms of ``config``'s memory modes: the tiled MLP (its rule gives 1 tile for ``mlp_tiles="1"``),
    activation offload, parameter offload."""
    return (TiledMlpMemory(config.mlp_tiles),
            *((ActivationOffload(config.offload_keep),) if config.offload_activations else ()),
            *((ParamOffload(),) if config.offload_params else ()))


def run_terms(model: ModelConfig, config: ParallelConfig,
              features: Sequence[MemoryTerm] = ()) -> tuple[MemoryTerm, ...]:
    """Every term of a step of ``model`` with ``config``'s modes and ``features``, in the order they compose
    (module docstring)."""
    return (*moe_memory(model), *linear_memory(model), *latent_attention_memory(model), *features,
            *mode_terms(config))
