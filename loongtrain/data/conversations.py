"""Conversations for ``--objective sft`` (docs/post-training.md): rows of ``.jsonl`` files, directories of them, a
saved Hugging Face dataset, or a corpus prepared with ``loongtrain prepare --objective sft``, in TRL's SFT forms
(:mod:`loongtrain.data.messages`): ``{"messages": [...]}`` (and ``tools``), or ``{"prompt", "completion"}`` (two
strings, or two message lists), encoded by the run's :class:`~loongtrain.data.chat.ChatFormat` and packed whole
into rows of ``--seq-len`` (:mod:`loongtrain.data.whole_packing`).

The prepared form (:mod:`loongtrain.data.prepared_rows`, :class:`SFTRows`) stores each row's tokens as they are,
without an EOS between them, and its target marks beside them.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from loongtrain.data.chat import ChatFormat
from loongtrain.data.messages import conversation_of, fields_of, row_form, tools_of
from loongtrain.data.prepared import is_prepared_dir
from loongtrain.data.prepared_rows import RowEncoder, open_prepared_rows
from loongtrain.data.rows import read_rows
from loongtrain.data.split import selected
from loongtrain.data.tokenizer import Tokenizer
from loongtrain.data.whole_packing import EncodedDocs, build_row, concat_docs, pack_whole

log = logging.getLogger("loongtrain.train")

SFT = "sft"
WHAT = "--objective sft"


FORMS = ("messages", "prompt_completion")


def check_row(row: Any, where: str) -> tuple[str, Any, Any, Any]:
    """``(form, first, second, tools)`` of one SFT row, checked (module docstring): ``("messages", messages,
    None, tools)`` or ``("prompt_completion", prompt, completion, tools)``; ValueError naming ``where``."""
    form = row_form(row, FORMS)
    if form is None:
        raise ValueError(f"{where}: no 'messages' list of {{'role', 'content'}} messages, nor a 'prompt' and a "
                         f"'completion' {fields_of(row)}")
    tools = tools_of(row, where)
    if form == "messages":
        return form, conversation_of(row, where), None, tools
    prompt, completion = row["prompt"], row["completion"]
    if isinstance(prompt, list) and isinstance(completion, list):
        prompt, completion = conversation_of(row, where, "prompt"), conversation_of(row, where, "completion")
    elif not (isinstance(prompt, str) and isinstance(completion, str)):
        raise ValueError(f"{where}: 'prompt' and 'completion' must both be strings or both lists of messages")
    return form, prompt, completion, tools


def encode_row(chat: ChatFormat, row: Any, where: str) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, targets)`` of one SFT row in either form (module docstring); ValueError naming ``where``."""
    form, first, second, tools = check_row(row, where)
    if form == "messages":
        return chat.encode(first, where, tools)
    return chat.encode_completion(first, second, where, tools)


def encode_conversations(spec: str, chat: ChatFormat, decode_errors: str = "strict") -> EncodedDocs:
    """Every row encoded (ValueError naming ``FILE:LINE`` for a bad row)."""
    docs = [encode_row(chat, row, where) for where, row in read_rows(spec, WHAT, decode_errors)]
    if not docs:
        raise ValueError(f"corpus {spec!r} holds no rows")
    return concat_docs(docs)


def open_conversations(spec: str, tokenizer: Tokenizer, chat: ChatFormat, *, val_fraction: float = 0.0,
                       seed: int = 0, part: str = "all", decode_errors: str = "strict") -> EncodedDocs:
    """The conversations of ``spec`` (raw rows or prepared), ``part`` of the split by ``val_fraction``
    (:mod:`loongtrain.data.split`, by conversation number)."""
    docs = (open_prepared_rows(spec, SFTRows(chat)) if is_prepared_dir(spec)
            else encode_conversations(spec, chat, decode_errors))
    return docs.select(selected(docs.num_documents, val_fraction, seed, part))


class ConversationDataset:
    """Rows of whole conversations (:func:`~loongtrain.data.whole_packing.pack_whole` in corpus order);
    index ``i`` past the last row wraps around (epochs)."""

    def __init__(self, docs: EncodedDocs, seq_len: int, pad_id: int, name: str, on_long: str = "drop") -> None:
        self.docs, self.seq_len, self.pad_id, self.name = docs, seq_len, pad_id, name
        lengths = docs.lengths()
        self.rows, self.dropped = pack_whole(lengths, seq_len, on_long, "conversations")
        self.tokens = int(lengths[lengths <= seq_len].sum())

    def num_samples(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = self.rows[index % len(self.rows)]
        return build_row([(self.docs.ids(int(d)), self.docs.marks(int(d))) for d in row], self.seq_len, self.pad_id)

    def has_targets(self) -> bool:
        """Whether any packed conversation holds a target token that a label reaches (a document's first token
        is predicted by nothing); stops at the first one found."""
        return any(self.docs.marks(int(d))[1:].any() for row in self.rows for d in row)

    def summary(self) -> str:
        kept = self.docs.num_documents - self.dropped
        return (f"{kept} conversations in {len(self.rows)} rows of {self.seq_len} tokens "
                f"({self.tokens / max(1, len(self.rows) * self.seq_len):.0%} filled)"
                + (f"; {self.dropped} longer than --seq-len left out (--on-long drop)" if self.dropped else ""))


class SFTRows(RowEncoder):
    """``--objective sft``'s rows for ``loongtrain prepare`` (:mod:`loongtrain.data.prepared_rows`): a document
    each, with its targets."""

    prepared_for, documents = SFT, 1

    def __init__(self, chat: ChatFormat) -> None:
        self.chat, self.tokenizer = chat, chat.tokenizer

    def check(self, row: Any, where: str) -> None:
        check_row(row, where)

    def encode(self, row: Any, where: str) -> list[tuple[np.ndarray, np.ndarray | None]]:
        return [encode_row(self.chat, row, where)]
