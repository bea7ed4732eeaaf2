"""Rollouts for ``--objective grpo`` (docs/rl.md): rows ``{"prompt", "completion", "reward"}`` of ``.jsonl``
files, in TRL's standard (strings) or conversational (lists of messages) form, and the rows the online loop
generates.

Optional per row: ``"group"`` (rows with the same group are one GRPO group; default: rows with the same
prompt), ``"advantage"`` (used as given: then every row of its group gives one), ``"old_logps"`` (the
behaviour policy's log-probability of each completion token, EOS included). Tokenization is DPO's (TRL's
``tokenize_row``): prompt and completion on their own, without special tokens, EOS after the completion;
the conversational form rendered with the chat template first (loongtrain/data/preference.py). The online
loop hands over generated token ids as they are (:class:`Rollout`).

Advantages are TRL's (:func:`group_advantages`): ``(r - mean_group) / (std + 1e-4)`` with the unbiased std
of the group (``--grpo-scale-rewards group``), of the whole batch (``batch``: for a rollout file, the file),
or no division (``none``), computed over the rollouts before they are packed, so they do not depend on how
rows, micro-steps and ranks split a group.

Rollouts are packed whole (``|prompt| + |completion|`` tokens, one document each, in order) into rows of
``--seq-len``; only completion tokens are targets. A row holds ``segment [S]`` (the row's sequence number
at each completion label, else -1), per sequence slot ``[n]``: ``advantages``, ``rewards``, ``lengths``
(completion tokens), ``std_zero`` (its group's reward spread is zero), and ``old_logps [S]`` at the labels
when the rollouts carry them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from loongtrain.data.chat import ChatFormat
from loongtrain.data.messages import conversation_of
from loongtrain.data.preference import conversational_texts
from loongtrain.data.rows import read_rows
from loongtrain.data.tokenizer import Tokenizer
from loongtrain.data.whole_packing import build_row, pack_whole

GRPO = "grpo"
WHAT = "--objective grpo"
SCALE_REWARDS = ("group", "batch", "none")
#: TRL's constant in the advantage's denominator
STD_EPS = 1e-4


@dataclass(frozen=True)
class Rollout:
    """One completion of a prompt: token ids (the completion's with its EOS, if it ended), its reward, its
    group, and optionally its advantage and the behaviour policy's log-probabilities; ``where`` names it."""

    prompt_ids: np.ndarray
    completion_ids: np.ndarray
    reward: float
    group: str
    where: str
    advantage: float | None = None
    old_logps: np.ndarray | None = None
    std_zero: bool = False

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


def _number(record: dict, key: str, where: str) -> float:
    value = record[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where}: {key!r} must be a finite number, got {json.dumps(value)[:60]}")
    return float(value)


def rollout_texts(record: Any, where: str, chat: ChatFormat | None) -> tuple[str, str]:
    """``(prompt, completion)`` as text; ValueError naming ``where`` for a row without them, mixed forms, or
    messages without a chat template."""
    if not isinstance(record, dict) or any(f not in record for f in ("prompt", "completion", "reward")):
        found = sorted(record) if isinstance(record, dict) else type(record).__name__
        hint = "; prompts alone train online: --prompts FILE --reward ..." if found == ["prompt"] else ""
        raise ValueError(f"{where}: a rollout row needs 'prompt', 'completion' and 'reward' (the row holds "
                         f"{found}){hint}")
    prompt, completion = record["prompt"], record["completion"]
    if isinstance(prompt, str) and isinstance(completion, str):
        return prompt, completion
    if not (isinstance(prompt, list) and isinstance(completion, list)):
        raise ValueError(f"{where}: 'prompt' and 'completion' must both be strings or both lists of messages")
    if chat is None or chat.template is None:
        raise ValueError(f"{where}: conversational rollouts need a chat template: the tokenizer has none; pass "
                         f"--chat-template FILE")
    head, (text,) = conversational_texts(chat, conversation_of(record, where, "prompt"),
                                         [conversation_of(record, where, "completion")], where)
    return head, text


def rollout_of(record: Any, where: str, tokenizer: Tokenizer, chat: ChatFormat | None) -> Rollout:
    """One rollout row tokenized (module docstring); ValueError naming ``where`` for a bad field."""
    prompt, completion = rollout_texts(record, where, chat)
    reward = _number(record, "reward", where)
    if "group" in record:
        group = record["group"]
        if isinstance(group, bool) or not isinstance(group, (str, int)):
            raise ValueError(f"{where}: 'group' must be a string or an integer, got {json.dumps(group)[:60]}")
        key = f"group {group!r}"
    else:
        key = "prompt " + json.dumps(record["prompt"], sort_keys=True)
    advantage = _number(record, "advantage", where) if "advantage" in record else None
    prompt_ids = np.asarray(tokenizer.encode(prompt), dtype=np.int64)
    completion_ids = np.asarray(tokenizer.encode(completion) + [tokenizer.eos_id], dtype=np.int64)
    old = None
    if "old_logps" in record:
        values = record["old_logps"]
        if (not isinstance(values, list) or any(isinstance(v, bool) or not isinstance(v, (int, float))
                                                or not math.isfinite(v) or v > 0 for v in values)):
            raise ValueError(f"{where}: 'old_logps' must be a list of finite log-probabilities (numbers <= 0)")
        if len(values) != len(completion_ids):
            raise ValueError(f"{where}: 'old_logps' has {len(values)} values, the completion {len(completion_ids)} "
                             f"tokens (its tokens and EOS, tokenized as TRL does)")
        old = np.asarray(values, dtype=np.float64)
    return Rollout(prompt_ids, completion_ids, reward, key, where, advantage, old)


def read_rollouts(spec: str, tokenizer: Tokenizer, chat: ChatFormat | None,
                  decode_errors: str = "strict") -> list[Rollout]:
    """Every row of ``spec`` tokenized, in order."""
    rollouts = [rollout_of(row, where, tokenizer, chat) for where, row in read_rows(spec, WHAT, decode_errors)]
    if not rollouts:
        raise ValueError(f"corpus {spec!r} holds no rows")
    with_old = [r.old_logps is not None for r in rollouts]
    if any(with_old) and not all(with_old):
        bad = rollouts[with_old.index(not with_old[0])]
        raise ValueError(f"{bad.where}: {'has' if bad.old_logps is not None else 'has no'} 'old_logps', unlike "
                         f"{rollouts[0].where}: give them in every row or in none")
    return rollouts


def _unbiased_std(values: np.ndarray) -> float:
    return float(np.std(values, ddof=1)) if len(values) > 1 else 0.0


def group_advantages(rewards: Sequence[float], groups: Sequence[Any], scale: str) -> tuple[np.ndarray, np.ndarray]:
    """TRL's advantages (module docstring) of ``rewards`` grouped by ``groups`` (any hashable keys, groups of
    any size and order): ``(advantages, std_zero)``, float64 and bool per reward. ``std_zero``: the std
    the advantage is divided by (the group's for ``group`` and ``none``, the batch's for ``batch``) is 0."""
    if scale not in SCALE_REWARDS:
        raise ValueError(f"--grpo-scale-rewards {scale!r}: choose one of {', '.join(SCALE_REWARDS)}")
    r = np.asarray(rewards, dtype=np.float64)
    members: dict[Any, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    mean, std = np.zeros_like(r), np.zeros_like(r)
    for index in members.values():
        mean[index] = r[index].mean()
        std[index] = _unbiased_std(r[index])
    if scale == "batch":
        std[:] = _unbiased_std(r)
    advantages = r - mean
    if scale != "none":
        advantages = advantages / (std + STD_EPS)
    return advantages, np.isclose(std, 0.0)


def with_advantages(rollouts: Sequence[Rollout], scale: str) -> list[Rollout]:
    """The rollouts with their advantages: as given (every row of such a group gives one), else
    :func:`group_advantages`; ValueError naming the row for a group of one without advantages, or a group
    whose rows give advantages only in part."""
    given: dict[str, bool] = {}
    sizes: dict[str, int] = {}
    for r in rollouts:
        if given.setdefault(r.group, r.advantage is not None) != (r.advantage is not None):
            raise ValueError(f"{r.where}: {'gives' if r.advantage is not None else 'gives no'} 'advantage', unlike "
                             f"the other rows of its group: give one in every row of a group or in none")
        sizes[r.group] = sizes.get(r.group, 0) + 1
    for r in rollouts:
        if not given[r.group] and sizes[r.group] < 2:
            raise ValueError(f"{r.where}: its group has one completion: GRPO's advantage compares a group's "
                             f"completions of one prompt (give each prompt several, a 'group', or an 'advantage')")
    advantages, std_zero = group_advantages([r.reward for r in rollouts], [r.group for r in rollouts], scale)
    return [replace(r, advantage=r.advantage if given[r.group] else float(a), std_zero=bool(z))
            for r, a, z in zip(rollouts, advantages, std_zero)]


def check_lengths(rollouts: Sequence[Rollout], seq_len: int) -> None:
    """ValueError naming the first rollout longer than ``seq_len`` (GRPO drops none: a group must stay whole)."""
    for r in rollouts:
        if r.length > seq_len:
            raise ValueError(f"{r.where}: prompt + completion is {r.length} tokens ({len(r.prompt_ids)} + "
                             f"{len(r.completion_ids)}), more than --seq-len {seq_len}: raise --seq-len")


class RolloutDataset:
    """Rows of whole rollouts (module docstring); index ``i`` past the last row wraps around (epochs).
    ``rows``: the packing (default: :func:`~loongtrain.data.whole_packing.pack_whole` in order);
    ``max_sequences``: the per-sequence slots of every row (default: the most any row holds)."""

    def __init__(self, rollouts: Sequence[Rollout], seq_len: int, pad_id: int, name: str,
                 rows: list[np.ndarray] | None = None, max_sequences: int | None = None) -> None:
        check_lengths(rollouts, seq_len)
        assert all(r.advantage is not None for r in rollouts), "advantages first (with_advantages)"
        self.rollouts, self.seq_len, self.pad_id, self.name = list(rollouts), seq_len, pad_id, name
        if rows is None:
            rows = pack_whole(np.array([r.length for r in rollouts], dtype=np.int64), seq_len, "error",
                              "completions")[0]
        self.rows = rows
        self.max_sequences = max_sequences or max((len(r) for r in rows), default=1)
        self.with_old = bool(rollouts) and rollouts[0].old_logps is not None

    def num_samples(self) -> int:
        return len(self.rows)

    def has_targets(self) -> bool:
        """Whether any rollout is packed (its completion's tokens are the targets)."""
        return bool(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        members = [self.rollouts[i] for i in self.rows[index % len(self.rows)].tolist()] if self.rows else []
        docs = [(np.concatenate([r.prompt_ids, r.completion_ids]),
                 np.concatenate([np.zeros(len(r.prompt_ids), bool), np.ones(len(r.completion_ids), bool)]))
                for r in members]
        row = build_row(docs, self.seq_len, self.pad_id, list(range(len(members))))
        n = self.max_sequences
        assert len(members) <= n, "a row holds at most max_sequences rollouts"
        fill = [[r.advantage, r.reward, len(r.completion_ids), r.std_zero] for r in members]
        fill += [[0.0, 0.0, 0, False]] * (n - len(members))
        columns = list(zip(*fill))
        row["advantages"] = torch.tensor(columns[0], dtype=torch.float64)
        row["rewards"] = torch.tensor(columns[1], dtype=torch.float64)
        row["lengths"] = torch.tensor(columns[2], dtype=torch.int64)
        row["std_zero"] = torch.tensor(columns[3], dtype=torch.bool)
        row["num_sequences"] = torch.tensor(len(members), dtype=torch.int64)
        if self.with_old:
            old = torch.zeros(self.seq_len, dtype=torch.float64)
            for k, r in enumerate(members):
                old[row["segment"] == k] = torch.from_numpy(r.old_logps)
            row["old_logps"] = old
        return row

    def summary(self) -> str:
        groups = len({r.group for r in self.rollouts})
        return (f"{len(self.rollouts)} completions of {groups} groups in {len(self.rows)} rows of {self.seq_len} "
                f"tokens (at most {self.max_sequences} a row)")


@dataclass(frozen=True)
class PromptRow:
    """A row of ``--prompts``: its prompt as given (text or messages), its tokens, its other columns."""

    prompt: Any
    ids: np.ndarray
    columns: dict[str, Any]
    where: str

    @property
    def conversational(self) -> bool:
        return isinstance(self.prompt, list)


def read_prompts(spec: str, tokenizer: Tokenizer, chat: ChatFormat | None,
                 decode_errors: str = "strict") -> list[PromptRow]:
    """The rows ``{"prompt": ..., other columns}`` of ``spec``: a text prompt tokenized as it is (no special
    tokens), a conversational one rendered with the generation prompt first (TRL's rule); ValueError naming
    the row otherwise."""
    rows = []
    for where, record in read_rows(spec, "--prompts", decode_errors):
        if not isinstance(record, dict) or "prompt" not in record:
            found = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise ValueError(f"{where}: a --prompts row needs 'prompt' (the row holds {found})")
        prompt = record["prompt"]
        if isinstance(prompt, list):
            if chat is None or chat.template is None:
                raise ValueError(f"{where}: conversational prompts need a chat template: the tokenizer has none; "
                                 f"pass --chat-template FILE")
            messages = conversation_of(record, where, "prompt")
            text = chat.render(messages, where, add_generation_prompt=messages[-1]["role"] != "assistant")[0]
        elif isinstance(prompt, str):
            text = prompt
        else:
            raise ValueError(f"{where}: 'prompt' must be a string or a list of messages, got {type(prompt).__name__}")
        ids = np.asarray(tokenizer.encode(text), dtype=np.int64)
        if not len(ids):
            raise ValueError(f"{where}: the prompt has no tokens")
        columns = {k: v for k, v in record.items() if k not in ("prompt", "completion", "completion_ids")}
        rows.append(PromptRow(prompt, ids, columns, where))
    if not rows:
        raise ValueError(f"--prompts {spec!r} holds no rows")
    return rows


def rows_fit(longest_prompt: int, max_completion_length: int, completions: int, rows: int, seq_len: int) -> str | None:
    """Why a step's ``completions`` (prompts up to ``longest_prompt`` tokens, completions up to
    ``max_completion_length``) might not pack whole into ``rows`` rows of ``seq_len`` (None: they always do:
    every row then holds ``ceil(completions / rows)`` of the longest, so in-order packing needs at most
    ``rows``)."""
    per_row = -(-completions // rows)
    need = per_row * (longest_prompt + max_completion_length)
    if need <= seq_len:
        return None
    return (f"a step's {completions} completions ({longest_prompt} prompt + {max_completion_length} completion tokens "
            f"at most) take {per_row} a row in its {rows} rows (dp x --batch-size x --grad-accum), {need} tokens, "
            f"more than --seq-len {seq_len}: raise --seq-len to {need}, --batch-size or --grad-accum, or lower "
            f"--generation-batch-size or --max-completion-length")
