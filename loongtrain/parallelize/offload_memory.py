"""The offload modes' memory terms (docs/planner.md#offload-and-tiling-modes; the protocol:
loongtrain/model/memory.py), beside the offloaders they describe (loongtrain/parallelize/offload.py, FSDP2's
``CPUOffloadPolicy`` in loongtrain/parallelize/zero.py).

- :class:`ActivationOffload` (``--offload-activations``): each block's kept set ``K`` is copied to the host when its
  forward ends and brought back one block ahead of its backward, except the last ``k = offload_keep`` blocks': at
  the loss the device holds ``min(L, k + 2) * K`` (the kept blocks and two copies in flight), in a block's backward
  ``max(1, k) * K`` (the previous block comes back after its peaks), the host ``(L - k) * K``. With a frozen base
  the first block's input needs no gradient (a frozen embedding): it stays on the device.
- :class:`ParamOffload` (``--offload-params``): the fp32 shards, their gradients and AdamW's m, v live on the
  host, where the AdamW step runs (torch's single-tensor step holds :data:`ADAMW_STEP_TEMPORARIES` fp32
  temporaries of one parameter shard at a time); the host's peak is the larger of the forward's end (the states
  without gradients, and the offloaded activations) and the AdamW step (the states and its temporaries).
"""

from __future__ import annotations

from loongtrain.model.memory import Kept, MemoryTerm, StepShape

#: fp32 temporaries of one parameter that torch's single-tensor AdamW step (``foreach=False``) holds at once
#: (measured: the host's peak of the AdamW step under ``--offload-params`` in the simulation)
ADAMW_STEP_TEMPORARIES = 3


class ActivationOffload(MemoryTerm):
    """``--offload-activations`` with ``--offload-keep keep`` (module docstring)."""

    name = "activation offload"

    def __init__(self, keep: int) -> None:
        self.keep = keep

    def kept(self, s: StepShape, kept: Kept, full_layer: float, mlp_part: float) -> Kept:
        layers, acts = s.model.num_layers, kept.activations
        keep = min(self.keep, layers - 1)  # the last blocks, not offloaded
        host = acts / layers * (layers - keep)
        layer_kept = acts / layers * max(1, keep)  # the last block's backward: the kept blocks (the previous
        # offloaded block is fetched after the peaks: parallelize/offload.py)
        acts = acts / layers * min(layers, keep + 2)  # at the loss: the kept blocks and two copies in flight
        if s.frozen_base:  # the first block's input needs no gradient (a frozen embedding): it stays on the device
            block_input = s.tokens * s.model.dim * s.residual_bytes
            host, acts, layer_kept = host - block_input, acts + block_input, layer_kept + block_input
        return Kept(acts, layer_kept, kept.host + host)


class ParamOffload(MemoryTerm):
    """``--offload-params`` (module docstring)."""

    name = "parameter offload"

    def place_states(self, s: StepShape, parts: dict[str, float], grads: float, largest: float,
                     host: float) -> tuple[float, float]:
        host = max(host + parts["states"] - grads,
                   parts["states"] + ADAMW_STEP_TEMPORARIES * 4 * largest / s.zero_size)
        parts["states"] = 0.0
        return 0.0, host
