"""The memory-term protocol (docs/design.md#how-to-add-a-memory-term): what one feature adds to, or changes in,
the memory of one rank's training step.

A feature that changes what a step holds (mixture-of-experts, LoRA, the attention kernels' backward scratch, the
tiled MLP, activation and parameter offload, DPO's reference pass, ...) describes it next to its own code as a
:class:`MemoryTerm`: a few methods, each for one quantity of the planner's model of a step
(:mod:`loongtrain.plan.memory_model`), each "nothing changes" unless the term overrides it. The planner, the
trainer's start-up report and the simulation's comparison sum the same terms
(:func:`loongtrain.plan.memory_terms.run_terms` lists them in order). Every byte count is derived from the ops
the feature runs (the tensors they keep, their dtypes), never fitted; a test holds each against real tensors.

This module sits on the lowest floor with the model's shape (:class:`~loongtrain.model.config.ModelConfig`), so
that a term can live beside its feature on any floor, and the planner imports none of those floors' code
through it.
"""

from __future__ import annotations

from dataclasses import dataclass

from loongtrain.model.config import ModelConfig


@dataclass(frozen=True)
class StepShape:
    """One rank's step as the memory terms see it: the model, ``tokens`` on the rank (``t = B * S / sp``), the
    compute dtype's bytes ``b`` (``dtype_bytes``), whether FSDP2 gathers the weights (``sharded``: bf16 through
    its gathered weights rather than autocast), the layout's ``hp`` and ``cp``, the ZeRO shard group
    ``zero_size``, the MLP's sequence ``tiles`` (1: untiled), the ``recompute`` mode, whether FSDP2 frees a
    block's gathered weights after its forward (``reshard_after_forward``), whether the base is frozen
    (``frozen_base``: only adapters train, so nothing needs the embedding's output gradient), whether the states
    live on the host (``offload_params``: FSDP2's ``CPUOffloadPolicy``) and the sequences per step (``batch``: what
    is kept per sequence, not per token, e.g. linear attention's state pairs)."""

    model: ModelConfig
    tokens: float
    dtype_bytes: int
    sharded: bool
    hp: int = 1
    cp: int = 1
    zero_size: int = 1
    tiles: int = 1
    recompute: str = "none"
    reshard_after_forward: bool = True
    frozen_base: bool = False
    offload_params: bool = False
    batch: int = 1

    @property
    def residual_bytes(self) -> int:
        """``r``, bytes per element of the residual stream: fp32 under autocast (``z = 1``, ``b < 4``), else ``b``."""
        return 4 if self.dtype_bytes < 4 and not self.sharded else self.dtype_bytes


@dataclass
class Kept:
    """What the step keeps between forward and backward, as the memory modes place it: ``activations`` on the
    device at the loss, ``layer_kept`` on the device in a block's backward, ``host`` on the host."""

    activations: float
    layer_kept: float
    host: float = 0.0


@dataclass
class States:
    """The optimizer-step state of the whole model of ``params`` parameters, before the ZeRO group divides it:
    ``states`` (weights, gradients, AdamW's moments), the fp32 ``grads`` within them, and the largest parameter's
    elements (``largest_param``: what a host AdamW step holds temporaries of)."""

    params: int
    states: float
    grads: float
    largest_param: float


class MemoryTerm:
    """One feature's part of a step's memory (module docstring). Every method returns "no change"; a term
    overrides what its feature changes. ``frozen_base``: the feature freezes the base weights (LoRA)."""

    name = "term"
    frozen_base = False

    def tiles(self, s: StepShape) -> int:
        """The MLP's sequence tiles (1: the MLP is not tiled; the tiled MLP's rule)."""
        return 1

    def mlp_intermediates(self, s: StepShape) -> float:
        """Bytes per token per layer (averaged over the layers) the MLP keeps beyond a dense SwiGLU's ``4 f b`` of
        one tile, e.g. an expert layer's instead of it."""
        return 0.0

    def dense_layers(self, s: StepShape) -> int:
        """Layers with a dense SwiGLU MLP (the rest are the term's, e.g. expert layers)."""
        return s.model.num_layers

    def layer_bytes(self, s: StepShape) -> tuple[float, float]:
        """``(attention part, MLP part)``: bytes per token per layer the term adds to (or takes from) a block's
        kept set without checkpointing."""
        return 0.0, 0.0

    def mlp_backward(self, s: StepShape) -> float:
        """Bytes per token the MLP's backward holds beyond a dense SwiGLU's gradients."""
        return 0.0

    def attention_backward(self, s: StepShape) -> float:
        """Bytes the attention op's backward holds beyond its results and the ring's workspace (a kernel's own
        scratch)."""
        return 0.0

    def kept(self, s: StepShape, kept: Kept, full_layer: float, mlp_part: float) -> Kept:
        """Where the blocks' kept sets are (``full_layer``: one block's set without checkpointing, ``mlp_part``: its
        MLP's bytes per token); the terms' placements compose in order."""
        return kept

    def states(self, s: StepShape, states: States) -> States:
        """The optimizer-step state (weights, gradients, moments)."""
        return states

    def place_states(self, s: StepShape, parts: dict[str, float], grads: float, largest: float,
                     host: float) -> tuple[float, float]:
        """Where the rank's states live: ``parts["states"]`` (device), its fp32 gradients ``grads`` and the largest
        parameter's elements ``largest`` (both per rank), the ``host`` bytes so far; returns ``(the gradient bytes
        on the device, host bytes)`` and may move ``parts["states"]`` to the host."""
        return grads, host

    def trained_block_params(self, s: StepShape, params: float) -> float:
        """Elements of the largest gradient FSDP2 holds unsharded at once (a block's or the root's)."""
        return params

    def phases(self, s: StepShape, parts: dict[str, float], mlp_intermediates: float) -> dict[str, float]:
        """Device peaks of phases outside the step (DPO's reference pass before the first step), by name; the
        step's peak ``total`` is the largest of them and its own. ``parts``: the step's parts, ``mlp_intermediates``:
        a block's MLP intermediates per token (of one tile)."""
        return {}

    def phase_host(self, s: StepShape) -> float:
        """Host bytes the term's phases keep through the run (the reference's offloaded shards)."""
        return 0.0
