"""How a post-training objective reads its corpora (docs/post-training.md): :class:`PostTrainingReader` opens a
corpus as rows of whole units (an objective's reader says which: conversations for ``--objective sft``, pairs for
``--objective dpo``; loongtrain/objectives/), gives this replica's training batches (the same
:class:`~loongtrain.data.sampler.ReplicaSampler` over the rows as pretraining's over its samples, so a resume
continues exactly) and its validation batches.

Batches are ``{input_ids, labels, position_ids, doc_starts}``, each ``[batch, seq_len]``; DPO's also hold
``segment [batch, seq_len]``, ``num_pairs [batch]`` and ``ref_key [batch]`` (loongtrain/data/preference.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from loongtrain.data.chat import ChatFormat
from loongtrain.data.pipeline import Batches, _collate
from loongtrain.data.sampler import ReplicaSampler
from loongtrain.data.tokenizer import Tokenizer

Batch = dict[str, torch.Tensor]


class Dataset(Protocol):
    """Rows of whole units (:class:`~loongtrain.data.conversations.ConversationDataset`,
    :class:`~loongtrain.data.preference.PreferenceDataset`, ...)."""

    name: str
    seq_len: int

    def num_samples(self) -> int: ...

    def __getitem__(self, index: int) -> Batch: ...

    def summary(self) -> str: ...

    def has_targets(self) -> bool: ...


class PostTrainingBatches(Batches):
    """:class:`~loongtrain.data.pipeline.Batches` over a post-training dataset's rows."""

    def tokens_by_corpus(self, step: int | None = None) -> dict[str, int]:
        positions = (self.sampler.step if step is None else step) * self.sampler.dp * self.sampler.batch_size
        return {self.dataset.name: positions * self.dataset.seq_len}


@dataclass(frozen=True)
class PostTrainingReader:
    """How a run reads its post-training corpora: the tokenizer, chat format, row length, ``--on-long``,
    ``--seed`` and ``--decode-errors``. An objective's reader (a subclass, beside its objective) says which rows a
    corpus holds (:meth:`dataset`) and how the run's targets read (:meth:`describe`); ``objective`` names it in
    messages."""

    tokenizer: Tokenizer
    chat: ChatFormat | None
    seq_len: int
    on_long: str = "drop"
    seed: int = 0
    decode_errors: str = "strict"
    objective = "post-training"

    def dataset(self, spec: str, *, val_fraction: float = 0.0, part: str = "all", held_out: bool = False) -> Dataset:
        """The rows of ``spec`` (``part`` of the split by ``val_fraction``); ``held_out``: a validation set (kept
        apart from the training rows where the objective keys them, as DPO's reference does)."""
        raise NotImplementedError

    def describe(self) -> str:
        """The run's targets, for the launcher's log (one line)."""
        raise NotImplementedError

    def split(self, val_fraction: float, part: str) -> dict[str, Any]:
        """The keyword arguments of a corpus reader for ``part`` of the split by ``val_fraction``."""
        return dict(val_fraction=val_fraction, seed=self.seed, part=part, decode_errors=self.decode_errors)

    def batches(self, spec: str, batch_size: int, dp_rank: int, dp: int, start_step: int = 0, *,
                val_fraction: float = 0.0, shuffle: bool = True) -> PostTrainingBatches:
        """Replica ``dp_rank``'s batches from global micro-step ``start_step`` (infinite; rows reshuffled per
        epoch by ``--seed``), without the held-out part of ``val_fraction``."""
        dataset = self.dataset(spec, val_fraction=val_fraction, part="train" if val_fraction else "all")
        sampler = ReplicaSampler(dataset.num_samples(), dp_rank, dp, batch_size, self.seed, shuffle=shuffle,
                                 start_step=start_step)
        return PostTrainingBatches(dataset, sampler)

    def validation_batches(self, spec: str, val_corpus: str, val_fraction: float, batch_size: int, dp_rank: int,
                           dp: int, count: int) -> list[Batch]:
        """Replica ``dp_rank``'s first ``count`` validation batches: the held-out rows (``val_fraction``'s or
        ``val_corpus``'s) in order, row ``j`` on replica ``(j // batch_size) % dp``, whole global batches
        only; without either, the training rows' tail (:meth:`tail_batches`)."""
        if not (val_fraction or val_corpus):
            return self.tail_batches(spec, batch_size, dp_rank, dp, count)
        dataset = (self.dataset(val_corpus, held_out=True) if val_corpus else
                   self.dataset(spec, val_fraction=val_fraction, part="validation", held_out=True))
        have = min(count, dataset.num_samples() // (dp * batch_size))
        return [_collate([dataset[(k * dp + dp_rank) * batch_size + b] for b in range(batch_size)])
                for k in range(have)]

    def tail_batches(self, spec: str, batch_size: int, dp_rank: int, dp: int, count: int) -> list[Batch]:
        """The training rows' last ``count * dp * batch_size`` (wrapping around a smaller set): batch ``k`` of
        replica ``d`` holds rows ``first + (k * dp + d) * batch_size + b``."""
        dataset = self.dataset(spec)
        available = dataset.num_samples()
        first = available - count * dp * batch_size
        return [_collate([dataset[(first + (k * dp + dp_rank) * batch_size + b) % available]
                          for b in range(batch_size)]) for k in range(count)]

    def check(self, spec: str, val_corpus: str, val_fraction: float, rows_per_step: int) -> list[str]:
        """The launcher's check of the run's corpora (before any worker): every row parses and encodes (errors
        name ``FILE:LINE``), the rows pack (at least one unit fits ``--seq-len``), the held-out rows fill one
        global batch of ``rows_per_step`` rows; returns the lines to log (the target rule, the packing)."""
        from loongtrain.data.sources import parse_corpus_spec

        if len(parse_corpus_spec(spec)) > 1:
            raise ValueError(f"--corpus {spec!r}: --objective {self.objective} reads one corpus, not a mixture")
        lines = [f"--objective {self.objective}: {self.describe()}"]
        train = self.dataset(spec, val_fraction=val_fraction, part="train" if val_fraction else "all")
        if not train.num_samples():
            raise ValueError(f"--corpus {spec!r}: --val-fraction {val_fraction} leaves no row for training")
        _check_targets(train, f"--corpus {spec!r}" + (f" (less --val-fraction {val_fraction})" if val_fraction else ""),
                       self.describe())
        lines.append(f"--corpus {spec}: {train.summary()}")
        if val_fraction or val_corpus:
            held = (self.dataset(val_corpus, held_out=True) if val_corpus else
                    self.dataset(spec, val_fraction=val_fraction, part="validation", held_out=True))
            what = f"--val-corpus {val_corpus!r}" if val_corpus else f"--val-fraction {val_fraction}"
            if held.num_samples() < rows_per_step:
                raise ValueError(f"{what}: the held-out data packs into {held.num_samples()} rows, less than one "
                                 f"global batch of dp*batch_size = {rows_per_step}; raise --val-fraction")
            _check_targets(held, what, self.describe())
            lines.append(f"validation: {held.summary()}")
        return lines


def _check_targets(dataset: Dataset, what: str, describe: str) -> None:
    """ValueError naming ``what`` when the rows ``dataset`` packs hold no target token at all (every step would
    be skipped: loss 0, nothing learnt): no assistant turn, or a template whose generation blocks mark none."""
    if not dataset.has_targets():
        raise ValueError(f"{what}: no target token in any of {dataset.summary()} ({describe}): every step would be "
                         f"skipped; give rows with assistant turns (or completions), a template with "
                         f"{{% generation %}} blocks around them, or --loss-on all")
