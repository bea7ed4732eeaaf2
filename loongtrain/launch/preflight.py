"""Checks of a run's files, made by the launcher before any worker starts (docs/design.md §10).

:func:`preflight` raises ValueError naming the offending value and the rule, so ``loongtrain train``
exits 2 within seconds instead of failing inside the workers. It checks:

- the output directory: not a file, writable; a directory that already holds checkpoints needs
  ``--resume`` (continue) or ``--overwrite`` (start afresh);
- the corpus (and ``--val-corpus``), each corpus of a mixture (weights parse, >= 0, one > 0): a raw
  corpus exists, every ``.jsonl`` line is a JSON object with a string ``text`` field, and it holds at
  least ``seq_len + 1`` tokens (one sample); a prepared directory has a manifest of a format this
  version reads, was made with the run's tokenizer, and its files pass the quick size + sampled-digest
  check (:func:`loongtrain.data.prepared.verify_prepared`);
- ``--resume``: the checkpoint's files are readable (the bad file is named), its step is below
  ``--steps``, and the run is compatible with it (:data:`MUST_MATCH`);
- ``--init-from``: the checkpoint's files are readable and it lies outside this run's checkpoints (its
  model is checked against the run's by :func:`loongtrain.train.run_model.model_config_for`).

Resume rule: the data stream, the optimizer state and the model must continue unchanged, so the model
preset, tokenizer, corpus, ``--val-fraction``, ``--seq-len``, ``--seed``, ``--grad-accum``, the RoPE
(``--rope-theta``, ``--rope-scaling``, compared by meaning), the global batch (``dp * batch_size``) and the
AdamW hyper-parameters restored from the checkpoint (``--lr``, ``--beta1``, ``--beta2``, ``--eps``,
``--weight-decay``) must equal the checkpoint's. Everything else may change: the layout (``--hp``, ``--cp``,
``--window``, ``--placement``, ZeRO, ``--ac-mode``, the number of ranks at the same global batch),
``--steps``, ``--warmup``, ``--min-lr-ratio``, ``--clip``, logging and intervals. Continuing the trained
weights at another length or RoPE is a new run: ``--init-from CHECKPOINT`` (weights only) in a new
``--out-dir`` (docs/design.md §7, *RoPE scaling*).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

from loongtrain.data.corpus import FilesCorpus, build_corpus, non_text_chars
from loongtrain.data.packing import TokenStream
from loongtrain.data.prepared import check_prepared, is_prepared_dir
from loongtrain.data.sources import parse_corpus_spec
from loongtrain.data.tokenizer import Tokenizer
from loongtrain.model.rope_scaling import rope_change
from loongtrain.train.checkpoint import (
    AUTO,
    LATEST,
    STATE_FILE,
    find_checkpoint,
    newest_checkpoint,
    resolve_checkpoint,
    verify_checkpoint,
)
from loongtrain.train.config import TrainConfig
from loongtrain.train.run_model import build_run_tokenizer

#: options whose checkpoint value a resumed run must keep (see the module docstring)
log = logging.getLogger("loongtrain.train")

MUST_MATCH = ("model", "tokenizer", "corpus", "val_fraction", "seq_len", "seed", "grad_accum", "rope_theta",
              "rope_scaling", "lr", "beta1", "beta2", "eps", "weight_decay")
#: options a new run with --init-from may change where a resume may not
NEW_RUN_CHANGES = ("seq_len", "rope_theta", "rope_scaling")


class RunComplete(Exception):
    """A restarted job whose newest checkpoint is already at ``--steps``: nothing is left to do."""


def preflight(cfg: TrainConfig, world: int, tokenizer: Tokenizer | None = None, *,
              restarted: bool = False) -> TrainConfig:
    """Check the run's files; return ``cfg`` with ``resume`` resolved to one checkpoint directory ("" for a
    fresh start). ``restarted``: a restart of a failed job (``--resume`` defaults to 'auto', and a
    checkpoint at ``--steps`` raises :class:`RunComplete` instead of ValueError). ``tokenizer``: the run's
    (built from ``--tokenizer`` when not given)."""
    if restarted and not cfg.resume:
        cfg = dataclasses.replace(cfg, resume=AUTO, overwrite=False)
    check_out_dir(cfg)
    check_corpus(cfg, tokenizer or build_run_tokenizer(cfg))
    cfg = check_init_from(cfg)
    try:
        return resolve_resume(cfg, world)
    except _StepsReached as exc:
        if restarted:
            raise RunComplete(str(exc)) from None
        raise


class _StepsReached(ValueError):
    pass


def check_out_dir(cfg: TrainConfig) -> None:
    """``--out-dir`` is (or can become) a writable directory, and not inside a run's checkpoints."""
    if not cfg.out_dir.strip():
        raise ValueError("--out-dir '' is empty: name the run's directory")
    out = Path(cfg.out_dir)
    for place in (out.resolve(), *out.resolve().parents):
        if (place.name.startswith("step_") and (place / STATE_FILE).is_file()) or (
                place.name == "checkpoints" and (place / LATEST).is_file()):
            raise ValueError(f"--out-dir {cfg.out_dir!r} lies inside the checkpoints {str(place)!r} of a run; "
                             f"choose a directory of its own")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out-dir {cfg.out_dir!r} is a file; it must be a directory (or not exist yet)")
    probe = out
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise ValueError(f"--out-dir {cfg.out_dir!r}: {str(probe)!r} is a file, so the directory cannot be made")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(f"--out-dir {cfg.out_dir!r}: {str(probe)!r} is not writable")


def check_init_from(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with ``--init-from`` resolved to one checkpoint directory, after checking that its files are
    readable and that it is not one of this run's own checkpoints (``--resume`` continues those)."""
    if not cfg.init_from:
        return cfg
    try:
        path = find_checkpoint(cfg.init_from)
        verify_checkpoint(path)
    except ValueError as exc:
        raise ValueError(f"--init-from {cfg.init_from!r}: {exc}") from None
    own = (Path(cfg.out_dir) / "checkpoints").resolve()
    if own == path.resolve().parent:
        raise ValueError(f"--init-from {cfg.init_from!r} is a checkpoint of this run (--out-dir {cfg.out_dir!r}); "
                         f"--resume continues it, --init-from starts a new run in another --out-dir")
    return dataclasses.replace(cfg, init_from=str(path))


def check_corpus(cfg: TrainConfig, tokenizer: Tokenizer) -> None:
    """Every corpus of ``--corpus`` and ``--val-corpus`` (each part of a mixture) can be read and holds one
    sample of ``seq_len + 1`` tokens; a raw one is text (:func:`check_text`), a prepared one matches
    ``tokenizer`` and passes its quick checksum check (:func:`loongtrain.data.prepared.check_prepared`)."""
    for flag, spec in (("--corpus", cfg.corpus), ("--val-corpus", cfg.val_corpus)):
        if not spec:
            continue
        try:
            parts = parse_corpus_spec(spec)
        except ValueError as exc:
            raise ValueError(f"{flag} {spec!r}: {exc}") from None
        for name, _ in parts:
            where = f"{flag} {spec!r}" if name == spec else f"{flag} {spec!r}, corpus {name!r}"
            if is_prepared_dir(name):
                try:
                    check_prepared(name, tokenizer, cfg.seq_len + 1)
                except ValueError as exc:
                    raise ValueError(f"{where}: {exc}") from None
            else:
                check_raw_corpus(name, tokenizer, cfg.seq_len, where, cfg.decode_errors)


def check_raw_corpus(spec: str, tokenizer: Tokenizer, seq_len: int, where: str, decode_errors: str = "strict") -> None:
    """A raw corpus can be read as text (every document of its files) and holds at least ``seq_len + 1``
    tokens."""
    try:
        corpus = build_corpus(spec, decode_errors=decode_errors)
    except (ImportError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None
    if isinstance(corpus, FilesCorpus) and spec != "stdlib":
        if all(f.stat().st_size == 0 for f in corpus.files):
            raise ValueError(f"{where} is empty (every file has 0 bytes)")
        check_text(corpus, tokenizer, where, decode_errors)
    need = seq_len + 1
    try:
        have = TokenStream(corpus, tokenizer).ensure(need)
    except (ValueError, OSError) as exc:
        raise ValueError(f"{where}: {exc}") from None
    if have < need:
        raise ValueError(f"{where} holds {have} tokens; one sample needs --seq-len + 1 = {need}")


#: a corpus whose first characters are more than this share control characters or U+FFFD gets a warning
NON_TEXT_WARNING = 0.3
_SAMPLE_CHARS = 1 << 22


def check_text(corpus: FilesCorpus, tokenizer: Tokenizer, where: str, decode_errors: str = "strict") -> None:
    """Read every document of a files corpus once (every line of every file is decoded and parsed, so a
    bad byte or line anywhere is found now): ValueError when no document holds a token; a warning when
    the first 4 Mi characters are mostly control characters or replaced bytes (U+FFFD)."""
    has_tokens = False
    try:
        for doc in corpus:
            if not has_tokens and doc:
                has_tokens = len(tokenizer.encode(doc[:4096])) > 0
        sampled = non_text = 0  # the share of non-text, whatever --decode-errors drops or replaces
        for doc in FilesCorpus(corpus.files, corpus.name, corpus.text_field, decode_errors="replace"):
            part = doc[: _SAMPLE_CHARS - sampled]
            sampled, non_text = sampled + len(part), non_text + non_text_chars(part)
            if sampled >= _SAMPLE_CHARS:
                break
    except (ValueError, OSError) as exc:
        raise ValueError(f"{where}: {exc}") from None
    if not has_tokens:
        raise ValueError(f"{where}: its documents hold no tokens (every document is empty after tokenization "
                         f"with {tokenizer.name!r})")
    if sampled and non_text / sampled > NON_TEXT_WARNING:
        log.warning("%s: %.0f%% of its first %d characters are control characters or undecodable bytes "
                    "(U+FFFD): is it text?", where, 100 * non_text / sampled, sampled)
    if decode_errors != "strict":
        log.info("%s, --decode-errors %s: bytes that are not UTF-8 are %s", where, decode_errors,
                 "replaced by U+FFFD" if decode_errors == "replace" else "dropped")


def resolve_resume(cfg: TrainConfig, world: int) -> TrainConfig:
    """``cfg`` with ``resume`` set to the checkpoint directory to load ("" for a fresh start), after
    checking that directory and the run's compatibility with it."""
    root = Path(cfg.out_dir) / "checkpoints"
    if not cfg.resume:
        newest = newest_checkpoint(root)
        if newest is not None and not cfg.overwrite:
            raise ValueError(f"--out-dir {cfg.out_dir!r} already holds checkpoints (newest: {newest.name}); "
                             f"pass --resume auto to continue that run, or --overwrite to delete them and "
                             f"start afresh")
        return cfg
    path = resolve_checkpoint(cfg.resume, Path(cfg.out_dir))
    if path is None:
        return dataclasses.replace(cfg, resume="")
    state = verify_checkpoint(path)
    check_compatible(cfg, world, state, path)
    return dataclasses.replace(cfg, resume=str(path))


def _same_option(name: str, saved: Any, current: Any) -> bool:
    """Whether a resumed run's option equals the checkpoint's (``--rope-scaling`` by its meaning)."""
    if name == "rope_scaling" and isinstance(saved, str):
        try:
            return rope_change(0.0, saved) == rope_change(0.0, current)
        except ValueError:
            return False
    return saved == current


def check_compatible(cfg: TrainConfig, world: int, state: dict[str, Any], path: Path) -> None:
    """Raise ValueError when ``cfg`` cannot continue the run saved in checkpoint ``path`` (the resume rule)."""
    step = state["step"]
    if step >= cfg.steps:
        raise _StepsReached(f"--steps={cfg.steps}: the checkpoint {str(path)!r} is already at step {step}; "
                         f"nothing to train (raise --steps above {step} to continue)")
    saved = state.get("config") or {}
    for name in MUST_MATCH:
        if name in saved and not _same_option(name, saved[name], getattr(cfg, name)):
            hint = (f"; to continue its weights at another --seq-len or RoPE, start a new run from them: "
                    f"--init-from {str(path)!r} --out-dir NEW") if name in NEW_RUN_CHANGES else ""
            raise ValueError(f"--{name.replace('_', '-')}={getattr(cfg, name)!r} differs from the checkpoint's "
                             f"{saved[name]!r} ({str(path)!r}); a resumed run must keep it (resume rule: "
                             f"see `loongtrain.launch.preflight`){hint}")
    layout = state.get("layout") or {}
    if "dp" in layout and "batch_size" in saved:
        dp = world // cfg.parallel.sp
        if layout["dp"] * saved["batch_size"] != dp * cfg.batch_size:
            raise ValueError(
                f"global batch dp*--batch-size = {dp}*{cfg.batch_size} = {dp * cfg.batch_size} differs from "
                f"the checkpoint's {layout['dp']}*{saved['batch_size']} = {layout['dp'] * saved['batch_size']} "
                f"({str(path)!r}); a resumed run must keep the global batch")
