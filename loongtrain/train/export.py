"""A training checkpoint as a Hugging Face model directory (``loongtrain export CHECKPOINT --hf OUT``).

CHECKPOINT is a checkpoint directory (``OUT_DIR/checkpoints/step_N``), a checkpoints root or a run's
``--out-dir`` (their ``latest`` is taken). The model is rebuilt from what the checkpoint records
(:func:`loongtrain.train.model_setup.model_record`: the preset's ModelConfig, or the HF model's config),
its weights are read with ``torch.distributed.checkpoint`` in this one process (any training layout),
and :func:`loongtrain.hf.export_hf` writes ``config.json`` + ``model.safetensors``, which
``transformers.AutoModelForCausalLM.from_pretrained(OUT)`` loads. Native presets become
``LlamaForCausalLM`` with ``rms_norm_eps`` written explicitly. Exit codes: 0 ok, 2 bad input.

The run's tokenizer goes with the model: a Hugging Face tokenizer (``--tokenizer PATH``, or the model
directory's with ``auto``) has its files copied into OUT (``tokenizer.json`` ...), after checking that
they are still the ones the run trained with (the identity the checkpoint recorded), so ``loongtrain
eval OUT`` and ``AutoTokenizer.from_pretrained(OUT)`` read the same ids; a byte-tokenizer run writes none.

Nothing of the user's is destroyed (docs/launching.md): the checkpoint must be complete (the one rule
of :func:`~loongtrain.train.checkpoint.check_complete`) and is verified first (checksums, as ``train
--resume`` does); ``--hf`` follows the ownership rule (:mod:`loongtrain._files`: not empty, not the
current directory or a parent of it, not a file, not inside the run's checkpoints nor holding the
checkpoint or the tokenizer); an existing directory must be an earlier export (its marker) with nothing
else in it, and is replaced only with ``--overwrite`` (whole: nothing of the old directory stays
behind). The result is written into a locked staging directory next to the target (a second export to
the same target exits 2 naming the first) and renamed into place, so a failed or interrupted export
leaves the target as it was and removes its staging files.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from loongtrain._files import (
    LOCK_FILE,
    Output,
    OutputLock,
    check_output,
    disk_space,
    remove_owned,
    write_bytes,
)
from loongtrain.data.prepared import tokenizer_identity
from loongtrain.data.tokenizer import build_tokenizer
from loongtrain.hf.convert import export_hf
from loongtrain.train import model_setup
from loongtrain.train.checkpoint import find_checkpoint, load_model_weights, verify_checkpoint
from loongtrain.train.config import TrainConfig, param_dtype
from loongtrain.train.model_setup import model_from_record

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}


def checkpoint_model_record(state: dict[str, Any]) -> dict[str, Any]:
    """The model record of a checkpoint; for checkpoints without one, rebuilt from the run's config."""
    if "model_config" in state or "hf_config" in state:
        return state
    cfg = TrainConfig.from_dict(state["config"])
    return model_setup.model_record(model_setup.model_config_for(cfg), cfg)


def load_trained_model(checkpoint: str | Path) -> nn.Module:
    """The model of a checkpoint with its trained weights, whole, on CPU, in the dtype it trained in."""
    path = find_checkpoint(checkpoint)  # complete checkpoints only
    state = verify_checkpoint(path)  # the checks of train --resume: state, metadata, sizes, checksums
    dtype = param_dtype(TrainConfig.from_dict(state["config"]))
    model = model_from_record(checkpoint_model_record(state), dtype)
    load_model_weights(path, model)
    return model


#: what `loongtrain export` writes into --hf (loongtrain._files: the ownership rule)
TOKENIZER_NAMES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model",
                   "sentencepiece.bpe.model")
OUTPUT = Output("export", "--hf", ("config.json", "generation_config.json", "model.safetensors",
                                   "model-*.safetensors", "model.safetensors.index.json", *TOKENIZER_NAMES))


def check_target(out_dir: str | Path, checkpoint: Path, *, overwrite: bool = False,
                 inputs: tuple[str, ...] = ()) -> Path:
    """The export directory ``out_dir``, checked (module docstring: the ownership rule; ``inputs``: other
    paths the export reads, e.g. the tokenizer). ValueError naming the rule otherwise."""
    if not str(out_dir).strip():
        raise ValueError("--hf '' is empty: name the output directory")
    out = Path(out_dir)
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
    return out


def run_tokenizer(state: dict[str, Any]) -> Path | None:
    """The Hugging Face tokenizer (file or directory) the checkpoint's run trained with, checked to be the
    one it recorded; None for the byte tokenizer. ValueError when it is gone or its files changed."""
    cfg = TrainConfig.from_dict(state["config"])
    spec = model_setup.tokenizer_spec(cfg)
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
    out = check_target(out_dir, path, overwrite=overwrite, inputs=(str(tokenizer),) if tokenizer else ())
    model = load_trained_model(path)
    if dtype is not None:
        model = model.to(dtype)
    staging, old = out.with_name(f".{out.name}.export-tmp"), out.with_name(f".{out.name}.export-old")
    with OutputLock(OUTPUT, staging):  # one export to this target at a time; a dead one's staging is taken over
        remove_owned(OUTPUT, staging)
        shutil.rmtree(old, ignore_errors=True)
        try:
            with disk_space(staging):
                export_hf(model, None, staging)
            if tokenizer is not None:
                copy_tokenizer(tokenizer, staging)
            if out.exists():
                os.replace(out, old)  # kept until the new directory is in place
            os.replace(staging, out)
            (out / LOCK_FILE).unlink(missing_ok=True)  # it moved with the directory; still held until here
        except BaseException:
            if old.exists() and not out.exists():
                os.replace(old, out)  # the previous export back in place
            shutil.rmtree(staging, ignore_errors=True)
            raise
    shutil.rmtree(staging, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)
    return out
