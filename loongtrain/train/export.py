"""A training checkpoint as a Hugging Face model directory (``loongtrain export CHECKPOINT --hf OUT``).

CHECKPOINT is a checkpoint directory (``OUT_DIR/checkpoints/step_N``), a checkpoints root or a run's
``--out-dir`` (their ``latest`` is taken). The model is rebuilt from what the checkpoint records
(:func:`loongtrain.train.model_setup.model_record`: the preset's ModelConfig, or the HF model's config),
its weights are read with ``torch.distributed.checkpoint`` in this one process (any training layout),
and :func:`loongtrain.hf.export_hf` writes ``config.json`` + ``model.safetensors``, which
``transformers.AutoModelForCausalLM.from_pretrained(OUT)`` loads. Native presets become
``LlamaForCausalLM`` with ``rms_norm_eps`` written explicitly. Exit codes: 0 ok, 2 bad input.

A LoRA run (``--lora``; docs/lora.md) is exported as the merged model (``W + alpha / r * B A``, the same
files) and its adapters in PEFT's format in ``OUT/adapter/`` (:mod:`loongtrain.hf.peft_format`); the base
comes back from where the run took it, checked to be unchanged (:mod:`loongtrain.train.lora_base`), and a
preset's base, which exists nowhere else, is written too, as ``OUT/base/``, so ``peft.PeftModel.from_pretrained(
AutoModelForCausalLM.from_pretrained(OUT/base), OUT/adapter)`` equals ``from_pretrained(OUT)``. The adapter
records the base's absolute path (the Hugging Face directory, or ``OUT/base``) as ``base_model_name_or_path``.

The run's tokenizer goes with the model: a Hugging Face tokenizer (``--tokenizer PATH``, or the model
directory's with ``auto``) has its files copied into OUT (``tokenizer.json`` ...), after checking that
they are still the ones the run trained with (the identity the checkpoint recorded), so ``loongtrain
eval OUT`` and ``AutoTokenizer.from_pretrained(OUT)`` read the same ids; a byte-tokenizer run writes none.

Nothing of the user's is destroyed (docs/launching.md): the checkpoint must be complete (the one rule
of :func:`~loongtrain.train.checkpoint.check_complete`) and is verified first (checksums, as ``train
--resume`` does); ``--hf`` follows the ownership rule (:mod:`loongtrain._files`: not empty, not the
current directory or a parent of it, not a file, not inside the run's checkpoints nor holding the
checkpoint or the tokenizer); an existing directory must be an earlier export (its marker) with nothing
else in it, all the way down (``adapter/`` and ``base/`` hold only the files an export writes there), and is
replaced only with ``--overwrite`` (whole: nothing of the old directory stays behind). The result is
written into a locked staging directory next to the target (a second export to
the same target exits 2 naming the first) and renamed into place, so a failed or interrupted export
leaves the target as it was and removes its staging files.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from loongtrain._files import (
    LOCK_FILE,
    Folder,
    Output,
    OutputLock,
    check_output,
    disk_space,
    follow_link,
    remove_output,
    remove_owned,
    write_bytes,
)
from loongtrain.data.prepared import tokenizer_identity
from loongtrain.data.tokenizer import build_tokenizer
from loongtrain.hf.convert import export_hf
from loongtrain.hf.peft_format import CONFIG_FILE as PEFT_CONFIG_FILE
from loongtrain.hf.peft_format import WEIGHTS_FILE as PEFT_WEIGHTS_FILE
from loongtrain.hf.peft_format import write_peft_adapter
from loongtrain.model.config import ModelConfig
from loongtrain.parallelize.lora import adapter_state, apply_lora, is_adapter, merge_lora
from loongtrain.sections.model import param_dtype
from loongtrain.train import model_setup
from loongtrain.train.checkpoint import find_checkpoint, load_model_weights, verify_checkpoint
from loongtrain.train.config import TrainSections
from loongtrain.train.lora_base import base_directory, build_base, check_base
from loongtrain.train.model_setup import model_from_record

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}


def checkpoint_model_record(state: dict[str, Any]) -> dict[str, Any]:
    """The model record of a checkpoint; for checkpoints without one, rebuilt from the run's config."""
    if "model_config" in state or "hf_config" in state:
        return state
    cfg = TrainSections.recorded(state["config"]).model
    return model_setup.model_record(model_setup.model_config_for(cfg), cfg)


def load_trained_model(checkpoint: str | Path) -> nn.Module:
    """The model of a checkpoint with its trained weights, whole, on CPU, in the dtype it trained in (a LoRA
    checkpoint's merged into its base: :func:`load_lora_model`)."""
    path = find_checkpoint(checkpoint)  # complete checkpoints only
    state = verify_checkpoint(path)  # the checks of train --resume: state, metadata, sizes, checksums
    if state.get("lora"):
        return merge_lora(load_lora_model(path, state))
    dtype = param_dtype(TrainSections.recorded(state["config"]).model.dtype)
    model = model_from_record(checkpoint_model_record(state), dtype)
    load_model_weights(path, model)
    return model


def load_lora_model(path: Path, state: dict[str, Any]) -> nn.Module:
    """A LoRA checkpoint's base (checked unchanged) with its trained adapters, unmerged, whole, on CPU."""
    check_base(state, str(path))
    model = build_base(state)
    cfg = TrainSections.recorded(state["config"])
    apply_lora(model, cfg.model.lora_config(), cfg.optim.seed)
    load_model_weights(path, model)  # the adapters only: the base is frozen (train/checkpoint.py)
    return model


#: what `loongtrain export` writes into --hf (loongtrain._files: the ownership rule)
TOKENIZER_NAMES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model", "chat_template.jinja")
ADAPTER_DIR, BASE_DIR = "adapter", "base"  # a LoRA run's adapters (PEFT's format) and a preset's base
MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "model-*.safetensors",
               "model.safetensors.index.json")
OUTPUT = Output("export", "--hf", Folder((*MODEL_FILES, *TOKENIZER_NAMES), (
    (ADAPTER_DIR, Folder((PEFT_CONFIG_FILE, PEFT_WEIGHTS_FILE))), (BASE_DIR, Folder(MODEL_FILES)))))


def check_target(out_dir: str | Path, checkpoint: Path, *, overwrite: bool = False,
                 inputs: tuple[str, ...] = ()) -> Path:
    """The export directory ``out_dir``, checked (module docstring: the ownership rule; ``inputs``: other
    paths the export reads, e.g. the tokenizer). ValueError naming the rule otherwise."""
    if not str(out_dir).strip():
        raise ValueError("--hf '' is empty: name the output directory")
    out = follow_link("--hf", out_dir)  # a link: the export lands in its target, the link stays
    target, ckpt = out.resolve(), Path(checkpoint).resolve()
    root = ckpt.parent  # the run's checkpoints directory
    if target == root or root in target.parents:
        raise ValueError(f"--hf {str(out)!r} lies inside the run's checkpoints {str(root)!r}; export elsewhere")
    if target in ckpt.parents:
        raise ValueError(f"--hf {str(out)!r} holds the checkpoint {str(ckpt)!r}; export elsewhere")
    out = check_output(OUTPUT, out, inputs=(str(checkpoint), *inputs))
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"--hf {str(out)!r} holds an earlier export; pass --overwrite to replace it (its files "
                         f"are deleted) or choose a new directory")
    for beside in _beside(out):  # an interrupted export's leftovers are replaced: the same rule for them
        if beside.exists() or beside.is_symlink():
            check_output(OUTPUT, beside)
    return out


def _beside(out: Path) -> tuple[Path, Path]:
    """The staging directory an export of ``out`` writes into, and where the previous export waits while the
    new one moves in (both beside ``out``)."""
    return out.with_name(f".{out.name}.export-tmp"), out.with_name(f".{out.name}.export-old")


def _discard(path: Path) -> None:
    """Delete an export's staging or previous directory as far as loongtrain wrote it (loongtrain._files)."""
    if path.is_dir() and not path.is_symlink():
        remove_output(OUTPUT, path)


def run_tokenizer(state: dict[str, Any]) -> Path | None:
    """The Hugging Face tokenizer (file or directory) the checkpoint's run trained with, checked to be the
    one it recorded; None for the byte tokenizer. ValueError when it is gone or its files changed."""
    spec = model_setup.tokenizer_spec(TrainSections.recorded(state["config"]).model)
    if spec == "byte":
        return None
    path = Path(spec)
    if not path.exists():
        raise ValueError(f"the run's tokenizer {spec!r} no longer exists; the export would lose it (an export "
                         f"without it reads text as bytes): restore it and export again")
    recorded = (state.get("data_identity") or {}).get("tokenizer")
    if recorded is not None:
        now = tokenizer_identity(build_tokenizer(spec))
        if now != recorded:
            raise ValueError(f"the run's tokenizer {spec!r} changed since training (identity {recorded} then, "
                             f"{now} now): restore the files the run trained with and export again")
    return path


def copy_tokenizer(source: Path, out: Path) -> list[str]:
    """Copy the tokenizer files of ``source`` (a ``tokenizer.json`` file, or a directory) into ``out``;
    ValueError unless ``out``'s copy reads as the same vocabulary and EOS. Returns the names copied."""
    if source.is_file():
        copies = [(source, "tokenizer.json")]
    else:
        copies = [(source / name, name) for name in TOKENIZER_NAMES if (source / name).is_file()]
    for file, name in copies:
        write_bytes(out / name, file.read_bytes())
    want, got = build_tokenizer(str(source)), build_tokenizer(str(out))
    if (want.vocab_size, want.eos_id) != (got.vocab_size, got.eos_id):
        raise ValueError(f"the tokenizer copied from {str(source)!r} reads differently in the export "
                         f"(vocab {got.vocab_size}, eos {got.eos_id}; the run's: {want.vocab_size}, {want.eos_id})")
    return [name for _, name in copies]


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, *, dtype: torch.dtype | None = None,
                      overwrite: bool = False) -> Path:
    """Write the checkpoint's model (and its run's tokenizer) as a Hugging Face directory ``out_dir``
    (``dtype``: the tensors' dtype, default as trained); returns ``out_dir``. An existing non-empty
    ``out_dir`` is a ValueError unless it is an earlier export and ``overwrite`` (then it is replaced
    whole); see :func:`check_target`."""
    path = find_checkpoint(checkpoint)
    state = verify_checkpoint(path)
    tokenizer = run_tokenizer(state)
    lora = state.get("lora")
    base_dir = base_directory(lora) if lora else None
    inputs = tuple(str(p) for p in (tokenizer, base_dir) if p is not None)
    out = check_target(out_dir, path, overwrite=overwrite, inputs=inputs)
    if lora:  # unmerged: its adapters are written first, then merged (_export_adapters)
        model = load_lora_model(path, state)
        adapters = {name: t.clone() for name, t in adapter_state(model).items()}
    else:
        model = load_trained_model(path)
    if dtype is not None:
        model = model.to(dtype)
    staging, old = _beside(out)
    with OutputLock(OUTPUT, staging):  # one export to this target at a time; a dead one's staging is taken over
        remove_owned(OUTPUT, staging)
        _discard(old)
        try:
            with disk_space(staging), _os_errors_named(staging / "model.safetensors"):
                if lora:  # the base (a preset's), the adapters in PEFT's format, then the merged model
                    _export_adapters(model, adapters, state, staging, out, base_dir, dtype)
                    merge_lora(model)
                export_hf(model, None, staging, max_position_embeddings=trained_positions(state))
            if tokenizer is not None:
                copy_tokenizer(tokenizer, staging)
            if out.exists():
                os.replace(out, old)  # kept until the new directory is in place
            os.replace(staging, out)
            (out / LOCK_FILE).unlink(missing_ok=True)  # it moved with the directory; still held until here
        except BaseException:
            if old.exists() and not out.exists():
                os.replace(old, out)  # the previous export back in place
            _discard(staging)
            raise
    _discard(staging)
    _discard(old)
    return out


def trained_positions(state: dict[str, Any]) -> int | None:
    """The ``max_position_embeddings`` an export of a loongtrain model states: the longest length the run
    trained at (``--seq-len``, the longest of ``--seq-len-stages``), unless its RoPE scaling sets one
    (``original_max_position_embeddings * factor``); None for a Hugging Face model (its config's own)."""
    record = state.get("model_config")
    if not record:
        return None
    scaling = ModelConfig(**record).rope_scaling
    if scaling is not None and scaling.original_max_position_embeddings:
        return None
    return int(TrainSections.recorded(state["config"]).data.seq_len)


@contextlib.contextmanager
def _os_errors_named(path: Path) -> Iterator[None]:
    """safetensors' writer reports an OS error as its own exception, "... (os error N)": as the OSError it
    is, naming ``path`` (a full disk: :class:`~loongtrain._files.DiskFullError`; read-only: exit 2)."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - only safetensors' errors with an errno are turned
        found = re.search(r"\(os error (\d+)\)", str(exc))
        if type(exc).__name__ != "SafetensorError" or found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), str(path)) from None


def _export_adapters(model: nn.Module, adapters: dict[str, torch.Tensor], state: dict[str, Any], staging: Path,
                     out: Path, base_dir: Path | None, dtype: torch.dtype | None) -> None:
    """``staging/adapter`` (PEFT's format) and, for a preset's base, ``staging/base`` (the base before the merge:
    ``model`` still holds its adapters unmerged, which export_hf leaves out)."""
    native = None
    if base_dir is None:
        native = ModelConfig(**state["model_config"])
        base = {n: p for n, p in model.state_dict().items() if not is_adapter(n)}
        export_hf(base, native, staging / BASE_DIR)
    if dtype is not None:
        adapters = {name: t.to(dtype) for name, t in adapters.items()}
    lora = TrainSections.recorded(state["config"]).model.lora_config()
    recorded = str(base_dir) if base_dir is not None else str(out.resolve() / BASE_DIR)
    write_peft_adapter(staging / ADAPTER_DIR, adapters, lora, native=native, base=recorded)
