"""Reward functions of the online GRPO loop (``--reward``, ``--reward-weights``; docs/rl.md#rewards).

``--reward FILE.py:FUNC`` loads ``FUNC`` from a Python file, ``--reward module:func`` from an importable
module; the option repeats. Each is called with TRL's signature,
``f(prompts=[...], completions=[...], completion_ids=[...], **columns) -> list[float]``: one prompt per
completion (repeated for a group), the completions as text (conversational prompts: a list with one
assistant message), and every other column of the prompt rows, aligned the same way. The step's reward is
the weighted sum over the functions (TRL's ``sum_then_normalize``). A function that cannot be loaded stops
the run before any worker; one that raises, returns another count than one per completion, or a value that
is not a finite number stops it at that step, with one line naming the function (and the completion).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class RewardFunction:
    """A loaded reward function, its ``--reward`` spec and weight."""

    spec: str
    fn: Callable[..., Any]
    weight: float = 1.0

    @property
    def name(self) -> str:
        return getattr(self.fn, "__name__", self.spec.rpartition(":")[2])


def load_reward(spec: str) -> Callable[..., Any]:
    """The callable ``spec`` names (module docstring); ValueError naming it when it cannot be loaded."""
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise ValueError(f"--reward {spec!r}: write FILE.py:FUNC or module:func")
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise ValueError(f"--reward {spec!r}: no such file {where!r}")
        name = f"loongtrain_reward_{abs(hash(str(path.resolve())))}"
        module_spec = importlib.util.spec_from_file_location(name, path)
        assert module_spec is not None and module_spec.loader is not None
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        try:
            module_spec.loader.exec_module(module)
        except Exception as exc:  # the user's file: any error, in one line
            raise ValueError(f"--reward {spec!r}: loading {where} raised {type(exc).__name__}: {exc}") from None
    else:
        try:
            module = importlib.import_module(where)
        except Exception as exc:
            raise ValueError(f"--reward {spec!r}: cannot import module {where!r} ({type(exc).__name__}: "
                             f"{exc})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))[:12]
        raise ValueError(f"--reward {spec!r}: {where} has no function {attr!r} (it has {found})")
    return fn


def load_rewards(specs: Sequence[str], weights: Sequence[float] = ()) -> list[RewardFunction]:
    """Every ``--reward``, with its ``--reward-weights`` entry (1 each when none are given)."""
    weights = list(weights) or [1.0] * len(specs)
    assert len(weights) == len(specs), "the options' check matches the counts"
    return [RewardFunction(spec, load_reward(spec), float(w)) for spec, w in zip(specs, weights)]


def score(functions: Sequence[RewardFunction], prompts: list[Any], completions: list[Any],
          completion_ids: list[list[int]], columns: dict[str, list[Any]]) -> tuple[np.ndarray, dict[str, float]]:
    """``(rewards [n], {"rewards/NAME/mean": ...})``: the weighted sum of the functions' values for each
    completion, and each function's mean (TRL's metric keys); ValueError naming the function otherwise."""
    total = np.zeros(len(completions), dtype=np.float64)
    means: dict[str, float] = {}
    for f in functions:
        try:
            values = f.fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
        except Exception as exc:  # the user's function: any error, in one line
            raise ValueError(f"--reward {f.spec}: raised {type(exc).__name__}: {exc}") from None
        try:
            values = list(values)
        except TypeError:
            raise ValueError(f"--reward {f.spec}: returned {type(values).__name__}, not a list of floats") from None
        if len(values) != len(completions):
            raise ValueError(f"--reward {f.spec}: returned {len(values)} rewards for {len(completions)} completions "
                             f"(one per completion)")
        for i, v in enumerate(values):
            if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)) or not math.isfinite(v):
                raise ValueError(f"--reward {f.spec}: completion {i} got {v!r}, not a finite number (prompt "
                                 f"{str(prompts[i])[:60]!r})")
        array = np.asarray(values, dtype=np.float64)
        total += f.weight * array
        means[f"rewards/{f.name}/mean"] = float(array.mean())
    return total, means
