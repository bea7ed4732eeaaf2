"""Step time of a hybrid's linear-attention layer (docs/linear-attention.md#planning), per rank, from the code's own
descriptions: its recurrence's FLOPs (:func:`~loongtrain.model.config.linear_layer_forward_flops`, with the
transition columns a sharded run adds), the head all-to-alls of its tensors, and the exchange over the context ranks
(:func:`~loongtrain.attn.linear.layout.exchange_bytes`: each run's halo and state pair gathered, their gradients
returned), not hidden behind compute (the composition waits for the pairs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loongtrain.attn.linear.layout import RunLayout, exchange_bytes
from loongtrain.model.config import ModelConfig, linear_channels, linear_layer_forward_flops
from loongtrain.parallel.config import effective_kv_heads
from loongtrain.parallel.layout import Layout
from loongtrain.plan.attention_cost import a2a_seconds
from loongtrain.plan.cluster import Cluster
from loongtrain.plan.traffic import link_stats

#: a linear layer's backward computes about twice its forward (the chunked form's gradients, as attention's)
BACKWARD_RATIO = 2.0


@dataclass(frozen=True)
class LinearTime:
    """Seconds per rank of one linear-attention layer's core: the recurrence (``compute_*``), the head
    all-to-alls (``a2a_*``) and the context ranks' exchange (``exchange_*``)."""

    compute_fwd: float
    compute_bwd: float
    a2a_fwd: float
    a2a_bwd: float
    exchange_fwd: float
    exchange_bwd: float


def linear_time(model: ModelConfig, layout: Layout, cluster: Cluster, *, batch: int, seq_len: int,
                dtype_bytes: int) -> LinearTime:
    """:class:`LinearTime` of one linear layer of ``model`` on ``layout`` (zigzag) for ``batch`` sequences of
    ``seq_len`` tokens."""
    tokens = batch * seq_len / layout.sp
    compute = tokens * linear_layer_forward_flops(model, widened=layout.cp > 1) / (cluster.matmul_tflops * 1e12)
    keys = effective_kv_heads(model.linear_num_value_heads, model.linear_num_key_heads, layout.hp)
    values, b = model.linear_num_value_heads, dtype_bytes
    state = 8 if b == 8 else 4
    channels = linear_channels(model) + 2 * (keys - model.linear_num_key_heads) * model.linear_key_head_dim
    # per head peer: the convolution's inputs and beta, the gate in the compute dtype; the output back
    piece_in = tokens * (channels + values) * b / layout.hp
    piece_gate = tokens * values * state / layout.hp
    piece_out = tokens * values * model.linear_value_head_dim * b / layout.hp
    a2a = (a2a_seconds(layout, cluster, piece_in) + a2a_seconds(layout, cluster, piece_gate)
           + a2a_seconds(layout, cluster, piece_out))
    exchange = 0.0
    if layout.cp > 1:
        sent = exchange_bytes(RunLayout(2 * layout.cp, layout.cp), batch=batch,
                              key_heads=model.linear_num_key_heads, value_heads=values,
                              key_dim=model.linear_key_head_dim, value_dim=model.linear_value_head_dim,
                              taps=model.linear_conv_kernel_dim, hp=layout.hp,
                              dtype=_dtype(dtype_bytes))
        links = link_stats(layout, cluster.gpus_per_node)
        cross = links.inner_cross or links.outer_cross
        bandwidth = cluster.cross_bw(max(links.inner_senders, links.outer_senders, 1)) if cross else cluster.intra_bw
        latency = (cluster.inter_latency_us if cross else cluster.intra_latency_us) * 1e-6
        exchange = (sent["state"] + sent.get("halo", 0)) / bandwidth + 2 * (layout.cp - 1) * latency
    return LinearTime(compute, BACKWARD_RATIO * compute, a2a, a2a, exchange, exchange)


def _dtype(dtype_bytes: int) -> torch.dtype:
    return {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[dtype_bytes]
