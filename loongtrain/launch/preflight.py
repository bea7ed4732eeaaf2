"""Checks of a run's files, made by the launcher before any worker starts (docs/launching.md).

:func:`preflight` raises ValueError naming the offending value and the rule, so ``loongtrain train``
exits 2 within seconds instead of failing inside the workers. It checks:

- the output directory, by the ownership rule (:mod:`loongtrain._files`: not empty, not the current
  directory or a parent of it, not holding or inside an input, nothing in it loongtrain did not write,
  not locked by another run), not a file, writable, not inside a run's checkpoints; a directory that
  already holds checkpoints needs ``--resume`` (continue) or ``--overwrite`` (start afresh);
- the corpus (and ``--val-corpus``), each corpus of a mixture (weights parse, >= 0, one > 0): a raw
  corpus exists, is text (every ``.jsonl`` line a JSON object with a string ``text`` field; a corpus of
  more than :data:`loongtrain.data.checks.SAMPLE_ALL_BYTES` is checked on a sample, the reader still
  checks every byte), and holds at least ``seq_len + 1`` tokens (one sample); a prepared directory has a
  manifest of a format this version reads, made with the run's tokenizer, whose counts its files agree
  with, and its files pass the quick size + sampled-digest check
  (:func:`loongtrain.data.prepared.verify_prepared`); with ``--val-fraction`` the training part holds a
  sample too (:mod:`loongtrain.data.checks`);
- the objective's data checks (its registry entry's ``check_data``: a text corpus's above and its validation; a
  post-training objective's rows parse, encode and pack);
- validation (:func:`loongtrain.train.validation.check_validation`): held-out data smaller than one
  global batch is an error; ``--val-batches`` more than it holds, a ``--val-interval`` longer than
  the run, a ``--val-corpus`` that is the training corpus are one-line warnings;
- ``--resume``: the checkpoint is complete and its files are readable (the bad file is named), its step
  is below ``--steps``, the run is compatible with it (:data:`MUST_MATCH`), and the data is the data it
  trained on: the corpus's and the tokenizer's identity (:func:`data_identity`) equal the ones the
  checkpoint recorded (a corpus whose files only got new modification times: a warning);
- ``--init-from``: the checkpoint's files are readable and it lies outside this run's checkpoints (its
  model is checked against the run's by :func:`loongtrain.train.model_setup.model_config_for`).

Resume rule: the data stream, the optimizer state, the model and the loss must continue unchanged. Every option
declares what a resume may do with it, where it is declared (``option(..., resume=...)``: the sections'
fields, an objective's options, whose default is to keep them; :meth:`TrainSections.resume_rules`, collected in
:data:`MUST_MATCH`): ``keep`` what changes the loss, the data it is computed on or the optimizer's update (the
model preset, ``--lora`` compared by meaning (a LoRA checkpoint's base must be the one it trained on:
:func:`loongtrain.train.lora_base.check_base`), tokenizer, corpus, ``--val-fraction``, ``--decode-errors``,
``--stage-tokens``, ``--doc-mask``, ``--position-reset``, ``--seed``, ``--grad-accum``, the AdamW
hyper-parameters restored from the checkpoint (``--lr``, ``--beta1``, ``--beta2``, ``--eps``,
``--weight-decay``), ``--objective`` and every option of it: ``--loss-on``, ``--chat-template``, ``--on-long``,
``--dpo-beta``, ``--ref-model``); ``new_run`` what a new run from the weights may change (``--seq-len``,
``--seq-len-stages``, the RoPE: ``--rope-theta``, ``--rope-scaling`` compared by meaning): continuing the
trained weights at another length or RoPE is a new run, ``--init-from CHECKPOINT`` (weights only) in a new
``--out-dir`` (docs/context-extension.md#rope-scaling); the global batch (``dp * batch_size``) is kept too.
Everything else may change: the layout (``--hp``, ``--cp``, ``--inner-ring``, ``--placement``, ZeRO,
``--recompute``, the number of ranks at the same global batch), the compute dtype, ``--steps`` (without a
schedule), ``--warmup``, ``--min-lr-ratio``, ``--clip``, logging and intervals.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from loongtrain._files import check_output, follow_link
from loongtrain.data.prepared import tokenizer_identity
from loongtrain.data.sources import corpus_identity, identity_change, parse_corpus_spec
from loongtrain.data.tokenizer import Tokenizer
from loongtrain.hf.convert import shape_config_from_hf
from loongtrain.hf.load import hf_config_from_dict
from loongtrain.launch.config import TrainConfig
from loongtrain.model.config import ModelConfig, first_difference
from loongtrain.model.lora import parse_lora
from loongtrain.model.rope_scaling import rope_change
from loongtrain.train.checkpoint import (
    AUTO,
    LATEST,
    RUN_OUTPUT,
    STATE_FILE,
    check_complete,
    find_checkpoint,
    newest_checkpoint,
    read_latest,
    read_trainer_state,
    resolve_checkpoint,
    resume_candidates,
    verify_checkpoint,
)
from loongtrain.train.lora_base import check_base
from loongtrain.train.model_setup import build_run_tokenizer, hf_model_dir, model_config_for, tokenizer_spec

#: options whose checkpoint value a resumed run must keep (see the module docstring)
log = logging.getLogger("loongtrain.train")

MUST_MATCH = tuple(name for name, rule in TrainConfig.resume_rules().items() if rule != "free")
#: options a new run with --init-from may change where a resume may not
NEW_RUN_CHANGES = tuple(name for name, rule in TrainConfig.resume_rules().items() if rule == "new_run")


class RunComplete(Exception):
    """A restarted job whose newest checkpoint is already at ``--steps``: nothing is left to do."""


def preflight(cfg: TrainConfig, world: int, tokenizer: Tokenizer | None = None, *,
              restarted: bool = False) -> TrainConfig:
    """Check the run's files; return ``cfg`` with ``resume`` resolved to one checkpoint directory ("" for a
    fresh start). ``restarted``: a restart of a failed job (``--resume`` defaults to 'auto', and a
    checkpoint at ``--steps`` raises :class:`RunComplete` instead of ValueError). ``tokenizer``: the run's
    (built from ``--tokenizer`` when not given)."""
    if restarted and not cfg.output.resume:
        cfg = cfg.replace(resume=AUTO, overwrite=False)
    cfg = check_init_from(cfg)
    check_out_dir(cfg)
    tokenizer = tokenizer or build_run_tokenizer(cfg.model)
    check_init_identity(cfg, tokenizer)
    try:  # the continuation first: its checks are cheap, the corpus's may encode every row
        resolved = resolve_resume(cfg, world, tokenizer)
    except _StepsReached as exc:
        if restarted:
            raise RunComplete(str(exc)) from None
        raise
    for warning in check_corpus(cfg, tokenizer, world):
        log.warning("%s", warning)
    return resolved


class _StepsReached(ValueError):
    pass


def run_inputs(cfg: TrainConfig) -> list[str]:
    """The paths a run reads (its output directory must neither hold nor lie inside them): the corpora of
    ``--corpus`` and ``--val-corpus``, a tokenizer path, a Hugging Face model directory, ``--init-from``."""
    paths = [name for spec in (cfg.data.corpus, cfg.data.val_corpus) if spec for name, _ in _parts(spec)]
    tokenizer = tokenizer_spec(cfg.model)
    model = hf_model_dir(cfg.model.model)
    return [p for p in paths + [tokenizer] + [str(model) if model else "", cfg.model.init_from]
            if p and p not in ("stdlib", "byte")]


def _parts(spec: str) -> list[tuple[str, float]]:
    try:
        return parse_corpus_spec(spec)
    except ValueError:
        return []  # check_corpus names the bad spec


def check_out_dir(cfg: TrainConfig) -> None:
    """``--out-dir`` is (or can become) a writable directory of this run's own (the ownership rule,
    :func:`loongtrain._files.check_output`), and not inside a run's checkpoints."""
    if cfg.output.out_dir.strip():
        out = follow_link("--out-dir", cfg.output.out_dir)
        for place in (out.resolve(), *out.resolve().parents):
            if (place.name.startswith("step_") and (place / STATE_FILE).is_file()) or (
                    place.name == "checkpoints" and (place / LATEST).is_file()):
                raise ValueError(f"--out-dir {cfg.output.out_dir!r} lies inside the checkpoints {str(place)!r} of a "
                                 f"run; choose a directory of its own")
    out = check_output(RUN_OUTPUT, cfg.output.out_dir, inputs=run_inputs(cfg))  # all the way down: checkpoints/step_N/
    probe = out
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise ValueError(f"--out-dir {cfg.output.out_dir!r}: {str(probe)!r} is a file, so the directory cannot be made")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(f"--out-dir {cfg.output.out_dir!r}: {str(probe)!r} is not writable")


def check_init_from(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with ``--init-from`` resolved to one checkpoint directory, after checking that its files are
    readable and that it is not one of this run's own checkpoints (``--resume`` continues those)."""
    if not cfg.model.init_from:
        return cfg
    try:
        path = find_checkpoint(cfg.model.init_from)
        state = verify_checkpoint(path)
        check_base(state, str(path))  # a LoRA run's base, as its resume and its export check it
    except ValueError as exc:
        raise ValueError(f"--init-from {cfg.model.init_from!r}: {exc}") from None
    if state.get("lora"):
        raise ValueError(f"--init-from {cfg.model.init_from!r} is a LoRA run: its checkpoint holds only the adapters "
                         f"of its base; start from its merged weights: `loongtrain export {cfg.model.init_from} --hf "
                         f"DIR` (which checks the base too), then --model DIR")
    own = (Path(cfg.output.out_dir) / "checkpoints").resolve()
    if own == path.resolve().parent:
        raise ValueError(f"--init-from {cfg.model.init_from!r} is a checkpoint of this run (--out-dir "
                         f"{cfg.output.out_dir!r}); --resume continues it, --init-from starts a new run in another "
                         f"--out-dir")
    source = path.resolve().parent  # the checkpoints directory, and the run directory holding it
    source = source.parent if source.name == "checkpoints" else source
    out = Path(cfg.output.out_dir).resolve() if cfg.output.out_dir.strip() else None
    if out is not None and (out == source or source in out.parents):
        raise ValueError(f"--out-dir {cfg.output.out_dir!r} lies inside {str(source)!r}, the run --init-from "
                         f"{cfg.model.init_from!r} continues; a new run writes outside its source: choose another "
                         f"--out-dir")
    return cfg.replace(init_from=str(path))


def check_init_identity(cfg: TrainConfig, tokenizer: Tokenizer) -> None:
    """``--init-from``: the run reads text as its source did: the tokenizer, compared by content (its
    identity, as a resume compares it; the vocabulary and the architecture are compared by
    :func:`loongtrain.train.model_setup.model_config_for`, the RoPE is logged at the start)."""
    if not cfg.model.init_from:
        return
    state = read_trainer_state(Path(cfg.model.init_from))
    saved = (state.get("data_identity") or {}).get("tokenizer")
    now = tokenizer_identity(tokenizer)
    if saved is not None and saved != now:
        then = (state.get("config") or {}).get("tokenizer") or "the model's"
        raise ValueError(f"--tokenizer {cfg.model.tokenizer!r} ({tokenizer.name}) is not the tokenizer --init-from "
                         f"{cfg.model.init_from!r} trained with ({then!r}; identity {saved} then, {now} now): the "
                         f"weights read tokens as that tokenizer writes them; pass it as --tokenizer")


def check_same_model(cfg: TrainConfig, tokenizer: Tokenizer, state: dict[str, Any], path: Path) -> None:
    """A resume builds the checkpoint's model: the vocabulary and the architecture it recorded (the RoPE:
    :data:`MUST_MATCH`). ValueError naming the first field that differs; checkpoints without a record pass."""
    if "model_config" in state:
        saved = ModelConfig(**state["model_config"])
    elif "hf_config" in state:
        saved = shape_config_from_hf(hf_config_from_dict(state["hf_config"]))
    else:
        return
    now = model_config_for(cfg.model, tokenizer)
    name = first_difference(saved, now)
    if name is not None:
        raise ValueError(f"--model {cfg.model.model!r} with --tokenizer {cfg.model.tokenizer!r}: {name}="
                         f"{getattr(now, name)!r}, the checkpoint {str(path)!r} has {getattr(saved, name)!r}; "
                         f"a resumed run must build the model it saved")


def check_corpus(cfg: TrainConfig, tokenizer: Tokenizer, world: int = 1) -> list[str]:
    """The run's ``--corpus`` and ``--val-corpus`` by its objective's rules (its registry entry's
    ``check_data``: a text corpus's can be read and hold a sample each, :func:`loongtrain.data.checks.check_corpora`,
    and its validation, :func:`loongtrain.train.validation.check_validation`; a post-training objective's rows
    parse, encode and pack); its lines logged, its warnings returned."""
    lines, warnings = cfg.spec().check_data(cfg, tokenizer, world)
    for line in lines:
        log.info("%s", line)
    return warnings


def data_identity(cfg: TrainConfig, tokenizer: Tokenizer) -> dict[str, Any]:
    """What the run reads, by content: ``{"corpus": corpus_identity(--corpus), "tokenizer": identity}``
    (:func:`loongtrain.data.sources.corpus_identity`; recorded in every checkpoint) and what its objective adds
    (a post-training objective: ``"chat"``, the chat format's identity: its template's digest and target rule)."""
    return {"corpus": corpus_identity(cfg.data.corpus), "tokenizer": tokenizer_identity(tokenizer),
            **cfg.spec().identity(cfg, tokenizer)}


def check_same_data(cfg: TrainConfig, tokenizer: Tokenizer, state: dict[str, Any], path: Path) -> None:
    """The corpus and tokenizer a resume reads are the checkpoint's (by content, not by name): ValueError
    when they changed, a warning when only modification times did. Checkpoints without a recorded
    identity pass."""
    saved = state.get("data_identity")
    if not saved:
        return
    now = data_identity(cfg, tokenizer)
    if saved.get("tokenizer") not in (None, now["tokenizer"]):
        raise ValueError(f"--tokenizer {cfg.model.tokenizer!r}: its files changed since the checkpoint {str(path)!r} "
                         f"(identity {saved['tokenizer']} then, {now['tokenizer']} now); a resumed run must keep them")
    if saved.get("chat") != now.get("chat"):
        raise ValueError(f"--chat-template {cfg.objective.chat_template!r}: the chat template changed since the "
                         f"checkpoint {str(path)!r} ({saved.get('chat')} then, {now.get('chat')} now); a resumed run "
                         f"must keep it")
    error, warning = identity_change(saved.get("corpus") or [], now["corpus"])
    if error:
        raise ValueError(f"--corpus {cfg.data.corpus!r}: {error} since the checkpoint {str(path)!r}; a resumed run "
                         f"must read the same data (restore it, or start afresh with --overwrite)")
    if warning:
        log.warning("--corpus %r: %s since the checkpoint %s", cfg.data.corpus, warning, path)


def resolve_resume(cfg: TrainConfig, world: int, tokenizer: Tokenizer | None = None) -> TrainConfig:
    """``cfg`` with ``resume`` set to the checkpoint directory to load ("" for a fresh start), after
    checking that directory and the run's compatibility with it."""
    root = Path(cfg.output.out_dir) / "checkpoints"
    if not cfg.output.resume:
        newest = newest_checkpoint(root)
        if newest is not None and not cfg.output.overwrite:
            raise ValueError(f"--out-dir {cfg.output.out_dir!r} already holds checkpoints (newest: {newest.name}); "
                             f"pass --resume auto to continue that run, or --overwrite to delete them and "
                             f"start afresh")
        return cfg
    if cfg.output.resume == AUTO:
        path, state = _newest_complete(root)
        if path is None:
            return cfg.replace(resume="")
    else:
        path = resolve_checkpoint(cfg.output.resume, Path(cfg.output.out_dir))
        assert path is not None  # only 'auto' may find none
        state = verify_checkpoint(path)
    check_compatible(cfg, world, state, path)
    tokenizer = tokenizer or build_run_tokenizer(cfg.model)
    if state.get("lora"):  # --lora: the base the adapters trained on is still there, unchanged
        preset = hf_model_dir(cfg.model.model) is None  # a preset: the shape this run builds
        check_base(state, str(path), model_config_for(cfg.model, tokenizer) if preset else None)
    check_same_model(cfg, tokenizer, state, path)
    check_same_data(cfg, tokenizer, state, path)
    return cfg.replace(resume=str(path))


def _newest_complete(root: Path) -> tuple[Path | None, dict[str, Any]]:
    """``--resume auto``: the newest checkpoint under ``root`` that passes :func:`verify_checkpoint` and its
    trainer state, passing over incomplete ones with one warning line naming the first and why
    (docs/files-and-checkpoints.md#a-checkpoint-is-its-checksums); (None, {}) when ``root`` holds no
    checkpoint; ValueError when it holds some but none is complete."""
    skipped: list[tuple[Path, str]] = []
    try:
        read_latest(root)
    except ValueError as exc:
        skipped.append((root / LATEST, str(exc)))
    for path in resume_candidates(root, complete=False):
        try:
            state = verify_checkpoint(check_complete(path))
        except ValueError as exc:
            skipped.append((path, str(exc)))
            continue
        if skipped:
            first, why = skipped[0]
            log.warning("--resume auto: passing over %d incomplete checkpoint(s) (%s: %s); continuing from the "
                        "newest complete one, %s", len(skipped), first.name, why, path)
        return path, state
    if skipped:
        first, why = skipped[0]
        raise ValueError(f"--resume auto: {str(root)!r} holds no complete checkpoint ({first.name}: {why}); "
                         f"restore it, or start afresh with --overwrite")
    return None, {}


def _same_option(name: str, saved: Any, current: Any) -> bool:
    """Whether a resumed run's option equals the checkpoint's (``--rope-scaling`` by its meaning)."""
    if name == "rope_scaling" and isinstance(saved, str):
        try:
            return rope_change(0.0, saved) == rope_change(0.0, current)
        except ValueError:
            return False
    if name == "lora" and isinstance(saved, str):
        try:
            return parse_lora(saved) == parse_lora(current)
        except ValueError:
            return False
    if isinstance(current, tuple):  # a tuple option (--reward) is a list in the checkpoint's JSON
        return isinstance(saved, list) and tuple(saved) == current
    return saved == current


def check_compatible(cfg: TrainConfig, world: int, state: dict[str, Any], path: Path) -> None:
    """Raise ValueError when ``cfg`` cannot continue the run saved in checkpoint ``path`` (the resume rule)."""
    step = state["step"]
    if step >= cfg.optim.steps:
        raise _StepsReached(f"--steps={cfg.optim.steps}: the checkpoint {str(path)!r} is already at step {step}; "
                         f"nothing to train (raise --steps above {step} to continue)")
    saved, now = state.get("config") or {}, cfg.to_dict()
    for name in MUST_MATCH:
        if name in saved and not _same_option(name, saved[name], now[name]):
            hint = (f"; to continue its weights at another --seq-len or RoPE, start a new run from them: "
                    f"--init-from {str(path)!r} --out-dir NEW") if name in NEW_RUN_CHANGES else ""
            raise ValueError(f"--{name.replace('_', '-')}={now[name]!r} differs from the checkpoint's "
                             f"{saved[name]!r} ({str(path)!r}); a resumed run must keep it (resume rule: "
                             f"see `loongtrain.launch.preflight`){hint}")
    layout = state.get("layout") or {}
    if "dp" in layout and "batch_size" in saved:
        dp = world // cfg.parallel.sp
        if layout["dp"] * saved["batch_size"] != dp * cfg.data.batch_size:
            raise ValueError(
                f"global batch dp*--batch-size = {dp}*{cfg.data.batch_size} = {dp * cfg.data.batch_size} differs from "
                f"the checkpoint's {layout['dp']}*{saved['batch_size']} = {layout['dp'] * saved['batch_size']} "
                f"({str(path)!r}); a resumed run must keep the global batch")
