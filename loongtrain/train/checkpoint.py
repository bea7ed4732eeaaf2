"""Checkpoints with ``torch.distributed.checkpoint`` (DCP), written atomically, loadable into any layout.

Layout on disk (``OUT_DIR/checkpoints``)::

    step_00000010/            one complete checkpoint (DCP files: model + optimizer)
        trainer_state.json    step, scheduler, data position, config (rank 0)
        rng_rank{r}.pt        torch RNG states of rank r
    latest                    text file naming the newest complete checkpoint directory

A checkpoint is written to ``step_XXXXXXXX.tmp`` and renamed only after every rank has finished
writing and rank 0 has recorded every file's size and CRC-32 (``checksums.json``); ``latest`` is then
replaced with an atomic ``os.replace``. An interrupted save therefore never becomes ``latest``.

**The complete-checkpoint rule** (:func:`check_complete`, the one rule of ``train --resume``,
``--init-from``, ``eval`` and ``export``; docs/files-and-checkpoints.md#a-checkpoint-is-its-checksums): a
checkpoint is its checksums. It is complete only when it is a directory whose name does not end in
``.tmp``, holding its trainer state and its ``checksums.json``, and (:func:`verify_checkpoint`) every
file matches the size and CRC-32 recorded there. A ``.tmp`` directory, one without checksums or one
whose checksums disagree (a save or a copy that did not finish, a flipped byte) is refused, naming the
file, wherever a checkpoint is read; ``--resume auto`` instead continues from the newest complete one,
saying so in one line (:func:`resume_candidates`). A ``latest`` that cannot be read is named.

The model and optimizer state dicts come from
``torch.distributed.checkpoint.state_dict.get_state_dict`` (keyed by parameter name), and weights
are replicated over the sp ranks, so a checkpoint saved with one (dp, hp, cp) layout loads into
another (or into a single process). All ranks must see the same filesystem.

A model with frozen parameters (``--lora``: the base) saves and loads only its trainable ones
(:func:`state_dict_options`): a LoRA checkpoint holds the adapters and their optimizer state, and the
trainer state names the base they belong to (loongtrain/train/lora_base.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from loongtrain._files import DiskFullError, Folder, Output, is_disk_full, remove_folder
from loongtrain.parallel.failures import causes
from loongtrain.parallel.runtime import is_distributed

LATEST = "latest"
STATE_FILE = "trainer_state.json"
CHECKSUM_FILE = "checksums.json"


def _run_dir(path: Path) -> bool:
    return (path / "checkpoints").is_dir() or (path / "metrics.jsonl").is_file()


#: what a checkpoint ``step_N`` (and a save in progress, ``step_N.tmp``) holds: DCP's files, the trainer state,
#: each rank's RNG state and the checksums
STEP_FOLDER = Folder(("*.distcp", ".metadata", STATE_FILE, "rng_rank*.pt", CHECKSUM_FILE))
#: what ``loongtrain train`` writes into ``OUT_DIR/checkpoints`` (all that ``--overwrite`` deletes there)
CHECKPOINTS_FOLDER = Folder((LATEST, LATEST + ".tmp"), (("step_*", STEP_FOLDER),))
#: what ``loongtrain train`` writes into ``--out-dir``, all the way down (loongtrain._files: the ownership rule)
RUN_OUTPUT = Output("train", "--out-dir", Folder(
    ("metrics.jsonl", "loss_curve.png", "eval_curve.png", "torchrun_run_id", ".torchrun_run_id.*"),
    (("checkpoints", CHECKPOINTS_FOLDER), ("tensorboard", Folder(("events.out.tfevents.*",))))), _run_dir)


class NonFiniteError(RuntimeError):
    """The run produced NaN or inf where it must not (parameters, or too many skipped steps)."""

    restartable = False  # a restart replays the same steps (parallel/failures.py)


def _rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def _barrier() -> None:
    if is_distributed():
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

    Raises :class:`NonFiniteError` (writing nothing) when any rank's parameters are not finite.
    ``keep > 0`` then deletes all but the newest ``keep`` complete checkpoints.
    """
    if not parameters_finite(model):
        raise NonFiniteError(f"step {step}: the parameters hold NaN or inf; not writing a checkpoint "
                             f"(the previous checkpoints are kept)")
    root = Path(root)
    final = root / f"step_{step:08d}"
    tmp = root / f"step_{step:08d}.tmp"
    rank = _rank()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            _replace_checkpoint(tmp)
        tmp.mkdir()
    _barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer, options=state_dict_options(model))
    with _disk_full_named(tmp):
        with warnings.catch_warnings():  # single process: DCP warns that it saves without torch.distributed
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp))
        torch.save(rng_state(), tmp / f"rng_rank{rank}.pt")
        if rank == 0:
            state = {**trainer_state, "step": step, "scheduler": scheduler.state_dict()}
            (tmp / STATE_FILE).write_text(json.dumps(state, indent=1, default=str))
    _barrier()  # every rank's files are complete
    if rank == 0:
        with _disk_full_named(tmp):
            write_checksums(tmp)
        if final.exists():
            _replace_checkpoint(final)
        os.replace(tmp, final)
        pointer = root / (LATEST + ".tmp")
        pointer.write_text(final.name + "\n")
        os.replace(pointer, root / LATEST)
        if keep > 0:
            prune_checkpoints(root, keep)
    _barrier()
    return final


def _replace_checkpoint(path: Path) -> None:
    """Delete checkpoint directory ``path`` before a save writes it again, as far as loongtrain wrote it
    (loongtrain._files); ValueError naming what it holds otherwise (a file of the user's is never deleted)."""
    if not remove_folder(STEP_FOLDER, path):
        left = ", ".join(sorted(p.name for p in path.iterdir())[:4])
        raise ValueError(f"checkpoint {str(path)!r} holds files loongtrain did not write ({left}); they are never "
                         f"deleted: move them elsewhere")


@contextlib.contextmanager
def _disk_full_named(path: Path) -> Iterator[None]:
    """A full disk while saving (also inside DCP's per-rank failures) as one DiskFullError naming ``path``
    (the ``step_N.tmp`` directory is removed by whoever sees the workers gone: commands/train.py, or the next
    run's start)."""
    try:
        yield
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        if isinstance(exc, (KeyboardInterrupt, SystemExit, DiskFullError)):
            raise
        stop = next((c for c in causes(exc) if isinstance(c, KeyboardInterrupt)), None)
        if stop is not None:  # Ctrl-C / SIGTERM inside DCP's writer: the interrupt itself (commands/errors.py)
            raise stop.with_traceback(None) from None
        full = next((c for c in causes(exc) if is_disk_full(c)), None)
        if full is None:
            raise
        raise DiskFullError(getattr(full, "filename", None) or path, full.errno) from None


def _step_of(path: Path) -> int | None:
    """The step of a complete checkpoint directory ``step_N`` (None for anything else)."""
    name = path.name
    if not path.is_dir() or not name.startswith("step_") or not name[5:].isdigit():
        return None
    return int(name[5:])


def incomplete_reason(path: Path) -> str | None:
    """Why ``path`` is not a complete checkpoint (module docstring: the rule), None when it is one."""
    path = Path(path)
    if not path.is_dir():
        return "is not a directory"
    if path.name.endswith(".tmp"):
        return "is a save that did not finish (a .tmp directory)"
    if not (path / STATE_FILE).is_file():
        return f"has no {STATE_FILE}"
    if not (path / CHECKSUM_FILE).is_file():
        return (f"has no {CHECKSUM_FILE} (a save or copy that did not finish, or files removed from it); a "
                f"checkpoint is its checksums")
    return None


def check_complete(path: Path) -> Path:
    """``path`` when it is a complete checkpoint; ValueError naming it and why not otherwise."""
    reason = incomplete_reason(path)
    if reason is not None:
        raise ValueError(f"checkpoint {str(path)!r} {reason}: only complete checkpoints are read")
    return Path(path)


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoint directories ``step_N`` under ``root`` (:func:`check_complete`), ordered by step."""
    found = [(step, p) for p in Path(root).glob("step_*") if (step := _step_of(p)) is not None
             and incomplete_reason(p) is None]
    return [p for _, p in sorted(found)]


def read_latest(root: Path) -> Path | None:
    """The checkpoint directory the ``latest`` pointer of checkpoints root ``root`` names (None without a
    pointer). The one reader of ``latest``: resume, pruning and ``loongtrain export`` all use it."""
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    try:
        name = pointer.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"checkpoint pointer {str(pointer)!r} cannot be read ({type(exc).__name__}: "
                         f"{exc}); it must name a checkpoint directory beside it") from None
    if not name or "/" in name or name in (".", "..") or "\0" in name:
        raise ValueError(f"checkpoint pointer {str(pointer)!r} holds {name[:40]!r}, not the name of a checkpoint "
                         f"directory beside it")
    return Path(root) / name


def _latest_or_none(root: Path) -> Path | None:
    """``latest``'s target, None when the pointer is missing or cannot be read (pruning, ``auto``)."""
    try:
        return read_latest(root)
    except ValueError:
        return None


def prune_checkpoints(root: Path, keep: int) -> list[Path]:
    """Delete all but the ``keep`` newest complete checkpoints (by step, not by name), never the one
    ``latest`` names; return the deleted directories."""
    root = Path(root)
    latest = _latest_or_none(root)
    protected = latest.resolve() if latest is not None else None
    done = complete_checkpoints(root)
    old = [p for p in done[: max(0, len(done) - keep)] if p.resolve() != protected]
    return [p for p in old if remove_folder(STEP_FOLDER, p)]  # a file of the user's in one keeps it


def remove_stale_tmp(root: Path) -> list[Path]:
    """Delete ``step_N.tmp`` directories left by saves that died half-way (call on one rank, before any
    save of this run); return them."""
    stale = [p for p in Path(root).glob("step_*.tmp") if p.is_dir() and not p.is_symlink()]
    return [p for p in stale if remove_folder(STEP_FOLDER, p)]


AUTO = "auto"


def newest_checkpoint(root: Path) -> Path | None:
    """The checkpoint to continue from under ``root``: ``latest``'s target when it is complete, else the
    complete checkpoint of the highest step; None when there is none."""
    candidates = resume_candidates(root)
    return candidates[0] if candidates else None


def resume_candidates(root: Path, *, complete: bool = True) -> list[Path]:
    """The checkpoints ``--resume auto`` may continue from under ``root``, best first: ``latest``'s
    target, then the others by falling step; ``complete``: only those :func:`incomplete_reason` passes
    (False: every ``step_N`` directory, for a caller that says why it passes over one)."""
    root = Path(root)
    target = _latest_or_none(root)
    found = sorted(((step, p) for p in root.glob("step_*") if (step := _step_of(p)) is not None),
                   reverse=True) if root.is_dir() else []
    ordered = [p for _, p in found]
    if target is not None and target.is_dir():
        ordered = [target, *(p for p in ordered if p.resolve() != target.resolve())]
    return [p for p in ordered if not complete or incomplete_reason(p) is None]


def find_checkpoint(path: str | Path) -> Path:
    """The checkpoint directory ``path`` names: a checkpoint itself, a checkpoints root's or a run
    directory's ``latest``, or the ``latest`` pointer file itself. ValueError when there is none."""
    path = Path(path)
    if path.name.endswith(".tmp") and path.is_dir():
        check_complete(path)
    roots = [path.parent] if path.name == LATEST and path.is_file() else [path, path / "checkpoints"]
    for root in roots:
        if (root / STATE_FILE).is_file():
            return check_complete(root)
        target = read_latest(root)
        if target is not None and target.is_dir():
            return check_complete(target)
    raise ValueError(f"{str(path)!r} is not a loongtrain checkpoint (no {STATE_FILE}), nor a checkpoints "
                     f"directory or run directory with a complete '{LATEST}' checkpoint")


def resolve_checkpoint(spec: str, out_dir: Path) -> Path | None:
    """The checkpoint directory named by ``--resume``: 'latest' (``OUT_DIR/checkpoints/latest``), 'auto'
    (the newest complete checkpoint, None when there is none: start fresh), or any path
    :func:`find_checkpoint` accepts. ValueError naming ``--resume`` when there is none."""
    if spec == AUTO:
        return newest_checkpoint(Path(out_dir) / "checkpoints")
    try:
        return find_checkpoint(Path(out_dir) / "checkpoints" if spec == LATEST else Path(spec))
    except ValueError as exc:
        raise ValueError(f"--resume={spec!r}: no complete checkpoint found ({exc})") from None


def read_trainer_state(path: Path) -> dict[str, Any]:
    """The trainer state of checkpoint ``path``; ValueError naming the file when it is unreadable."""
    file = Path(path) / STATE_FILE
    try:
        state = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"checkpoint file {str(file)!r} is corrupt or unreadable: {exc}") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int) or "scheduler" not in state:
        raise ValueError(f"checkpoint file {str(file)!r} is corrupt: no 'step' and 'scheduler' entries")
    return state


_CRC_BLOCK = 1 << 24


def _crc32(file: Path) -> int:
    value = 0
    with file.open("rb") as f:
        while block := f.read(_CRC_BLOCK):
            value = zlib.crc32(block, value)
    return value


def write_checksums(path: Path) -> None:
    """Record the size and CRC-32 of every file of the (complete, not yet renamed) checkpoint ``path``
    (rank 0, once all ranks have written: it reads the checkpoint back once, about 1 s per GB)."""
    sums = {f.name: [f.stat().st_size, _crc32(f)] for f in sorted(Path(path).iterdir())
            if f.is_file() and f.name != CHECKSUM_FILE}
    (Path(path) / CHECKSUM_FILE).write_text(json.dumps(sums, indent=1))


def check_checksums(path: Path) -> None:
    """ValueError naming the first file of checkpoint ``path`` whose size or CRC-32 differs from what
    :func:`write_checksums` recorded, or the missing ``checksums.json`` (a checkpoint is its checksums)."""
    record = Path(path) / CHECKSUM_FILE
    if not record.is_file():
        raise ValueError(f"checkpoint file {str(record)!r} is missing: a checkpoint is its checksums (a save "
                         f"or copy that did not finish)")
    try:
        sums = json.loads(record.read_text())
        entries = sorted((str(name), int(size), int(crc)) for name, (size, crc) in sums.items())
    except (OSError, UnicodeDecodeError, ValueError, TypeError, AttributeError) as exc:
        raise ValueError(f"checkpoint file {str(record)!r} is corrupt or unreadable: {exc}") from None
    recorded = {name for name, _, _ in entries}
    unlisted = sorted(f.name for f in Path(path).iterdir() if f.is_file() and f.name != CHECKSUM_FILE
                      and f.name not in recorded)
    if unlisted:
        raise ValueError(f"checkpoint file {str(Path(path) / unlisted[0])!r} is not in {str(record)!r}: the "
                         f"checksums disagree with the checkpoint's files")
    for name, size, crc in entries:
        file = Path(path) / name
        if not file.is_file():
            raise ValueError(f"checkpoint file {str(file)!r} is missing")
        if file.stat().st_size != size or _crc32(file) != crc:
            raise ValueError(f"checkpoint file {str(file)!r} is corrupt: its contents differ from those saved "
                             f"(size or CRC-32 mismatch)")


def verify_checkpoint(path: Path) -> dict[str, Any]:
    """Check that checkpoint ``path`` is readable without loading it: the trainer state parses, the DCP
    metadata loads, every file it names exists with at least the bytes it needs, rank 0's RNG file is
    there, and every file matches the size and CRC-32 recorded when it was saved. Return the trainer
    state; raise ValueError naming the first bad file."""
    path = Path(path)
    state = read_trainer_state(path)
    meta_file = path / ".metadata"
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            metadata = dcp.FileSystemReader(str(path)).read_metadata()
        needed: dict[str, int] = {}
        for info in metadata.storage_data.values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means a corrupt file
        raise ValueError(f"checkpoint file {str(meta_file)!r} is missing or corrupt: "
                         f"{type(exc).__name__}: {exc}") from None
    for name, size in sorted(needed.items()):
        file = path / name
        have = file.stat().st_size if file.is_file() else -1
        if have < size:
            what = "is missing" if have < 0 else f"has {have} bytes, the metadata needs {size}"
            raise ValueError(f"checkpoint file {str(file)!r} {what} (corrupt or truncated checkpoint)")
    if not (path / "rng_rank0.pt").is_file():
        raise ValueError(f"checkpoint file {str(path / 'rng_rank0.pt')!r} is missing")
    check_checksums(path)
    return state


def state_dict_options(model: nn.Module) -> StateDictOptions:
    """What a checkpoint of ``model`` holds: every parameter, or when some are frozen (a LoRA run's base) only
    the trainable ones (loaded non-strictly: :func:`_check_loaded` checks that only frozen ones were left)."""
    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


def _check_loaded(model: nn.Module, result: Any, path: Path) -> None:
    """ValueError naming the checkpoint when a trainable parameter of ``model`` was not in it."""
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    missing = sorted(set(getattr(result, "missing_keys", ()) or ()) & trainable)
    if missing:
        raise ValueError(f"checkpoint {str(path)!r} holds no {missing[0]} ({len(missing)} trainable parameter(s) "
                         f"missing): it was written for another model or --lora")


def parameters_finite(model: nn.Module) -> bool:
    """Collective when torch.distributed is initialised: True when every rank's parameters are finite."""
    bad = torch.zeros((), dtype=torch.float32)
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p  # FSDP2 shards: each rank checks its own
        if not bool(torch.isfinite(local.detach()).all()):
            bad.fill_(1.0)
            break
    if is_distributed():
        device = next(model.parameters()).device
        flag = bad.to(device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        bad = flag.cpu()
    return not bool(bad)


def load_model_weights(path: Path, model: nn.Module) -> None:
    """Collective when sharded: read only the model weights of checkpoint ``path`` (DCP, any saved layout)
    into ``model``'s parameters, whole or sharded; ValueError naming the checkpoint when it cannot."""
    options = state_dict_options(model)
    weights = get_model_state_dict(model, options=options)
    with warnings.catch_warnings():  # one process: DCP warns that torch.distributed is off
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load({"model": weights}, checkpoint_id=str(path))
        except (Exception, dcp.api.CheckpointException) as exc:  # DCP's is a BaseException
            last = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            raise ValueError(f"checkpoint {str(path)!r} could not be loaded (a corrupt file?): {last}") from None
    _check_loaded(model, set_model_state_dict(model, weights, options=options), path)


def load_checkpoint(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> dict[str, Any]:
    """Collective: load model, optimizer, scheduler and RNG state from ``path``; return the trainer state."""
    path = Path(path)
    state = read_trainer_state(path)
    options = state_dict_options(model)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    to_load = {"model": model_sd, "optim": optim_sd}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load(to_load, checkpoint_id=str(path))
        except (Exception, dcp.api.CheckpointException) as exc:  # DCP's is a BaseException
            raise RuntimeError(f"checkpoint {str(path)!r} could not be loaded (a corrupt file?): "
                               f"{str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__}"
                               ) from exc
    loaded = set_state_dict(model, optimizer, model_state_dict=to_load["model"], optim_state_dict=to_load["optim"],
                            options=options)
    _check_loaded(model, loaded, path)
    scheduler.load_state_dict(state["scheduler"])
    rng_file = path / f"rng_rank{_rank()}.pt"
    if not rng_file.is_file():  # resumed with more ranks than saved: reuse rank 0's stream
        rng_file = path / "rng_rank0.pt"
    set_rng_state(torch.load(rng_file, weights_only=False))
    return state
