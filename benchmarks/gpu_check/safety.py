"""gpu_check runs only what a run may run (docs/kernels.md#safety): the kernels of a call that pass the known-bad
table (cuDNN's dense calls narrowed where its bug is reachable) and the probe's verdicts, each in the form it may
run (its varlen op, its window argument only where those passed too). The probe's verdicts for every call shape
of the check come from one probe process started by the ``kernel_probes`` section (each section's
``probe_shapes``); the sections after it read them from the probe cache."""

from __future__ import annotations

from typing import Any

import torch

from loongtrain.attn.kernel_choice import kernel_candidates
from loongtrain.attn.kernel_gate import BatchProbe, gate, safe_forms
from loongtrain.attn.kernel_probe import current_versions
from loongtrain.attn.kernels import Kernel

#: a call shape: (dtype, head dim, query heads, KV heads, block length)
Shape = tuple[torch.dtype, int, int, int, int]


def safe_kernels(device: torch.device, dtype: torch.dtype, head_dim: int, heads: int, kv_heads: int,
                 seq_len: int) -> tuple[list[Kernel], dict[str, str]]:
    """The candidates of these calls that may run here, each as it may run (a narrowed cuDNN in place of cuDNN's
    dense calls, a kernel whose varlen op failed as one dense call per piece, a window refused: cut windows), and
    the refusals and narrowings (``kind:name`` -> why). On CPU: every candidate (nothing to refuse)."""
    candidates = kernel_candidates(device, dtype, head_dim)
    if device.type != "cuda":
        return candidates, {}
    versions = current_versions()
    safe = gate(candidates, versions, BatchProbe(device, dtype, head_dim, heads, kv_heads, seq_len, versions))
    return safe_forms(safe), {**safe.refused, **{f"{k} (narrowed)": v for k, v in safe.narrowed.items()}}


def refusal_rows(refused: dict[str, str]) -> dict[str, Any]:
    """The refusals as a results entry (empty: none)."""
    return {"refused_kernels": dict(refused)} if refused else {}
