"""The CUDA attention kernels' memory term (docs/planner.md#memory-per-device): the backward scratch of the
largest call a rank makes (:func:`~loongtrain.attn.cuda_kernels.backward_scratch_bytes`: the fp32 dQ accumulator
and row sums, GQA's expanded dK/dV, or one head's past ``SPLIT_BACKWARD_BYTES``; under ``--deterministic`` FA2's
``ceil(SMs / (B * H))`` dQ accumulators), the largest among the kernels the device's choice may pick
(``Cluster.attention_kernels``; none on CPU). The protocol: loongtrain/model/memory.py.
"""

from __future__ import annotations

from loongtrain.attn.cuda_kernels import SM_COUNT, largest_backward_scratch
from loongtrain.model.config import ModelConfig
from loongtrain.model.memory import MemoryTerm, StepShape
from loongtrain.parallel.config import effective_kv_heads
from loongtrain.parallel.layout import Layout


def kernel_scratch_bytes(model: ModelConfig, layout: Layout, t: float, dtype_bytes: int,
                         kernels: tuple[str, ...], deterministic_sms: int | None = None) -> float:
    """The largest backward scratch of ``kernels`` for a rank's largest attention call: its ``t`` tokens in the
    heads' layout (``t * hp`` tokens of ``H / hp`` heads, against as many keys); 0 without kernels (CPU).
    ``deterministic_sms``: FA2's deterministic backward on a device of that many SMs (None: not deterministic)."""
    return _scratch(model, layout.hp, t, dtype_bytes, kernels, deterministic_sms)


def _scratch(model: ModelConfig, hp: int, t: float, dtype_bytes: int, kernels: tuple[str, ...],
             deterministic_sms: int | None = None) -> float:
    he = effective_kv_heads(model.num_heads, model.num_kv_heads, hp)
    tokens = round(t * hp)
    return float(largest_backward_scratch(kernels, 1, model.num_heads // hp, he // hp, tokens, tokens,
                                          max(model.head_dim, model.v_head_dim), dtype_bytes,  # MLA: padded
                                          deterministic_sms))


class KernelScratch(MemoryTerm):
    """The backward scratch of the CUDA ``kernels`` the device's choice may pick (module docstring); with
    ``deterministic``, FA2's deterministic dQ accumulators on a device of ``sm_count`` SMs."""

    name = "kernel scratch"

    def __init__(self, kernels: tuple[str, ...], deterministic: bool = False, sm_count: int = SM_COUNT) -> None:
        self.kernels, self.deterministic, self.sm_count = tuple(kernels), deterministic, sm_count

    def attention_backward(self, s: StepShape) -> float:
        sms = self.sm_count if self.deterministic else None
        return _scratch(s.model, s.hp, s.tokens, s.dtype_bytes, self.kernels, sms)


def kernel_memory(kernels: tuple[str, ...], deterministic: bool = False,
                  sm_count: int = SM_COUNT) -> tuple[MemoryTerm, ...]:
    """The term of a device whose kernels have a backward scratch the planner counts, else none."""
    return (KernelScratch(kernels, deterministic, sm_count),) if kernels else ()
