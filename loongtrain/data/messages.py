"""The rows of a post-training corpus as TRL and the Hugging Face hub write them (docs/post-training.md#rows):
which forms a row may take, its messages and its ``tools``, checked and handed on as the user gave them.

A message is a dict with a string ``role``; every other field goes to the chat template unchanged
(``content``, ``tool_calls``, ``tool_call_id``, ``name``, ``reasoning_content``, ...), as
``tokenizer.apply_chat_template`` passes them. ``content`` may be a string, a list of text parts
(``{"type": "text", "text": ...}``) or absent (a turn of tool calls only). A row's ``tools`` (JSON schemas, or a
JSON string of them, as TRL reads them) go to the template as ``apply_chat_template(..., tools=...)`` passes them.
Rows of a saved Hugging Face dataset have the ``None`` values Arrow fills in for keys a message lacks removed
first (TRL's ``remove_none_values``). Errors name the row (``FILE:LINE`` or ``DATASET[i]``).

The forms (:func:`row_form`), TRL's dataset types (``--objective sft`` reads the first two, ``dpo`` the last two):

- ``messages``: ``{"messages": [...]}`` (conversational language modeling);
- ``prompt_completion``: ``{"prompt", "completion"}``, two strings (standard) or two message lists
  (conversational);
- ``preference``: ``{"prompt", "chosen", "rejected"}``, three strings or three message lists;
- ``implicit_preference``: ``{"chosen", "rejected"}``, whose prompt is their longest common start
  (:func:`split_implicit_prompt`, TRL's ``extract_prompt``).
"""

from __future__ import annotations

import json
from typing import Any

Message = dict[str, Any]
#: ``--loss-on``: which tokens of a conversation are targets (loongtrain/data/chat.py)
LOSS_ON = ("assistant", "all")
#: ``--on-long``: a conversation or pair longer than ``--seq-len`` is left out or refused
#: (loongtrain/data/whole_packing.py)
ON_LONG = ("drop", "error")

FORMS = {"messages": ("messages",), "prompt_completion": ("prompt", "completion"),
         "preference": ("prompt", "chosen", "rejected"), "implicit_preference": ("chosen", "rejected")}


def row_form(record: Any, allowed: tuple[str, ...]) -> str | None:
    """Which of the ``allowed`` forms (module docstring) ``record`` is (the one of most fields it holds); None
    for none of them."""
    keys = set(record) if isinstance(record, dict) else set()
    return next((form for form in sorted(allowed, key=lambda f: -len(FORMS[f])) if set(FORMS[form]) <= keys), None)


def fields_of(record: Any) -> str:
    """What a row holds, for an error: its sorted keys (or its type), and the hint for a plain-text row."""
    found = sorted(record) if isinstance(record, dict) else type(record).__name__
    return f"(the row holds {found}){'; plain text trains with --objective pretrain' if found == ['text'] else ''}"


def conversation_of(record: Any, where: str, field: str = "messages") -> list[Message]:
    """The ``field`` list of messages of one row, as given (each checked: :func:`check_message`); ValueError
    naming ``where`` when it is not a non-empty list of messages."""
    messages = record.get(field) if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: no {field!r} list of {{'role', 'content'}} messages {fields_of(record)}")
    return [check_message(m, where, f"{field}[{i}]") for i, m in enumerate(messages)]


def check_message(message: Any, where: str, name: str) -> Message:
    """``message`` when it is a message (module docstring); ValueError naming ``where`` and ``name``."""
    if not (isinstance(message, dict) and isinstance(message.get("role"), str)):
        raise ValueError(f"{where}: {name} is not a message with a string 'role': {str(message)[:80]}")
    content = message.get("content")
    if content is not None and not isinstance(content, str) and text_parts(content) is None:
        raise ValueError(f"{where}: {name}'s 'content' is neither a string nor a list of text parts "
                         f"({{'type': 'text', 'text': ...}}): {str(content)[:80]}")
    return message


def text_parts(content: Any) -> list[str] | None:
    """The texts of ``content`` when it is a list of text parts (``{"type": "text", "text": str}``); None
    otherwise (an image or any other part: loongtrain trains text models)."""
    if not isinstance(content, list):
        return None
    texts = [part.get("text") for part in content if isinstance(part, dict) and part.get("type") == "text"]
    return texts if len(texts) == len(content) and all(isinstance(t, str) for t in texts) else None


def content_text(message: Message) -> str:
    """A message's content as text: the string, or its text parts joined ('' when absent)."""
    content = message.get("content")
    return content if isinstance(content, str) else "".join(text_parts(content) or [])


def tools_of(record: Any, where: str) -> list[dict[str, Any]] | None:
    """A row's ``tools`` (None when it has none): a list of JSON schemas (dicts), or a JSON string of one;
    ValueError naming ``where`` otherwise."""
    tools = record.get("tools") if isinstance(record, dict) else None
    if tools is None:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: 'tools' is a string that is not JSON ({exc.msg})") from None
    if not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ValueError(f"{where}: 'tools' must be a list of JSON schemas (dicts), or a JSON string of one: "
                         f"{str(tools)[:80]}")
    return tools


def without_none(value: Any) -> Any:
    """``value`` with every ``None`` entry of its dicts removed, all the way down (the keys Arrow adds to the
    rows of a saved dataset for fields other rows have)."""
    if isinstance(value, dict):
        return {k: without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_none(v) for v in value]
    return value


def split_implicit_prompt(chosen: Any, rejected: Any, where: str) -> tuple[Any, Any, Any]:
    """``(prompt, chosen, rejected)`` of an implicit-prompt pair: the prompt is the longest common start of
    the two (characters of two strings, messages of two lists), as TRL's ``extract_prompt`` takes it (a space
    just before the first difference goes with the completions); ValueError naming ``where`` for mixed forms or
    a pair whose completions would be empty."""
    if not ((isinstance(chosen, str) and isinstance(rejected, str)) or
            (isinstance(chosen, list) and isinstance(rejected, list))):
        raise ValueError(f"{where}: 'chosen' and 'rejected' must both be strings or both lists of messages")
    size = min(len(chosen), len(rejected))
    if chosen == rejected:
        raise ValueError(f"{where}: 'chosen' and 'rejected' are the same: a pair needs two different completions")
    cut = next((i for i in range(size) if chosen[i] != rejected[i]), None)
    if cut is None:  # one is the start of the other: TRL's loop ends one short of the shorter
        cut = size - 1
    elif isinstance(chosen, str) and cut > 0 and chosen[cut - 1] == " ":
        cut -= 1
    if isinstance(chosen, list) and cut < 1:
        raise ValueError(f"{where}: 'chosen' and 'rejected' share no first message: an implicit-prompt pair of "
                         f"messages starts with the prompt they share")
    return chosen[:cut], chosen[cut:], rejected[cut:]
