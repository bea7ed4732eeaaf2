"""LoRA adapters applied to a plain model from outside (``--lora``; docs/lora.md).

:func:`apply_lora` freezes every parameter of the model and gives each target linear module of its decoder
blocks (:func:`find_targets`, by :class:`~loongtrain.model.lora.LoraConfig`'s names) two submodules,
``lora_A`` (``[r, in]``) and ``lora_B`` (``[out, r]``), and the forward of :class:`LoraProjection` (mixed
into the instance's class, as :mod:`~loongtrain.parallelize.norm_linear` does, so every block runs the same
code and compiles to one graph): ``W x + alpha / r * B A dropout(x)``, PEFT's LoRA. Only the adapters
require gradients, so the optimizer, the gradient all-reduce or FSDP2's reduce-scatter and the
checkpoints see only them (FSDP2 shards the frozen weights with the adapters in one group per block and
reduces only the gradients that exist). The base parameters keep their names; an adapter's is its
module's plus ``.lora_A.weight`` / ``.lora_B.weight``, PEFT's names without the adapter name.

Initial values (:func:`initial_adapter`): A uniform in ``+-1/sqrt(in)`` (what PEFT's default
``kaiming_uniform_(a=sqrt(5))`` draws), from a generator seeded by the run's seed and the parameter's name,
so every layout starts from the same adapters; B zeros, so the first forward is the base model's.

In a fused q/k/v projection (:func:`~loongtrain.parallelize.norm_linear.fuse_norm_linear`) the adapter's A
multiplies the same normed input through the same fused function, so the norm's output is still never kept;
with ``dropout > 0`` that input is built once for the dropout (:func:`~loongtrain.parallelize.norm_linear.
projection_input`). Under autocast an unfused projection casts its input once for the base and the adapter
(autocast would cast, and keep, it twice). :func:`merge_lora` folds the adapters into the base weights
(``W + alpha / r * B A``) and takes them out again: the plain model that export writes.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from loongtrain.hf.families import decoder_layers, is_hf_model
from loongtrain.model.lora import ALL_LINEAR, HF_NAMES, LoraConfig, native_target
from loongtrain.parallelize.norm_linear import is_fused, mix_in, projection_input, projection_linear

Tensor = torch.Tensor

#: the adapter submodules of an adapted linear module (PEFT's names)
ADAPTERS = ("lora_A", "lora_B")
#: module names of mixture-of-experts expert banks: LoRA on expert weights is refused (docs/lora.md)
EXPERT_BANKS = ("experts",)
_LORA = "_loongtrain_lora"  # (scaling, dropout) in the module's __dict__: plain values, not state


def is_adapter(name: str) -> bool:
    """Whether parameter ``name`` is a LoRA adapter's (``....lora_A.weight`` / ``....lora_B.weight``)."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] in ADAPTERS


class LoraProjection:
    """Mixed into an adapted ``nn.Linear``'s class: ``forward(x) = base(x) + scaling * B(A(dropout(x)))`` with
    the base the module's own forward (plain or fused with its norm). Backward: autograd's (the base weight is
    frozen, so only ``x``'s gradient flows through it)."""

    def forward(self, x: Tensor) -> Tensor:
        scaling, dropout = self.__dict__[_LORA]
        kind = x.device.type
        if (not is_fused(self) and x.dtype == torch.float32 and torch.amp.is_autocast_available(kind)
                and torch.is_autocast_enabled(kind)):  # one cast for both matmuls (the same bits as autocast's)
            x = x.to(torch.get_autocast_dtype(kind))
        out = super().forward(x)
        a, b = self.lora_A.weight, self.lora_B.weight
        if dropout and self.training:
            h = F.linear(F.dropout(projection_input(self, x), dropout, training=True), a)
        else:
            h = projection_linear(self, x, a)
        return out + F.linear(h, b) * scaling


def _module_names(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(full name, module)`` of every module inside the decoder blocks (the adapters' own excluded)."""
    names = {id(m): n for n, m in model.named_modules()}
    found = []
    for block in decoder_layers(model):
        prefix = names[id(block)]
        for name, module in block.named_modules():
            if name and not any(part in ADAPTERS for part in name.split(".")):
                found.append((f"{prefix}.{name}", module))
    return found


def find_targets(model: nn.Module, lora: LoraConfig) -> list[tuple[str, nn.Linear]]:
    """``(name, module)`` of every linear module of ``model``'s decoder blocks that ``lora.targets`` names (by
    the last part of its name; loongtrain's decoder also by Hugging Face's names: loongtrain/model/lora.py).
    ValueError naming the targets that match nothing and the valid names, or refusing targets inside a
    mixture-of-experts expert bank."""
    native = not is_hf_model(model)
    wanted = {native_target(t) if native else t for t in lora.targets}
    every = lora.targets == (ALL_LINEAR,)
    found, linear_names, experts, banks = [], set(), [], []
    for name, module in _module_names(model):
        parts = name.split(".")
        leaf = parts[-1]
        if any(bank in parts[:-1] for bank in EXPERT_BANKS) or leaf in EXPERT_BANKS:
            banks.append(name)
            params = [leaf] + [p.split(".")[-1] for p, _ in module.named_parameters(recurse=False)]
            if every or wanted & set(params):
                experts.append(name)
            continue
        if isinstance(module, nn.Linear):
            linear_names.add(leaf)
            if every or leaf in wanted:
                found.append((name, module))
    targets = ",".join(lora.targets)
    if experts:
        what = f"{ALL_LINEAR} reaches" if every else "it names"
        raise ValueError(f"--lora targets={targets}: {what} mixture-of-experts expert weights ({experts[0]}), which "
                         f"LoRA does not adapt; name the modules to adapt instead, from: "
                         f"{', '.join(sorted(linear_names))}")
    missing = sorted(wanted - linear_names) if not every else []
    if missing or not found:
        valid = sorted(linear_names)
        if native:  # Hugging Face's names first, loongtrain's own in brackets (both are accepted)
            valid = sorted(f"{HF_NAMES[n]} ({n})" if n in HF_NAMES else n for n in valid)
        which = ", ".join(missing) or targets
        every_one = "" if banks else f", or {ALL_LINEAR}"  # on a model with expert banks it is refused: not offered
        raise ValueError(f"--lora targets={targets}: {which} {'matches' if len(missing) < 2 else 'match'} no linear "
                         f"module of the {type(model).__name__} decoder blocks; valid module names: "
                         f"{', '.join(valid)}{every_one}")
    return found


@torch.no_grad()
def apply_lora(model: nn.Module, lora: LoraConfig, seed: int = 0) -> list[str]:
    """Freeze ``model`` and add an adapter to each of :func:`find_targets` (module docstring); returns their
    names. On the meta device the adapters stay unallocated (fill them with :func:`with_adapters`' initial
    values), elsewhere they get :func:`initial_adapter`'s from ``seed``. Idempotent."""
    if not isinstance(lora, LoraConfig):
        raise ValueError(f"lora must be a LoraConfig; got {type(lora).__name__}")
    targets = find_targets(model, lora)
    for param in model.parameters():
        param.requires_grad_(False)
    names = []
    for name, linear in targets:
        names.append(name)
        if isinstance(linear, LoraProjection):
            continue
        weight = linear.weight
        for adapter, (fan_in, fan_out) in zip(ADAPTERS, ((linear.in_features, lora.r), (lora.r, linear.out_features))):
            module = nn.Linear(fan_in, fan_out, bias=False, device="meta")  # no init: no global RNG drawn
            module.weight = nn.Parameter(torch.empty((fan_out, fan_in), device=weight.device, dtype=weight.dtype))
            if weight.device.type != "meta":
                module.weight.copy_(initial_adapter(f"{name}.{adapter}.weight", module.weight.shape, seed))
            setattr(linear, adapter, module)
        mix_in(linear, LoraProjection, **{_LORA: (lora.scaling, lora.dropout)})
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))
    return names


def initial_adapter(name: str, shape: torch.Size | tuple[int, ...], seed: int) -> Tensor:
    """The initial value (float32, CPU) of adapter parameter ``name``: A uniform in ``+-1/sqrt(in)`` from a
    generator seeded with ``seed`` and the name; B zeros (module docstring)."""
    if name.split(".")[-2] == "lora_B":
        return torch.zeros(shape, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + zlib.crc32(name.encode()))
    bound = 1.0 / shape[1] ** 0.5
    return torch.empty(shape, dtype=torch.float32).uniform_(-bound, bound, generator=gen)


def with_adapters(initial: Callable[[str, torch.Size], Tensor], seed: int) -> Callable[[str, torch.Size], Tensor]:
    """``initial`` of :func:`~loongtrain.parallelize.compose.materialize_params` for a model with adapters: the
    adapters' from :func:`initial_adapter`, every other parameter's from ``initial``."""

    def both(name: str, shape: torch.Size) -> Tensor:
        return initial_adapter(name, shape, seed) if is_adapter(name) else initial(name, shape)

    return both


def adapter_state(model: nn.Module) -> dict[str, Tensor]:
    """``{name: tensor}`` of every adapter parameter of an unsharded model (what the PEFT export writes)."""
    return {name: p.detach() for name, p in model.named_parameters() if is_adapter(name)}


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight, ``W += alpha / r * B A`` (computed in float64, rounded once to
    ``W``'s dtype), and take the adapters out: the module is a plain ``nn.Linear`` again. Unsharded models only
    (the export's)."""
    for module in list(model.modules()):
        if not isinstance(module, LoraProjection):
            continue
        scaling, _ = module.__dict__.pop(_LORA)
        delta = module.lora_B.weight.double() @ module.lora_A.weight.double() * scaling
        module.weight.copy_((module.weight.double() + delta).to(module.weight.dtype))
        for adapter in ADAPTERS:
            delattr(module, adapter)
        module.__class__ = next(c for c in type(module).__mro__[1:] if c is not LoraProjection
                                and issubclass(c, nn.Linear))
    for param in model.parameters():
        param.requires_grad_(True)
    return model
