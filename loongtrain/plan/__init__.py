"""``loongtrain.plan``: cost model and configuration search for 2D-Attention training.

Python entry points (``loongtrain train --plan auto`` uses :func:`best_fitting`)::

    from loongtrain.plan import plan, best_fitting
    best = best_fitting("7b-gqa", "a100", nodes=8, seq_len=1 << 20)
    c = best.config  # a ParallelConfig: c.hp, c.cp, c.inner_ring, c.placement, c.zero, c.recompute, ...
"""

from loongtrain.plan.attention_cost import AttentionTime, AttnShape, attention_time, predict_attention_time
from loongtrain.plan.cluster import Cluster, builtin_clusters, load_cluster
from loongtrain.plan.cost import Candidate, step_cost
from loongtrain.plan.max_seq import max_seq_len
from loongtrain.plan.memory_model import memory_per_rank
from loongtrain.plan.search import best_fitting, enumerate_configs, plan

__all__ = [
    "AttentionTime", "AttnShape", "Candidate", "Cluster", "attention_time", "best_fitting",
    "builtin_clusters", "enumerate_configs", "load_cluster", "max_seq_len", "memory_per_rank", "plan",
    "predict_attention_time", "step_cost",
]
