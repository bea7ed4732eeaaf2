"""LoRA's options (``--lora r=16,alpha=32,dropout=0,targets=q_proj,k_proj,v_proj,o_proj``; docs/lora.md).

:class:`LoraConfig` is the one validated description of the adapters a run trains: rank ``r``, ``alpha``
(the update is ``alpha / r * B A x``, PEFT's scaling), ``dropout`` on the adapters' input and the
``targets``, the names of the linear modules of the decoder blocks that get an adapter. Nothing here
touches a model: :mod:`loongtrain.parallelize.lora` applies the adapters from outside, and the planner
counts them (:func:`adapter_shapes`).

Target names are Hugging Face's (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``,
``down_proj``) for every model; loongtrain's decoder also accepts its own (``wq``, ``wk``, ``wv``, ``wo``,
``w1``, ``w3``, ``w2``), and Hugging Face's names map onto them (:data:`NATIVE_NAMES`, the same mapping as
the weight conversion in :mod:`loongtrain.hf.convert`), so one ``--lora`` serves both kinds of model and the
PEFT export names the modules as Hugging Face does. ``all-linear`` targets every linear module of the
blocks (PEFT's spelling).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from loongtrain.model.config import ModelConfig, matmul_params

#: Hugging Face's projection name -> loongtrain's decoder's module name (hf/convert.py's weight mapping)
NATIVE_NAMES = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo", "gate_proj": "w1",
                "up_proj": "w3", "down_proj": "w2"}
HF_NAMES = {native: hf for hf, native in NATIVE_NAMES.items()}
#: every linear module of the decoder blocks
ALL_LINEAR = "all-linear"
#: the keys of ``--lora`` and their defaults
DEFAULTS = {"r": 16, "alpha": 32.0, "dropout": 0.0, "targets": ("q_proj", "k_proj", "v_proj", "o_proj")}


@dataclass(frozen=True)
class LoraConfig:
    """Adapters ``W x + alpha / r * B A dropout(x)`` on the ``targets`` (module docstring); ValueError naming
    the value and the rule when one is out of range."""

    r: int = DEFAULTS["r"]
    alpha: float = DEFAULTS["alpha"]
    dropout: float = DEFAULTS["dropout"]
    targets: tuple[str, ...] = DEFAULTS["targets"]

    def __post_init__(self) -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"--lora r={self.r!r} must be a positive integer (e.g. r=16)")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not (
                math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"--lora alpha={self.alpha!r} must be a positive number (e.g. alpha=32: the update "
                             f"is scaled by alpha / r)")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not (
                0.0 <= self.dropout < 1.0):
            raise ValueError(f"--lora dropout={self.dropout!r} must be in [0, 1) (0: no dropout)")
        targets = tuple(self.targets)
        if not targets or any(not isinstance(t, str) or not t.strip() for t in targets):
            raise ValueError(f"--lora targets={','.join(map(str, targets))!r} must name at least one module, e.g. "
                             f"targets=q_proj,k_proj,v_proj,o_proj (or {ALL_LINEAR})")
        if ALL_LINEAR in targets and len(targets) > 1:
            raise ValueError(f"--lora targets={','.join(targets)}: {ALL_LINEAR} already names every linear module; "
                             f"give it alone")
        object.__setattr__(self, "targets", tuple(dict.fromkeys(t.strip() for t in targets)))
        object.__setattr__(self, "alpha", float(self.alpha))
        object.__setattr__(self, "dropout", float(self.dropout))

    @property
    def scaling(self) -> float:
        """The adapters' output scale, ``alpha / r`` (PEFT's, without rsLoRA)."""
        return self.alpha / self.r

    def to_text(self) -> str:
        """The ``--lora`` text that :func:`parse_lora` reads back to this config."""
        return f"r={self.r},alpha={self.alpha:g},dropout={self.dropout:g},targets={','.join(self.targets)}"

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "targets": list(self.targets)}


def parse_lora(text: str) -> LoraConfig | None:
    """``--lora`` as a :class:`LoraConfig` (None for ``''``: no adapters): ``key=value`` pairs separated by
    commas, keys ``r``, ``alpha``, ``dropout``, ``targets`` (its value a comma-separated list: the names
    after ``targets=`` up to the next ``key=``), each optional (:data:`DEFAULTS`). ValueError naming the
    value and the fix."""
    if not isinstance(text, str):
        raise ValueError(f"--lora {text!r} must be text like r=16,alpha=32,dropout=0,targets=q_proj,v_proj")
    if not text.strip():
        return None
    values: dict[str, Any] = {}
    key = None
    for part in (p.strip() for p in text.split(",")):
        if "=" in part:
            key, _, value = (s.strip() for s in part.partition("="))
            if key not in DEFAULTS:
                raise ValueError(f"--lora {text!r}: unknown key {key!r}; valid keys: {', '.join(DEFAULTS)} (e.g. "
                                 f"r=16,alpha=32,dropout=0,targets=q_proj,k_proj,v_proj,o_proj)")
            if key in values:
                raise ValueError(f"--lora {text!r}: {key} is given twice")
            values[key] = [value] if key == "targets" else value
        elif key == "targets" and part:
            values["targets"].append(part)
        else:
            raise ValueError(f"--lora {text!r}: {part!r} is not key=value (keys: {', '.join(DEFAULTS)}; only the "
                             f"targets list continues after a comma)")
    return LoraConfig(r=_number(values, "r", int, text), alpha=_number(values, "alpha", float, text),
                      dropout=_number(values, "dropout", float, text),
                      targets=tuple(values.get("targets", DEFAULTS["targets"])))


def _number(values: dict[str, Any], key: str, kind: type, text: str) -> Any:
    if key not in values:
        return DEFAULTS[key]
    try:
        return kind(values[key])
    except ValueError:
        raise ValueError(f"--lora {text!r}: {key}={values[key]!r} is not {'an integer' if kind is int else 'a number'}"
                         ) from None


def native_target(name: str) -> str:
    """The module name of loongtrain's decoder that target ``name`` means (its own names are kept)."""
    return NATIVE_NAMES.get(name, name)


def adapter_shapes(model: ModelConfig, lora: LoraConfig) -> dict[str, tuple[int, int]]:
    """``{hf target name: (in_features, out_features)}`` of the adapted linear modules of one decoder block of
    ``model``'s shape (the planner's count: :func:`adapter_params`); targets it has no module for are left out
    (a Hugging Face model's are checked against the model itself by :mod:`loongtrain.parallelize.lora`)."""
    d, f = model.dim, model.ffn_dim
    q, kv = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    shapes = {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d), "gate_proj": (d, f),
              "up_proj": (d, f), "down_proj": (f, d)}
    if lora.targets == (ALL_LINEAR,):
        return shapes
    wanted = {HF_NAMES.get(t, t) for t in lora.targets}
    return {name: shape for name, shape in shapes.items() if name in wanted}


def adapter_params(model: ModelConfig, lora: LoraConfig | None) -> int:
    """Parameters of every adapter of ``model`` (``r * (in + out)`` per adapted module, every block); 0 without."""
    if lora is None:
        return 0
    return model.num_layers * sum(lora.r * (i + o) for i, o in adapter_shapes(model, lora).values())


def lora_flops_saved(model: ModelConfig, lora: LoraConfig | None, tokens: int) -> float:
    """Training FLOPs of ``tokens`` tokens that a LoRA step does not run beside full training's ``6 N`` per token
    (:func:`loongtrain.model.config.flops_per_token`): the frozen weights' gradients, ``2 N`` (linear layers and
    head), less the adapters' own ``6 A`` (0 without LoRA)."""
    if lora is None:
        return 0.0
    return float((2 * matmul_params(model) - 6 * adapter_params(model, lora)) * tokens)
