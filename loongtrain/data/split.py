"""The validation split: which documents are held out (docs/data.md).

Document ``i`` (its number in corpus order, the same whether the corpus is read raw or prepared) is
held out for validation iff ``u(i, seed) < fraction``, where ``u`` is the splitmix64 hash of ``i`` and
``seed`` mapped to [0, 1) (:func:`held_out`). The rule needs no list of documents, so it is the same in
every process, on every restart and for both readers; the training stream is the concatenation of the
other documents (each followed by EOS, as always), the validation stream that of the held-out ones.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from loongtrain.data.corpus import Corpus

TRAIN, VALIDATION = "train", "validation"
PARTS = ("all", TRAIN, VALIDATION)
_CHUNK = 4096


def check_fraction(fraction: float) -> None:
    """ValueError unless ``fraction`` is 0 (no split) or inside (0, 1)."""
    if not (math.isfinite(fraction) and (fraction == 0 or 0 < fraction < 1)):
        raise ValueError(f"--val-fraction={fraction} must be in (0, 1) (or 0: no validation split)")


def held_out(documents: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """Boolean mask: which of the document numbers ``documents`` belong to the validation split."""
    with np.errstate(over="ignore"):
        z = documents.astype(np.uint64) + np.uint64((seed * 0x632BE59BD9B4E019) % (1 << 64))
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / float(1 << 53) < fraction


def selected(num_documents: int, fraction: float, seed: int, part: str) -> np.ndarray | None:
    """Sorted document numbers of ``part`` of ``num_documents`` documents (None: all of them, no split)."""
    if part not in PARTS:
        raise ValueError(f"part {part!r} is not one of {PARTS}")
    check_fraction(fraction)
    if part == "all" or fraction == 0:
        if part == VALIDATION:
            raise ValueError("a validation part needs --val-fraction > 0")
        return None
    mask = held_out(np.arange(num_documents, dtype=np.uint64), fraction, seed)
    return np.flatnonzero(mask if part == VALIDATION else ~mask).astype(np.int64)


class SplitCorpus(Corpus):
    """The documents of ``corpus`` in one part of the split (raw corpora; prepared ones select by index)."""

    def __init__(self, corpus: Corpus, fraction: float, seed: int, part: str) -> None:
        if part not in (TRAIN, VALIDATION):
            raise ValueError(f"part {part!r} is not one of {(TRAIN, VALIDATION)}")
        self.corpus, self.fraction, self.seed, self.part = corpus, fraction, seed, part
        self.name = corpus.name

    def __iter__(self) -> Iterator[str]:
        want = self.part == VALIDATION
        docs = iter(self.corpus)
        first = 0
        while True:
            chunk = [d for _, d in zip(range(_CHUNK), docs)]
            if not chunk:
                return
            mask = held_out(np.arange(first, first + len(chunk), dtype=np.uint64), self.fraction, self.seed)
            yield from (d for d, m in zip(chunk, mask) if m == want)
            first += len(chunk)
