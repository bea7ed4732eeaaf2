"""The planner tests' toy cluster and a small model config."""

from __future__ import annotations

from loongtrain.model.config import ModelConfig
from loongtrain.plan.cluster import Cluster

EPS = 1e-12  # latencies small enough to vanish


def toy_cluster(**kw) -> Cluster:
    """4 devices per node; attention 2048 FLOP/s, matmul 2048 FLOP/s, intra 1024 B/s, NIC 64 B/s."""
    base = dict(
        name="toy", gpus_per_node=4, memory_gib=1.0, peak_tflops=4096e-12, matmul_tflops=2048e-12,
        attention_tflops=2048e-12, intra_node_gbyte_s=1024e-9, nic_gbit_s=64 * 8e-9, nics_per_node=4,
        link_efficiency=1.0, intra_latency_us=EPS, inter_latency_us=EPS, usable_memory_fraction=1.0,
    )
    return Cluster(**dict(base, **kw))


SMALL = ModelConfig(vocab_size=256, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=128)


def memory(model: ModelConfig, layout, *, seq_len: int, batch: int, zero_size: int, dtype_bytes: int = 2,
           lora=None, kernels: tuple[str, ...] = (), phases=(), **modes) -> dict[str, float]:
    """:func:`~loongtrain.plan.memory_model.memory_per_rank` with the memory modes named as ParallelConfig's fields
    (``recompute``, ``offload_activations``, ...; parameter offload under ZeRO) and the run's features (``lora``,
    ``kernels``, an objective's ``phases``: :func:`~loongtrain.plan.memory_terms.feature_terms`)."""
    from loongtrain.parallel.config import ParallelConfig
    from loongtrain.plan.memory_model import memory_per_rank
    from loongtrain.plan.memory_terms import feature_terms

    config = ParallelConfig(**{"zero": "full" if modes.get("offload_params") else "none", **modes})
    return memory_per_rank(model, layout, config, seq_len=seq_len, batch=batch, dtype_bytes=dtype_bytes,
                           zero_size=zero_size, features=feature_terms(lora, kernels, phases))
