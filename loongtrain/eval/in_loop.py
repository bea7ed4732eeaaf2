"""Evaluation inside the training loop (``loongtrain train --eval-tasks passkey,position-loss --eval-lengths
4K,16K``, docs/evaluation.md): ``loongtrain eval``'s tasks as
:class:`~loongtrain.train.validation.Evaluation` callables, which the trainer runs at every
``--val-interval`` on its own model, mesh and autocast, forward only, after the validation loss.

- :func:`in_loop_evaluations` (the launch path, before any worker starts) checks the options and builds
  them: every length suits the run's layout (as a training length does), the tokenizer writes each digit
  as one token, the data holds the position-loss sequences; a length past the model's positions (an HF
  model's ``max_position_embeddings``, a preset's longest ``--seq-len``) gets one warning, as
  ``loongtrain eval`` gives.
- :class:`PasskeyEvaluation`: ``--eval-trials`` prompts per (length, depth) cell, depths
  :data:`~loongtrain.eval.passkey.DEPTHS`, keys of :data:`~loongtrain.eval.passkey.KEY_DIGITS` digits drawn
  from ``--seed`` (the same prompts at every interval); metric ``eval/passkey/<length>``, the fraction of
  keys retrieved at that length.
- :class:`PositionLossEvaluation`: ``--eval-docs`` sequences of the longest length, from the held-out data
  (``--val-fraction`` / ``--val-corpus``) or else the corpus in its order (unshuffled, as ``loongtrain
  eval`` reads it), under the run's ``--doc-mask``, ``--position-reset`` and ``--chunk-order``; metric
  ``eval/position_loss/<start>-<end>`` per non-empty bucket. The sequences are read once per rank, at
  the first call (what the launcher checked).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from loongtrain.data.pipeline import DataOptions, build_batches
from loongtrain.data.sources import open_stream, parse_corpus_spec
from loongtrain.data.tokenizer import Tokenizer
from loongtrain.data.validation import build_val_batches
from loongtrain.eval.forward import Batch
from loongtrain.eval.passkey import DEPTHS, KEY_DIGITS, PasskeyTokens, passkey, passkey_tokens
from loongtrain.eval.position_loss import position_loss
from loongtrain.eval.report import span_label
from loongtrain.eval.source import ModelSource, trained_length
from loongtrain.model.config import ModelConfig
from loongtrain.parallel.config import validate_parallel
from loongtrain.parallel.mesh import Mesh
from loongtrain.train.config import TrainSections
from loongtrain.train.metrics import size_label
from loongtrain.train.model_setup import hf_model_dir

log = logging.getLogger("loongtrain.eval")


@dataclass(frozen=True)
class PasskeyEvaluation:
    """``--eval-tasks passkey`` (module docstring)."""

    tokens: PasskeyTokens
    lengths: tuple[int, ...]
    trials: int
    seed: int
    depths: tuple[float, ...] = DEPTHS
    key_digits: int = KEY_DIGITS

    def __call__(self, model: nn.Module, mesh: Mesh, device: torch.device,
                 amp_dtype: torch.dtype | None) -> dict[str, float]:
        rows = passkey(model, self.tokens, self.lengths, self.depths, self.trials, mesh, device,
                       key_digits=self.key_digits, seed=self.seed, amp_dtype=amp_dtype)
        return passkey_metrics(rows)


def passkey_metrics(rows: list[dict]) -> dict[str, float]:
    """``{"eval/passkey/<length>": keys retrieved / trials}`` of passkey's cells, per length."""
    out = {}
    for length in dict.fromkeys(r["length"] for r in rows):
        cells = [r for r in rows if r["length"] == length]
        out[f"eval/passkey/{size_label(length)}"] = sum(c["correct"] for c in cells) / sum(c["trials"] for c in cells)
    return out


@dataclass(frozen=True)
class PositionSequences:
    """Where ``--eval-tasks position-loss`` reads its sequences (module docstring), and how many: ``data``, the run's
    data section at the longest ``--eval-lengths`` and one sequence a batch."""

    data: DataOptions
    tokenizer: Tokenizer
    count: int
    seed: int

    def read(self) -> list[Batch]:
        """The ``[1, seq_len]`` batches (fewer than ``count`` when the held-out data has fewer)."""
        if self.data.val_fraction or self.data.val_corpus:
            held_out = build_val_batches(self.data, self.tokenizer, self.seed)
            return list(itertools.islice(held_out, self.count))
        stream = build_batches(self.data, self.tokenizer, self.seed, shuffle=False)
        return [next(stream) for _ in range(self.count)]

    def check(self) -> None:
        """ValueError naming the corpus when it cannot give the sequences (a warning when the held-out data
        gives fewer); the launcher's check."""
        data = self.data
        if data.val_fraction or data.val_corpus:
            have = len(self.read())
            if have < self.count:
                log.warning("--eval-docs %d: the held-out data holds %d sequences of %d tokens; position-loss "
                            "uses those", self.count, have, data.seq_len)
            return
        parts = parse_corpus_spec(data.corpus)
        for name, _ in parts:
            need = (self.count if len(parts) == 1 else 1) * data.seq_len + 1  # a mixture: one of each part
            have = open_stream(name, self.tokenizer, decode_errors=data.decode_errors).ensure(need)
            if have < need:
                raise ValueError(f"--eval-tasks position-loss: corpus {name!r} holds {have} tokens; --eval-docs "
                                 f"{self.count} sequences of the longest --eval-lengths {data.seq_len} need {need}")


@dataclass
class PositionLossEvaluation:
    """``--eval-tasks position-loss`` (module docstring)."""

    sequences: PositionSequences
    doc_mask: str
    position_reset: bool
    chunk_order: str
    sliding_window: int | None
    _batches: list[Batch] = field(default_factory=list, repr=False)

    def __call__(self, model: nn.Module, mesh: Mesh, device: torch.device,
                 amp_dtype: torch.dtype | None) -> dict[str, float]:
        if not self._batches:
            self._batches = self.sequences.read()
        rows = position_loss(model, self._batches, mesh, device, self.sequences.data.seq_len, amp_dtype=amp_dtype,
                             doc_mask=self.doc_mask, position_reset=self.position_reset,
                             chunk_order=self.chunk_order, sliding_window=self.sliding_window)
        return {f"eval/position_loss/{span_label(r['start'], r['end'])}": r["loss"] for r in rows
                if r["loss"] is not None}


def in_loop_evaluations(cfg: TrainSections, model_config: ModelConfig, tokenizer: Tokenizer,
                        world: int) -> tuple[PasskeyEvaluation | PositionLossEvaluation, ...]:
    """The run's ``--eval-tasks``, checked for ``world`` ranks (module docstring); ``()`` without them."""
    tasks = cfg.evaluation.tasks()
    if not tasks:
        return ()
    lengths = cfg.evaluation.lengths(cfg.data.seq_len)
    p = cfg.parallel
    for length in lengths:
        try:
            validate_parallel(p, world, seq_len=length)
        except ValueError as exc:
            raise ValueError(f"--eval-lengths {length} on --hp {p.hp} --cp {p.cp} ({world} ranks): {exc}") from None
    _warn_past_positions(cfg, max(lengths))
    out: list[PasskeyEvaluation | PositionLossEvaluation] = []
    if "passkey" in tasks:
        tokens = passkey_tokens(tokenizer)
        if min(lengths) < tokens.overhead(KEY_DIGITS):
            raise ValueError(f"--eval-lengths {min(lengths)}: a passkey prompt needs at least "
                             f"{tokens.overhead(KEY_DIGITS)} tokens with this tokenizer (needle, question and a "
                             f"{KEY_DIGITS}-digit answer)")
        out.append(PasskeyEvaluation(tokens, lengths, cfg.evaluation.eval_trials, cfg.optim.seed))
    if "position-loss" in tasks:
        sequences = PositionSequences(replace(cfg.data, seq_len=max(lengths), batch_size=1), tokenizer,
                                      cfg.evaluation.eval_docs, cfg.optim.seed)
        sequences.check()
        out.append(PositionLossEvaluation(sequences, cfg.data.doc_mask, cfg.data.position_reset,
                                          cfg.data.chunk_order if cfg.data.doc_mask == "on" else "zigzag",
                                          model_config.sliding_window))
    return tuple(out)


def _warn_past_positions(cfg: TrainSections, longest: int) -> None:
    directory = hf_model_dir(cfg.model.model)
    limit, what = (trained_length(ModelSource("hf", directory, cfg)) if directory is not None
                   else (cfg.data.seq_len, "longest training --seq-len"))
    if longest > limit:
        log.warning("--eval-lengths %d is past the model's %s %d: measuring beyond the trained length", longest,
                    what, limit)
