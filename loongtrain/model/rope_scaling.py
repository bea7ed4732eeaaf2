"""RoPE scaling (docs/context-extension.md#rope-scaling): ``linear``, ``yarn`` and ``llama3`` as Hugging Face
defines them, the one implementation loongtrain's decoder uses.

A :class:`RopeScaling` holds a type and its parameters under Hugging Face's key names. It changes two
things only: the inverse frequencies (:func:`inv_freq`, float64) and a factor that multiplies ``cos`` and
``sin`` (:func:`attention_factor`; YaRN's ``sqrt(1/t)``, 1 for the others), which scales the attention
logits by its square, as HF's rotary embeddings do. With ``d`` the head dim, ``theta`` the base and
``base_i = theta ** (-2i/d)`` for ``i < d/2``:

- ``linear``: ``base_i / factor`` (position interpolation).
- ``yarn``: dims whose wavelength fits often into ``original_max_position_embeddings`` keep ``base_i``,
  those that do not are interpolated (``base_i / factor``), with a linear ramp between the dims where a
  wavelength rotates ``beta_fast`` and ``beta_slow`` times over the original length (bounds floored and
  ceiled unless ``truncate`` is false); attention factor ``0.1 ln(factor) + 1`` (1 for ``factor <= 1``),
  or ``attention_factor``, or the ratio of that formula with ``mscale`` and ``mscale_all_dim``.
- ``llama3``: wavelengths above ``original / low_freq_factor`` are interpolated, below
  ``original / high_freq_factor`` kept, and smoothly mixed in between.

``dynamic`` (dynamic NTK) and ``longrope`` are refused: their frequencies depend on the length of the
sequence being processed, which training (a sharded, fixed-length sequence) does not have.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the frequencies' code imports it: parsing a --rope-scaling needs none
    import torch

#: the scaling types loongtrain's decoder implements; "default" is plain RoPE (no scaling)
ROPE_TYPES = ("linear", "yarn", "llama3")
DEFAULT = "default"
#: HF's keys each type takes, the required ones first
ROPE_KEYS: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor",
             "mscale", "mscale_all_dim", "truncate"),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
}
REQUIRED_KEYS = {"linear": 1, "yarn": 2, "llama3": 4}  # how many of ROPE_KEYS[type] are required
#: types HF has but training cannot use, with the reason
REFUSED_TYPES = {
    "dynamic": "dynamic NTK scaling is inference-only: its frequencies depend on the current sequence length, "
               "which a training step (a fixed-length, sharded sequence) does not have; train with yarn or "
               "linear, or raise --rope-theta",
    "longrope": "longrope switches its factors by the current sequence length (inference-time behaviour) and has "
                "no loongtrain equivalent; train with yarn or linear, or raise --rope-theta",
}
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0  # HF's defaults


@dataclass(frozen=True)
class RopeScaling:
    """A RoPE scaling type and its parameters (HF's key names; None: not given). Validated when built:
    ValueError naming the key and value for a key the type does not take, a missing required key, or a
    value out of range."""

    rope_type: str
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool | None = None

    def __post_init__(self) -> None:
        check_rope_type(self.rope_type)
        given = self.parameters()
        takes = ROPE_KEYS[self.rope_type]
        for key in given:
            if key not in takes:
                raise ValueError(f"rope type {self.rope_type!r} does not take {key}={given[key]!r}; it takes "
                                 f"{list(takes)}")
        for key in takes[:REQUIRED_KEYS[self.rope_type]]:
            if key not in given:
                raise ValueError(f"rope type {self.rope_type!r} needs {key}" + (
                    " (the context length the model was trained at)" if key.startswith("original") else ""))
        for key, value in given.items():
            _check_value(key, value)
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(f"llama3: high_freq_factor={self.high_freq_factor} must exceed "
                             f"low_freq_factor={self.low_freq_factor}")
        fast, slow = self.beta_fast or YARN_BETA_FAST, self.beta_slow or YARN_BETA_SLOW
        if self.rope_type == "yarn" and not fast > slow:
            raise ValueError(f"yarn: beta_fast={fast} must exceed beta_slow={slow}")

    def parameters(self) -> dict[str, Any]:
        """The keys that are set, HF's names (``rope_type`` excluded)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "rope_type" and getattr(self, f.name) is not None}

    def hf_parameters(self) -> dict[str, Any]:
        """The ``rope_parameters`` entries of an HF config for this scaling (``rope_theta`` excluded)."""
        return {"rope_type": self.rope_type, **self.parameters()}

    def spec(self) -> str:
        """The ``--rope-scaling`` text of this scaling (``TYPE:key=value,...``)."""
        return self.rope_type + ":" + ",".join(f"{k}={_text(v)}" for k, v in self.parameters().items())


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else f"{value:g}" if isinstance(value, float) else str(value)


def check_rope_type(rope_type: str) -> None:
    """ValueError unless ``rope_type`` is one of :data:`ROPE_TYPES` (a refused HF type gives its reason)."""
    if rope_type in REFUSED_TYPES:
        raise ValueError(f"rope type {rope_type!r}: {REFUSED_TYPES[rope_type]}")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unknown rope type {rope_type!r}; valid: {[DEFAULT, *ROPE_TYPES]}")


def _check_value(key: str, value: Any) -> None:
    if key == "truncate":
        if not isinstance(value, bool):
            raise ValueError(f"truncate={value!r} must be true or false")
        return
    if key == "original_max_position_embeddings":
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"original_max_position_embeddings={value!r} must be a positive integer")
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{key}={value!r} must be a finite number")
    if key in ("mscale", "mscale_all_dim"):
        return
    if not value > 0:
        raise ValueError(f"{key}={value!r} must be positive")


def rope_scaling_from_mapping(values: Mapping[str, Any]) -> RopeScaling | None:
    """The scaling of an HF ``rope_parameters`` (or older ``rope_scaling``) dict: its ``rope_type`` (or
    ``type``) and HF's keys; ``rope_theta`` is ignored (the caller reads it) and ``partial_rotary_factor``
    must be absent or 1. None for ``default``. ValueError naming the key or type otherwise."""
    values = dict(values)
    rope_type = values.pop("rope_type", None) or values.pop("type", None) or DEFAULT
    values.pop("type", None)
    values.pop("rope_theta", None)
    partial = values.pop("partial_rotary_factor", 1.0)
    if partial not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor={partial!r} has no loongtrain equivalent (needs 1.0)")
    if rope_type == DEFAULT:
        if values:
            raise ValueError(f"rope type 'default' takes no parameters; got {sorted(values)}")
        return None
    check_rope_type(rope_type)
    fields = {f.name for f in dataclasses.fields(RopeScaling)} - {"rope_type"}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ValueError(f"rope type {rope_type!r} does not take {unknown[0]}={values[unknown[0]]!r}; it takes "
                         f"{list(ROPE_KEYS[rope_type])}")
    values = {k: v for k, v in values.items() if v is not None}
    for key in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "attention_factor"):
        if isinstance(values.get(key), int) and not isinstance(values[key], bool):
            values[key] = float(values[key])
    if isinstance(values.get("original_max_position_embeddings"), float) and \
            float(values["original_max_position_embeddings"]).is_integer():
        values["original_max_position_embeddings"] = int(values["original_max_position_embeddings"])
    return RopeScaling(rope_type, **values)


def parse_rope_scaling(text: str) -> RopeScaling | None:
    """``--rope-scaling``: ``TYPE`` or ``TYPE:key=value,...`` with HF's key names, e.g.
    ``yarn:factor=4,original_max_position_embeddings=8192``; ``default``: plain
    RoPE (None). ValueError naming the part that is wrong."""
    rope_type, _, rest = text.strip().partition(":")
    rope_type = rope_type.strip()
    if rope_type != DEFAULT:
        check_rope_type(rope_type)
    values: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = (s.strip() for s in part.partition("="))
        if not eq or not key or not value:
            raise ValueError(f"{part!r} is not key=value")
        if key in values:
            raise ValueError(f"{key} is given twice")
        values[key] = _parse_value(key, value)
    return rope_scaling_from_mapping({"rope_type": rope_type, **values})


def _parse_value(key: str, value: str) -> Any:
    if key == "truncate":
        if value.lower() not in ("true", "false"):
            raise ValueError(f"truncate={value!r} must be true or false")
        return value.lower() == "true"
    if key == "original_max_position_embeddings":
        if not value.isdigit():
            raise ValueError(f"{key}={value!r} must be a positive integer (tokens, e.g. 8192)")
        return int(value)
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{key}={value!r} is not a number") from None


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def attention_factor(scaling: RopeScaling | None) -> float:
    """The factor that multiplies ``cos`` and ``sin`` (so the attention logits by its square): YaRN's, else 1."""
    if scaling is None or scaling.rope_type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return float(scaling.attention_factor)
    factor = float(scaling.factor)
    if scaling.mscale and scaling.mscale_all_dim:
        return _yarn_mscale(factor, scaling.mscale) / _yarn_mscale(factor, scaling.mscale_all_dim)
    return _yarn_mscale(factor)


def inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None,
             device: torch.device | str | None = None) -> torch.Tensor:
    """The ``head_dim / 2`` inverse frequencies (float64) of RoPE with base ``theta`` and ``scaling``."""
    import torch

    half = head_dim // 2
    exponents = torch.arange(half, dtype=torch.float64, device=device) * 2.0 / head_dim
    base = theta ** (-exponents)
    if scaling is None:
        return base
    factor = float(scaling.factor)
    if scaling.rope_type == "linear":
        return base / factor
    if scaling.rope_type == "yarn":
        return _yarn(base, head_dim, theta, factor, scaling)
    return _llama3(base, factor, scaling)


def _yarn(base: torch.Tensor, head_dim: int, theta: float, factor: float, s: RopeScaling) -> torch.Tensor:
    """YaRN's mix of kept (``base``) and interpolated (``base / factor``) frequencies by a linear ramp."""
    import torch

    original = s.original_max_position_embeddings

    def dim_of(rotations: float) -> float:  # the (fractional) dim whose wavelength turns this often
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(s.beta_fast or YARN_BETA_FAST), dim_of(s.beta_slow or YARN_BETA_SLOW)
    if s.truncate is not False:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = ((torch.arange(base.numel(), dtype=torch.float64, device=base.device) - low) / (high - low)).clamp(0, 1)
    return (base / factor) * ramp + base * (1 - ramp)


def _llama3(base: torch.Tensor, factor: float, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1's: long wavelengths interpolated, short ones kept, a smooth mix in between."""
    import torch

    original, low, high = s.original_max_position_embeddings, s.low_freq_factor, s.high_freq_factor
    wavelength = 2 * math.pi / base
    smooth = (original / wavelength - low) / (high - low)
    mixed = (1 - smooth) * base / factor + smooth * base
    out = torch.where(wavelength > original / low, base / factor, base)
    medium = (wavelength >= original / high) & (wavelength <= original / low)
    return torch.where(medium, mixed, out)


@dataclass(frozen=True)
class RopeChange:
    """A change of a model's RoPE (``--rope-theta``, ``--rope-scaling``): ``theta`` None keeps the base;
    ``replace_scaling`` False keeps the scaling, True puts ``scaling`` in its place (None: plain RoPE)."""

    theta: float | None = None
    replace_scaling: bool = False
    scaling: RopeScaling | None = None

    def __bool__(self) -> bool:
        return self.theta is not None or self.replace_scaling

    def apply(self, theta: float, scaling: RopeScaling | None) -> tuple[float, RopeScaling | None]:
        """``(theta, scaling)`` after the change."""
        return (theta if self.theta is None else self.theta), (self.scaling if self.replace_scaling else scaling)


def rope_change(theta: float, scaling_spec: str) -> RopeChange:
    """The :class:`RopeChange` of ``--rope-theta`` (0: keep) and ``--rope-scaling`` ("": keep; see
    :func:`parse_rope_scaling`); ValueError naming the option and its value."""
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta < 0:
        raise ValueError(f"--rope-theta={theta!r} must be a positive number (0: the model's own)")
    if not scaling_spec.strip():
        return RopeChange(theta=float(theta) or None)
    try:
        scaling = parse_rope_scaling(scaling_spec)
    except ValueError as exc:
        raise ValueError(f"--rope-scaling {scaling_spec!r}: {exc}") from None
    return RopeChange(theta=float(theta) or None, replace_scaling=True, scaling=scaling)
