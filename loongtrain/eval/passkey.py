"""``loongtrain eval --task passkey``: a random key hidden in filler, asked for at the end (docs/evaluation.md).

A prompt of length ``L`` is built from token ids, each piece tokenized once, so no tokenizer merge
across a boundary can shift the key::

    filler[:k] + NEEDLE_PREFIX + key + NEEDLE_SUFFIX + filler[k:] + QUESTION + key

``k = round(depth * filler_length)`` (depth 0: the needle opens the prompt; 1: it ends the filler); the
filler is a fixed text repeated, or the eval corpus's tokens. The key is ``key_digits`` decimal digits,
one token each (:func:`digit_ids` rejects a tokenizer that cannot do that), drawn from a generator seeded
by ``(seed, length, depth, trial)``, so every layout sees the same prompts. The sequence is ``L + 1``
tokens: ``input_ids`` the first ``L``, ``labels`` the last ``L``; the key's answer is the labels' last
``key_digits`` tokens. Scoring is ONE teacher-forced forward: a trial is correct when the argmax at each
answer position is the key's digit, which is exactly when greedy decoding after ``QUESTION`` would write
the key. No generation loop, so it runs sharded like training: each rank checks the answer tokens it
holds and one all-reduce sums the mismatches per trial.

Trials of one length share forwards: ``longest // length`` prompts a forward (rows of one batch), so no
forward holds more tokens than one prompt of the longest length (the memory of a single longest
prompt), and short prompts do not pay per-forward costs one at a time (docs/evaluation.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from loongtrain.eval.forward import all_reduce_sum, replica_batches, sharded_forward
from loongtrain.loss.chunked import chunked_token_losses
from loongtrain.parallel.mesh import Mesh

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE_PREFIX = "The pass key is "
NEEDLE_SUFFIX = ". Remember it. "
QUESTION = "What is the pass key? The pass key is "
#: the default key depths (``loongtrain eval --depths``; the in-loop task's) and digits of a key
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
KEY_DIGITS = 5


@dataclass(frozen=True)
class PasskeyTokens:
    """The prompt pieces as token ids: ``filler`` (repeated as needed), the needle's ``prefix`` and
    ``suffix``, the ``question``, and ``digits[d]``, the one token of digit ``d``."""

    filler: tuple[int, ...]
    prefix: tuple[int, ...]
    suffix: tuple[int, ...]
    question: tuple[int, ...]
    digits: tuple[int, ...]

    def overhead(self, key_digits: int) -> int:
        """Tokens of a prompt that are not filler (the needle, the question, the answer)."""
        return len(self.prefix) + len(self.suffix) + len(self.question) + 2 * key_digits


def digit_ids(tokenizer) -> tuple[int, ...]:
    """The token of each digit 0-9; ValueError naming the tokenizer and the digit when a digit is not exactly
    one token that decodes back to it."""
    out = []
    for d in range(10):
        ids = tokenizer.encode(str(d))
        if len(ids) != 1 or tokenizer.decode(ids).strip() != str(d):
            raise ValueError(f"tokenizer {tokenizer.name!r} cannot encode the key's digit {str(d)!r} as one token "
                             f"(it gives ids {ids}); passkey needs one token per digit")
        out.append(ids[0])
    return tuple(out)


def passkey_tokens(tokenizer, filler: Sequence[int] | None = None) -> PasskeyTokens:
    """Tokenize the pieces once; ``filler``: token ids to use as filler (default: :data:`FILLER` tokenized)."""
    filler_ids = tuple(int(t) for t in (filler if filler is not None else tokenizer.encode(FILLER)))
    if not filler_ids:
        raise ValueError("passkey: the filler has no tokens")
    return PasskeyTokens(filler_ids, tuple(tokenizer.encode(NEEDLE_PREFIX)), tuple(tokenizer.encode(NEEDLE_SUFFIX)),
                         tuple(tokenizer.encode(QUESTION)), digit_ids(tokenizer))


def draw_key(seed: int, length: int, depth_index: int, trial: int, key_digits: int) -> list[int]:
    """The key (digits) of one trial: a generator seeded by the trial's cell, independent of the layout."""
    gen = torch.Generator().manual_seed(((seed * 1_000_003 + length) * 101 + depth_index) * 1009 + trial)
    digits = torch.randint(0, 10, (key_digits,), generator=gen).tolist()
    digits[0] = 1 + digits[0] % 9  # no leading zero
    return digits


def build_prompt(tokens: PasskeyTokens, length: int, depth: float, key: Sequence[int]) -> dict[str, torch.Tensor]:
    """The ``[1, length]`` batch of one trial (``input_ids``, ``labels``, ``position_ids``) and
    ``answer [K]``, the label positions of the key's digits. ValueError when ``length`` cannot hold the
    needle, question and answer."""
    key_ids = [tokens.digits[d] for d in key]
    room = length + 1 - tokens.overhead(len(key))
    if room < 0:
        raise ValueError(f"passkey length {length} is shorter than its needle, question and answer "
                         f"({tokens.overhead(len(key)) - 1} tokens)")
    repeats = -(-room // len(tokens.filler))
    filler = (list(tokens.filler) * repeats)[:room]
    cut = round(depth * room)
    seq = (filler[:cut] + list(tokens.prefix) + key_ids + list(tokens.suffix) + filler[cut:]
           + list(tokens.question) + key_ids)
    assert len(seq) == length + 1
    ids = torch.tensor(seq, dtype=torch.int64)
    return {"input_ids": ids[None, :-1], "labels": ids[None, 1:], "position_ids": torch.arange(length)[None],
            "answer": torch.arange(length - len(key), length)}


@dataclass(frozen=True)
class Trial:
    length: int
    depth: float
    depth_index: int
    trial: int


def grid(lengths: Sequence[int], depths: Sequence[float], trials: int) -> list[Trial]:
    return [Trial(L, d, i, t) for L in lengths for i, d in enumerate(depths) for t in range(trials)]


def passkey(model: nn.Module, tokens: PasskeyTokens, lengths: Sequence[int], depths: Sequence[float], trials: int,
            mesh: Mesh, device: torch.device, *, key_digits: int = 5, seed: int = 0, **forward: Any) -> list[dict]:
    """``[{length, depth, trials, correct, digits_correct, digits}]`` per cell of the grid (collective).
    Replica ``d`` evaluates every ``dp``-th trial of each length, ``max(lengths) // length`` prompts a
    forward; each rank scores only the answer tokens it holds. ``forward``: the sharded forward's options
    (:func:`~loongtrain.eval.forward.sharded_forward`: ``amp_dtype``)."""
    cells = grid(lengths, depths, trials)
    wrong = torch.zeros(len(cells), dtype=torch.float64, device=device)  # mismatching digits per trial
    longest = max(lengths)
    for length in dict.fromkeys(lengths):
        items = [i for i, cell in enumerate(cells) if cell.length == length]
        for group in replica_batches(items, longest // length, mesh):
            prompts = [_prompt(tokens, cells[i], seed, key_digits) for i in group or items[:1]]
            batch = {name: torch.cat([p[name] for p in prompts]) for name in ("input_ids", "labels", "position_ids")}
            local = sharded_forward(model, batch, mesh, device, **forward)  # amp_dtype
            mine = torch.isin(local.index, prompts[0]["answer"].to(device))  # answer tokens on this rank
            if not group or not bool(mine.any()):  # an empty group only keeps the collectives in step
                continue
            _, argmax = chunked_token_losses(local.hidden[:, mine], local.head, local.labels[:, mine])
            wrong[torch.tensor(group, device=device)] += (argmax != local.labels[:, mine]).sum(dim=1).to(torch.float64)
    wrong = all_reduce_sum(wrong).cpu()
    return _cells(cells, wrong.tolist(), key_digits)


def _prompt(tokens: PasskeyTokens, cell: Trial, seed: int, key_digits: int) -> dict[str, torch.Tensor]:
    key = draw_key(seed, cell.length, cell.depth_index, cell.trial, key_digits)
    return build_prompt(tokens, cell.length, cell.depth, key)


def _cells(cells: list[Trial], wrong: list[float], key_digits: int) -> list[dict]:
    table: dict[tuple[int, int], dict] = {}
    for cell, w in zip(cells, wrong):
        row = table.setdefault((cell.length, cell.depth_index), {
            "length": cell.length, "depth": cell.depth, "trials": 0, "correct": 0, "digits_correct": 0, "digits": 0})
        row["trials"] += 1
        row["correct"] += int(w == 0)
        row["digits_correct"] += key_digits - int(w)
        row["digits"] += key_digits
    return list(table.values())
