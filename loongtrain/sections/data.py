"""The data section of a run: the corpus and its validation split, the sequence length and its stages, the
packing rules and the batch (docs/data.md)."""

from __future__ import annotations

from dataclasses import dataclass

from loongtrain._options import flag, option
from loongtrain.data.corpus import DECODE_ERRORS
from loongtrain.data.split import check_fraction
from loongtrain.parallel.config import CHUNK_ORDERS
from loongtrain.sections.stages import check_stages

DOC_MASK = ("on", "off")


@dataclass
class DataSection:
    """What a run reads and how it packs it: one field = one ``--option`` = one TOML key."""

    corpus: str = option(
        "stdlib", group="data", help="corpus: 'stdlib' (this Python's standard-library sources, no download), a "
        ".txt/.jsonl file, a directory of them, a saved Hugging Face dataset, a directory made by `loongtrain "
        "prepare` (memory-mapped), or a mixture NAME=WEIGHT,... of these (e.g. a=0.7,b=0.3)", resume="keep")
    val_fraction: float = option(0.0, "hold out this fraction of the corpus's documents for validation, chosen "
                                 "by a hash of the document number and --seed (0: none; else in (0, 1))", resume="keep")
    val_corpus: str = option("", "validation corpus of its own (any --corpus form; instead of --val-fraction)",
                             resume="free")
    decode_errors: str = option("strict", "corpus bytes that are not UTF-8: strict (an error naming the file and "
                                "byte offset), replace (U+FFFD) or ignore (dropped)", resume="keep")
    seq_len: int = option(8192, "tokens per sequence, e.g. 131072, 128K, 1M (must be divisible by 2*hp*cp); "
                          "with --seq-len-stages, its longest length", size=True, resume="new_run")
    seq_len_stages: str = option(
        "", "train in stages of increasing length: LENGTH:STEPS,... e.g. 8K:1000,32K:400,128K:100 (--steps is "
        "their sum; every length must suit the layout; docs/context-extension.md#seq-len-stages)", resume="new_run")
    stage_tokens: str = option(
        "constant", "with --seq-len-stages: constant (every step holds the longest stage's tokens: a shorter "
        "stage puts longest/length times --batch-size sequences into a micro-step; its length must divide the "
        "longest) or free (every stage keeps --batch-size and --grad-accum)", resume="keep")
    doc_mask: str = option("on", "on: in packed corpora a token attends only inside its own document (block-"
                           "skipping ring attention; MFU counts only visible pairs); off: causal over the whole "
                           "packed sequence (loongtrain's decoder and Hugging Face models)", resume="keep")
    position_reset: bool = option(True, "with --doc-mask on, position ids restart at 0 in each document", resume="keep")
    chunk_order: str = option("zigzag", "how each sequence is laid on the context ranks: zigzag, or balanced "
                              "(with --doc-mask on and cp > 1: per batch, chunks go to the ranks by their "
                              "documents' visible-pair work, so no rank waits for a busier one; batches "
                              "without document marks stay zigzag)", resume="free")
    batch_size: int = option(1, "sequences per data-parallel replica per micro-step (with --seq-len-stages: in "
                             "the longest stage)", at_least=1, resume="free")
    grad_accum: int = option(1, "micro-steps accumulated per optimizer step (with --seq-len-stages: in the "
                             "longest stage)", resume="keep")

    def validate(self, steps: int) -> None:
        """ValueError naming the value (``steps``: the run's ``--steps``, which a ``--seq-len-stages`` sums)."""
        for name in ("seq_len", "batch_size", "grad_accum"):
            if getattr(self, name) < 1:
                raise ValueError(f"{flag(name)}={getattr(self, name)} must be a positive integer")
        check_fraction(self.val_fraction)
        if self.val_fraction and self.val_corpus:
            raise ValueError(f"--val-fraction={self.val_fraction} and --val-corpus={self.val_corpus!r}: give "
                             f"one of them")
        for name, choices in (("decode_errors", DECODE_ERRORS), ("doc_mask", DOC_MASK),
                              ("chunk_order", CHUNK_ORDERS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{flag(name)}={getattr(self, name)!r} is not one of {choices}")
        if self.chunk_order == "balanced" and self.doc_mask != "on":
            raise ValueError("--chunk-order=balanced balances packed documents' attention work and needs "
                             f"--doc-mask on (got --doc-mask {self.doc_mask})")
        check_stages(self, steps)  # --seq-len-stages, --stage-tokens, and what they make of --steps, --seq-len
