"""Checkpoints with ``torch.distributed.checkpoint`` (DCP), written atomically, loadable into any layout.

Layout on disk (``OUT_DIR/checkpoints``)::

    step_00000010/            one complete checkpoint (DCP files: model + optimizer)
        trainer_state.json    step, scheduler, data position, config (rank 0)
        rng_rank{r}.pt        torch RNG states of rank r
    latest                    text file naming the newest complete checkpoint directory

A checkpoint is written to ``step_XXXXXXXX.tmp`` and renamed only after every rank has finished
writing; ``latest`` is then replaced with an atomic ``os.replace``. An interrupted save therefore
never becomes ``latest``. The model and optimizer state dicts come from
``torch.distributed.checkpoint.state_dict.get_state_dict`` (keyed by parameter name), and weights
are replicated over the sp ranks, so a checkpoint saved with one (dp, hp, cp) layout loads into
another (or into a single process). All ranks must see the same filesystem.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

LATEST = "latest"
STATE_FILE = "trainer_state.json"


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _dist() else 0


def _barrier() -> None:
    if _dist():
        dist.barrier()


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    root: Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    trainer_state: dict[str, Any],
    keep: int = 0,
) -> Path:
    """Collective: save a complete checkpoint for ``step`` under ``root`` and point ``latest`` at it.

    ``keep > 0`` then deletes all but the newest ``keep`` complete checkpoints.
    """
    root = Path(root)
    final = root / f"step_{step:08d}"
    tmp = root / f"step_{step:08d}.tmp"
    rank = _rank()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    _barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with warnings.catch_warnings():  # single process: DCP warns that it saves without torch.distributed
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
    torch.save(rng_state(), tmp / f"rng_rank{rank}.pt")
    if rank == 0:
        state = {**trainer_state, "step": step, "scheduler": scheduler.state_dict()}
        (tmp / STATE_FILE).write_text(json.dumps(state, indent=1, default=str))
    _barrier()  # every rank's files are complete
    if rank == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer = root / (LATEST + ".tmp")
        pointer.write_text(final.name + "\n")
        os.replace(pointer, root / LATEST)
        if keep > 0:
            prune_checkpoints(root, keep)
    _barrier()
    return final


def _step_of(path: Path) -> int | None:
    """The step of a complete checkpoint directory ``step_N`` (None for anything else)."""
    name = path.name
    if not path.is_dir() or not name.startswith("step_") or not name[5:].isdigit():
        return None
    return int(name[5:])


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoint directories under ``root`` (a trainer state file present), ordered by step."""
    found = [(step, p) for p in Path(root).glob("step_*") if (step := _step_of(p)) is not None
             and (p / STATE_FILE).is_file()]
    return [p for _, p in sorted(found)]


def prune_checkpoints(root: Path, keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest complete checkpoints (by step, not by name), never the one
    ``latest`` names; return the deleted directories."""
    root = Path(root)
    pointer = root / LATEST
    protected = (root / pointer.read_text().strip()).resolve() if pointer.is_file() else None
    done = complete_checkpoints(root)
    deleted = [p for p in done[: max(0, len(done) - keep)] if p.resolve() != protected]
    for old in deleted:
        shutil.rmtree(old)
    return deleted


def remove_stale_tmp(root: Path) -> list[Path]:
    """Delete ``step_N.tmp`` directories left by saves that died half-way (call on one rank, before any
    save of this run); return them."""
    stale = [p for p in Path(root).glob("step_*.tmp") if p.is_dir()]
    for p in stale:
        shutil.rmtree(p)
    return stale


def resolve_checkpoint(spec: str, out_dir: Path) -> Path:
    """The checkpoint directory named by ``--resume``: 'latest', a checkpoints root, or a checkpoint."""
    if spec == LATEST:
        root = Path(out_dir) / "checkpoints"
    else:
        root = Path(spec)
    if (root / LATEST).is_file():
        name = (root / LATEST).read_text().strip()
        root = root / name
    if not (root / STATE_FILE).is_file():
        raise ValueError(f"--resume={spec!r}: no complete checkpoint found at {str(root)!r}")
    return root


def read_trainer_state(path: Path) -> dict[str, Any]:
    return json.loads((Path(path) / STATE_FILE).read_text())


def load_checkpoint(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> dict[str, Any]:
    """Collective: load model, optimizer, scheduler and RNG state from ``path``; return the trainer state."""
    path = Path(path)
    state = read_trainer_state(path)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    to_load = {"model": model_sd, "optim": optim_sd}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(to_load, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=to_load["model"], optim_state_dict=to_load["optim"])
    scheduler.load_state_dict(state["scheduler"])
    rng_file = path / f"rng_rank{_rank()}.pt"
    if not rng_file.is_file():  # resumed with more ranks than saved: reuse rank 0's stream
        rng_file = path / "rng_rank0.pt"
    set_rng_state(torch.load(rng_file, weights_only=False))
    return state
