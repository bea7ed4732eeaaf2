"""Shared pieces of the LoRA tests (docs/lora.md): a tiny Hugging Face Llama directory, non-zero adapter values
set into a model whatever its sharding, its full adapter gradients, and the reference: ``peft`` on the same base,
its loss and adapter gradients under our parameter names."""

from __future__ import annotations

import copy
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

#: the tiny Hugging Face Llama of the tests (byte tokenizer: vocabulary 256)
LLAMA = dict(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, tie_word_embeddings=False)


def make_llama_dir(path: Path, seed: int = 3) -> Path:
    """A tiny ``LlamaForCausalLM`` directory (``save_pretrained``) with random weights, norms not all ones."""
    import transformers

    config = transformers.LlamaConfig(**LLAMA)
    config.architectures = ["LlamaForCausalLM"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(config)
        for param in model.parameters():
            if param.dim() == 1:
                param.data.add_(0.1 * torch.randn(param.shape))
    model.save_pretrained(path)
    return Path(path)


def adapter_value(name: str, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    """A fixed non-zero float64 value for adapter parameter ``name`` (B too, so A's gradient is not zero)."""
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return 0.2 * torch.randn(tuple(shape), generator=gen, dtype=torch.float64)


@torch.no_grad()
def set_adapters(model: nn.Module) -> list[str]:
    """Every trainable (adapter) parameter of ``model`` set to :func:`adapter_value`, whole or as its FSDP2 shard;
    returns their names."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    names = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        full = adapter_value(name, param.shape).to(param.dtype)
        if isinstance(param, DTensor):
            param.to_local().copy_(distribute_tensor(full, param.device_mesh, param.placements,
                                                     src_data_rank=None).to_local())
        else:
            param.copy_(full)
        names.append(name)
    return names


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded gradients of the trainable parameters (collective under FSDP2), by name."""
    out = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            grad = param.grad
            out[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().clone()
    return out


def our_name(peft_name: str) -> str:
    """PEFT's parameter name (``base_model.model.X.lora_A.default.weight``) as ours (``X.lora_A.weight``)."""
    return peft_name.removeprefix("base_model.model.").replace(".default.", ".")


def peft_reference(base: nn.Module, targets: list[str], r: int, alpha: float,
                   batch: dict[str, torch.Tensor]) -> tuple[float, dict[str, torch.Tensor]]:
    """``(loss, {our adapter name: gradient})`` of ``peft``'s LoRA on a copy of ``base`` (float64, unsharded), its
    adapters set to :func:`adapter_value` of our names: the mean token cross-entropy of the model's own logits."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(copy.deepcopy(base).double(), LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0,
                                                                   target_modules=targets))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad:
                param.copy_(adapter_value(our_name(name), param.shape))
    out = model(batch["input_ids"], position_ids=batch["position_ids"])
    logits = out.logits if hasattr(out, "logits") else out
    loss = F.cross_entropy(logits.flatten(0, 1).double(), batch["labels"].flatten())
    loss.backward()
    grads = {our_name(n): p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.item(), grads


def max_diff(got: dict[str, torch.Tensor], want: dict[str, Any]) -> float:
    """The largest absolute difference between two gradient dicts with the same names."""
    assert got.keys() == want.keys(), (sorted(got)[:4], sorted(want)[:4])
    return max(float((got[n].double() - torch.as_tensor(want[n]).double()).abs().max()) for n in got)
