"""Preference pairs for ``--objective dpo`` (docs/post-training.md): rows of ``.jsonl`` files, directories of
them, a saved Hugging Face dataset or a corpus prepared with ``loongtrain prepare --objective dpo``, in TRL's
preference forms (:mod:`loongtrain.data.messages`): ``{"prompt", "chosen", "rejected"}``, or ``{"chosen",
"rejected"}`` with an implicit prompt (their longest common start, TRL's ``extract_prompt``), each field a string
or a list of messages (and the row's ``tools``).

Tokenization is TRL's (``DPOTrainer.tokenize_row`` for decoder-only models): the prompt and each completion
are tokenized on their own as text, without special tokens, and the tokenizer's EOS is appended to each
completion. The conversational form is first rendered to text with the chat template
(:class:`~loongtrain.data.chat.ChatFormat`, with the row's ``tools``), as TRL's ``maybe_apply_chat_template``
does: the prompt with the generation prompt when its last message is not the assistant's, each completion as
``render(prompt + completion)`` past the prompt's text (the prompt cut to the common prefix of the three
texts where a template renders them differently).

A pair is a unit of two documents, ``prompt + chosen`` and ``prompt + rejected``, packed whole
(:func:`~loongtrain.data.whole_packing.pack_whole`, ``2 * |prompt| + |chosen| + |rejected|`` tokens):
the prompt is in the row twice (no prefix sharing: docs/post-training.md#prefix-sharing). Only
completion tokens are targets; ``segment`` numbers the row's sequences (``2k`` chosen, ``2k + 1``
rejected of its ``k``-th pair), ``num_pairs`` counts its pairs and ``ref_key`` names the row for the
reference log-probabilities' cache (the row's index; ``-1 - index`` for a held-out validation set).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from loongtrain.data.chat import ChatFormat, read_template
from loongtrain.data.messages import Message, conversation_of, fields_of, row_form, split_implicit_prompt, tools_of
from loongtrain.data.prepared import is_prepared_dir
from loongtrain.data.prepared_rows import RowEncoder, open_prepared_rows
from loongtrain.data.rows import read_rows
from loongtrain.data.split import selected
from loongtrain.data.tokenizer import Tokenizer
from loongtrain.data.whole_packing import EncodedDocs, build_row, concat_docs, pack_whole

DPO = "dpo"
WHAT = "--objective dpo"
FIELDS = ("prompt", "chosen", "rejected")
FORMS = ("preference", "implicit_preference")


def pair_chat(tokenizer: Tokenizer, chat_template: str = "") -> ChatFormat | None:
    """DPO's chat format: the template's (conversational pairs need it), None when there is none."""
    return ChatFormat(tokenizer, chat_template, "all") if read_template(tokenizer, chat_template) is not None else None


def pair_parts(record: Any, where: str) -> tuple[Any, Any, Any, list[dict[str, Any]] | None]:
    """``(prompt, chosen, rejected, tools)`` of one preference row in either form (module docstring), checked:
    three strings or three lists of messages; ValueError naming ``where`` otherwise."""
    form = row_form(record, FORMS)
    if form is None:
        raise ValueError(f"{where}: a preference row needs 'prompt', 'chosen' and 'rejected' (or 'chosen' and "
                         f"'rejected' with the prompt they share) {fields_of(record)}")
    tools = tools_of(record, where)
    if form == "implicit_preference":
        parts = split_implicit_prompt(record["chosen"], record["rejected"], where)
    else:
        parts = tuple(record[f] for f in FIELDS)
    if all(isinstance(p, str) for p in parts):
        return (*parts, tools)
    if not all(isinstance(p, list) for p in parts):
        raise ValueError(f"{where}: 'prompt', 'chosen' and 'rejected' must all be strings or all lists of messages")
    prompt, chosen, rejected = (conversation_of({f: p}, where, f) for f, p in zip(FIELDS, parts))
    return prompt, chosen, rejected, tools


def pair_texts(record: Any, where: str, chat: ChatFormat | None) -> tuple[str, str, str]:
    """``(prompt, chosen, rejected)`` as text (module docstring); ValueError naming ``where`` for a row of
    another form, mixed forms, or messages without a chat template."""
    prompt, chosen, rejected, tools = pair_parts(record, where)
    if isinstance(prompt, str):
        return prompt, chosen, rejected
    if chat is None or chat.template is None:
        raise ValueError(f"{where}: conversational pairs need a chat template: the tokenizer has none; pass "
                         f"--chat-template FILE")
    head, (chosen_text, rejected_text) = conversational_texts(chat, prompt, [chosen, rejected], where, tools)
    return head, chosen_text, rejected_text


def conversational_texts(chat: ChatFormat, prompt: list[Message], completions: list[list[Message]],
                         where: str, tools: list[dict[str, Any]] | None = None) -> tuple[str, list[str]]:
    """The text form of a conversational prompt and its completions (module docstring; DPO's pair, GRPO's
    rollout), the row's ``tools`` rendered with each: ``(prompt_text, [completion_text, ...])``."""
    head = chat.render(prompt, where, add_generation_prompt=prompt[-1]["role"] != "assistant", tools=tools)[0]
    full = [chat.render(prompt + completion, where, tools=tools)[0] for completion in completions]
    common = len(os.path.commonprefix([head, *full]))
    return head[:common], [text[common:] for text in full]


def tokenize_pair(tokenizer: Tokenizer, prompt: str, chosen: str, rejected: str) -> tuple[np.ndarray, ...]:
    """TRL's tokenization (module docstring): ``(prompt_ids, chosen_ids + [eos], rejected_ids + [eos])``."""
    eos = [tokenizer.eos_id]
    return (np.asarray(tokenizer.encode(prompt), dtype=np.int64),
            np.asarray(tokenizer.encode(chosen) + eos, dtype=np.int64),
            np.asarray(tokenizer.encode(rejected) + eos, dtype=np.int64))


class PairRows(RowEncoder):
    """``--objective dpo``'s rows for ``loongtrain prepare`` (:mod:`loongtrain.data.prepared_rows`): three
    documents a pair, TRL's tokenization."""

    prepared_for, documents = DPO, 3

    def __init__(self, tokenizer: Tokenizer, chat: ChatFormat | None) -> None:
        self.tokenizer, self.chat = tokenizer, chat

    def check(self, row: Any, where: str) -> None:
        pair_parts(row, where)

    def encode(self, row: Any, where: str) -> list[tuple[np.ndarray, np.ndarray | None]]:
        return [(ids, None) for ids in tokenize_pair(self.tokenizer, *pair_texts(row, where, self.chat))]


def encode_pairs(spec: str, tokenizer: Tokenizer, chat: ChatFormat | None,
                 decode_errors: str = "strict") -> EncodedDocs:
    """Every row's pair tokenized: three documents a pair (prompt, chosen, rejected)."""
    rows = PairRows(tokenizer, chat)
    pieces = [doc for where, row in read_rows(spec, WHAT, decode_errors) for doc in rows.encode(row, where)]
    if not pieces:
        raise ValueError(f"corpus {spec!r} holds no rows")
    return concat_docs(pieces)


def open_pairs(spec: str, tokenizer: Tokenizer, chat: ChatFormat | None, *, val_fraction: float = 0.0,
               seed: int = 0, part: str = "all", decode_errors: str = "strict") -> EncodedDocs:
    """The pairs of ``spec`` (raw rows or prepared), ``part`` of the split by ``val_fraction`` (by pair
    number)."""
    docs = (open_prepared_rows(spec, PairRows(tokenizer, chat)) if is_prepared_dir(spec)
            else encode_pairs(spec, tokenizer, chat, decode_errors))
    pairs = selected(docs.num_documents // 3, val_fraction, seed, part)
    return docs if pairs is None else docs.select((3 * pairs[:, None] + np.arange(3)).reshape(-1))


class PreferenceDataset:
    """Rows of whole pairs (module docstring); index ``i`` past the last row wraps around (epochs).
    ``held_out``: the rows' ``ref_key`` is ``-1 - index`` (a validation set beside the training rows)."""

    def __init__(self, docs: EncodedDocs, seq_len: int, pad_id: int, name: str, on_long: str = "drop",
                 held_out: bool = False) -> None:
        self.docs, self.seq_len, self.pad_id, self.name, self.held_out = docs, seq_len, pad_id, name, held_out
        lengths = docs.lengths().reshape(-1, 3)
        self.units = 2 * lengths[:, 0] + lengths[:, 1] + lengths[:, 2]
        self.rows, self.dropped = pack_whole(self.units, seq_len, on_long, "preference pairs")
        self.max_pairs = max((len(r) for r in self.rows), default=0)

    def num_samples(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        index %= len(self.rows)
        docs, segments = [], []
        for k, pair in enumerate(self.rows[index].tolist()):
            prompt = self.docs.ids(3 * pair)
            for s, completion in enumerate((self.docs.ids(3 * pair + 1), self.docs.ids(3 * pair + 2))):
                marks = np.concatenate([np.zeros(len(prompt), bool), np.ones(len(completion), bool)])
                docs.append((np.concatenate([prompt, completion]), marks))
                segments.append(2 * k + s)
        row = build_row(docs, self.seq_len, self.pad_id, segments)
        row["num_pairs"] = torch.tensor(len(self.rows[index]), dtype=torch.int64)
        row["ref_key"] = torch.tensor(-1 - index if self.held_out else index, dtype=torch.int64)
        return row

    def has_targets(self) -> bool:
        """Whether any pair is packed (each completion holds its EOS at least: a target)."""
        return bool(self.rows)

    def summary(self) -> str:
        kept = len(self.units) - self.dropped
        return (f"{kept} preference pairs in {len(self.rows)} rows of {self.seq_len} tokens (at most "
                f"{self.max_pairs} a row)" + (f"; {self.dropped} longer than --seq-len left out (--on-long drop)"
                                               if self.dropped else ""))
