"""What LoRA (``--lora``; docs/lora.md) changes in a step's memory and time: its memory term (:class:`LoraMemory`,
the protocol of loongtrain/model/memory.py) and the planner's step-time factors, beside the adapter module
(loongtrain/model/lora.py) whose ops they count.

Notation as in :mod:`loongtrain.plan.memory_model`; ``A`` the adapters' parameters (``r * (in + out)`` per
adapted module, :func:`loongtrain.model.lora.adapter_params`), ``A_l`` a layer's.

- **states**: the frozen base keeps only its fp32 weights, the adapters their weights, gradients and AdamW's
  m, v: ``(4 * P + 16 * A) / z`` instead of ``16 * P / z`` (:func:`state_bytes`), gradients ``4 * A / z``.
- **working_params**: FSDP2 gathers the same weights; the unsharded gradient of a block is its adapters'
  (``A_l``), the root has none.
- **activations** (:func:`lora_layer_bytes`, per token per layer, the change to ``a_b``): a frozen projection keeps
  no input for a weight gradient, so the MLP's norm output (the input of ``gate_proj`` / ``up_proj``; under
  autocast, one bf16 cast per projection) is kept only when an adapter reads it, and SwiGLU's product (the
  input of ``down_proj``) only when ``down_proj`` is adapted; every adapter keeps its ``A x`` (``r`` values in
  the compute dtype), a fused q/k/v adapter its own per-token fp32 norm scale (loongtrain/parallelize/
  norm_linear.py), and with ``dropout > 0`` each adapter, instead of its input, the dropout's mask and output
  (``2 * in * b``; a fused one under autocast ``in * (4 + b)``: its normed input is fp32).
  What attention keeps anyway (q, k, v, its output: ``o_proj``'s input) and the block input are unchanged;
  without an attention adapter, the first block's attention keeps nothing (no gradient reaches it).
- **time** (:func:`matmul_factor`): a frozen weight needs no gradient, so a matmul's backward is one matmul
  (the input's gradient) instead of two: the layers' matmuls cost ``2 + 2`` instead of ``2 + 4`` FLOPs per
  weight and token, the LM head's ``4`` instead of ``6``; the adapters' own ``6 * A_l`` per token are small and
  counted. ZeRO reduce-scatters and the gradient all-reduce carry only the adapters' gradients, and the AdamW
  step updates only ``A`` parameters.
"""

from __future__ import annotations

from loongtrain.model.config import ModelConfig
from loongtrain.model.lora import LoraConfig, adapter_params, adapter_shapes
from loongtrain.model.memory import Kept, MemoryTerm, States, StepShape

#: projections whose input is the MLP's norm output, and SwiGLU's output projection (Hugging Face's names)
MLP_INPUTS, MLP_OUTPUT = ("gate_proj", "up_proj"), "down_proj"
ATTENTION_FUSED = ("q_proj", "k_proj", "v_proj")  # fused with the attention's input norm


def state_bytes(model: ModelConfig, lora: LoraConfig, params: int) -> tuple[float, float]:
    """``(states, gradients)`` bytes before dividing by ``z`` of ``params`` frozen base parameters and ``lora``'s
    adapters: ``4 * P + 16 * A`` and ``4 * A`` (module docstring)."""
    adapters = adapter_params(model, lora)
    return 4.0 * params + 16.0 * adapters, 4.0 * adapters


def layer_adapter_params(model: ModelConfig, lora: LoraConfig | None) -> int:
    """``A_l``: one layer's adapter parameters (0 without LoRA)."""
    return adapter_params(model, lora) // model.num_layers if lora is not None else 0


def lora_layer_bytes(model: ModelConfig, lora: LoraConfig | None, dtype_bytes: int, sharded: bool,
                tiles: int) -> tuple[float, float]:
    """``(attention part, MLP part)``: the change LoRA makes to the bytes a layer keeps per token without
    checkpointing (module docstring; both 0 without LoRA). ``sharded``: bf16 through FSDP2's gathered weights
    rather than autocast; ``tiles``: the MLP's tiles (its intermediates exist per tile)."""
    if lora is None:
        return 0.0, 0.0
    b, d = dtype_bytes, model.dim
    shapes = adapter_shapes(model, lora)
    autocast = b < 4 and not sharded

    def adapter(name: str) -> float:  # A x; with dropout, instead of its input: the dropout's mask and output
        fused = name in ATTENTION_FUSED  # its own fp32 norm scale; under autocast the normed input is fp32
        if not lora.dropout:
            return lora.r * b + (4 if fused else 0)
        return lora.r * b + shapes[name][0] * ((4 + b) if fused and autocast else 2 * b) + (4 if fused else 0)

    mlp_names = (*MLP_INPUTS, MLP_OUTPUT)
    attention = sum(adapter(n) for n in shapes if n not in mlp_names)
    mlp = sum(adapter(n) for n in shapes if n in mlp_names) / tiles
    read = 0 if lora.dropout else sum(n in shapes for n in MLP_INPUTS)  # adapters keeping the MLP's norm output
    if tiles == 1:  # the norm output (per tile with tiles: not modelled there)
        mlp += (read - 2) * d * b if autocast else (0.0 if read else -d * b)
    mlp -= product_bytes(model, lora, dtype_bytes, tiles)
    return float(attention), float(mlp)


def product_bytes(model: ModelConfig, lora: LoraConfig | None, dtype_bytes: int, tiles: int) -> float:
    """Bytes per token of SwiGLU's product that a LoRA block does not keep (``down_proj`` frozen and not adapted,
    or adapted through dropout, which keeps its mask instead; of one tile with tiles). The MLP's backward still
    peaks as high: the product, when kept, is freed once its gradient exists, before SwiGLU's other gradients
    (:func:`loongtrain.plan.memory_model.layer_moments`)."""
    if lora is None or (MLP_OUTPUT in adapter_shapes(model, lora) and not lora.dropout):
        return 0.0
    return model.ffn_dim * dtype_bytes / tiles


def adapts_attention(model: ModelConfig, lora: LoraConfig) -> bool:
    """Whether an attention projection has an adapter. Without one no gradient reaches the first block's
    attention (its input, the embedding's output, is frozen), so that block keeps nothing for it."""
    return any(n not in (*MLP_INPUTS, MLP_OUTPUT) for n in adapter_shapes(model, lora))


def matmul_factor(lora: LoraConfig | None) -> float:
    """FLOPs of a weight's matmuls per token in forward + backward over the forward's ``2``: ``3`` trained,
    ``2`` frozen (no weight gradient)."""
    return 3.0 if lora is None else 2.0


class LoraMemory(MemoryTerm):
    """``--lora``'s adapters on a frozen base (module docstring)."""

    name = "lora"
    frozen_base = True

    def __init__(self, lora: LoraConfig) -> None:
        self.lora = lora

    def layer_bytes(self, s: StepShape) -> tuple[float, float]:
        return lora_layer_bytes(s.model, self.lora, s.dtype_bytes, s.sharded, s.tiles)

    def mlp_backward(self, s: StepShape) -> float:
        return product_bytes(s.model, self.lora, s.dtype_bytes, s.tiles)  # as high without the product kept

    def kept(self, s: StepShape, kept: Kept, full_layer: float, mlp_part: float) -> Kept:
        if s.recompute != "none" or adapts_attention(s.model, self.lora):
            return kept
        less = full_layer - s.tokens * mlp_part  # no gradient reaches the first block's attention: it keeps none
        return Kept(kept.activations - less, kept.layer_kept - less, kept.host)

    def states(self, s: StepShape, states: States) -> States:
        total, grads = state_bytes(s.model, self.lora, states.params)
        largest = self.lora.r * max(max(shape) for shape in adapter_shapes(s.model, self.lora).values())
        return States(states.params, total, grads, largest)

    def trained_block_params(self, s: StepShape, params: float) -> float:
        return layer_adapter_params(s.model, self.lora)


def lora_memory(lora: LoraConfig | None) -> tuple[MemoryTerm, ...]:
    """The term of a run with adapters, else none."""
    return (LoraMemory(lora),) if lora is not None else ()
