"""Host work done once per step, not once per layer (docs/kernels.md#host-work): every layer of a step passes
the same document boundaries (the same tensor or list objects), so what is derived from them (the normalised
boundaries and their index tensor, the attention mask, each ring step's pieces and kernel-call plan) is derived
at the first layer and looked up at the others.

:class:`LastCall` remembers the last result of one function by a key of its arguments (:func:`argument_key`:
tensors by identity and version, nested sequences of ints by value), holding the arguments so that no identity
is reused while remembered. One entry: a new document mix replaces it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

import torch

T = TypeVar("T")


def argument_key(value: Any) -> Hashable:
    """Equal for the same argument passed again unchanged: a tensor by identity and version (an in-place
    change is a new version), a list or tuple element-wise (of tensors: each by identity; of ints or rows of
    ints: by value), anything else as it is."""
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value), value._version)
    if isinstance(value, (list, tuple)):
        if value and isinstance(value[0], torch.Tensor):
            return ("tensors", tuple((id(v), v._version) for v in value))
        if value and isinstance(value[0], (list, tuple)):
            return ("rows", tuple(map(tuple, value)))
        return ("ints", tuple(value))
    return value


class LastCall(Generic[T]):
    """``memo(compute, *args)``: ``compute(*args)``, or its result of the previous call when every argument has
    the same :func:`argument_key` (module docstring)."""

    def __init__(self) -> None:
        self._key: Hashable = None
        self._held: tuple = ()
        self._value: T | None = None
        self.misses = 0

    def __call__(self, compute: Callable[..., T], *args: Any) -> T:
        key = tuple(argument_key(a) for a in args)
        if self._held and key == self._key:
            return self._value  # type: ignore[return-value]
        value = compute(*args)
        self._key, self._held, self._value = key, (args,), value
        self.misses += 1
        return value
