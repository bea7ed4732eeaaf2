"""Chat templates and target masks for supervised fine-tuning on conversations (docs/post-training.md).

A conversation is a list of messages as TRL and the HF hub write them (:mod:`loongtrain.data.messages`: every
field of a message, and the row's ``tools``, reach the template as ``apply_chat_template`` passes them). It is
rendered to text by the tokenizer's own Jinja chat template (``chat_template.jinja`` or the ``chat_template`` of
``tokenizer_config.json`` beside the tokenizer; ``--chat-template FILE`` instead), with Hugging Face's renderer
(``transformers.utils.chat_template_utils.render_jinja_template``, the one ``apply_chat_template`` uses, with the
tokenizer's special tokens as variables), and the text is tokenized by the run's tokenizer (no special tokens
added, as ``apply_chat_template`` does). The template is compiled when the format is made, so a syntax error
names the template (its file and line), not a row. Which tokens are targets (:class:`ChatFormat`, its ``rule``,
logged once per run):

- ``generation``: the template has ``{% generation %}`` blocks: the tokens inside them, mapped from
  characters to tokens as HF's ``return_assistant_tokens_mask`` does (a token is a target when its
  character span overlaps a block's);
- ``role``: a template without them: every assistant turn's tokens and its end-of-turn token: the
  characters from the end of ``render(messages[:i], add_generation_prompt=True)`` to the end of
  ``render(messages[:i + 1])`` without its trailing whitespace, for each assistant message ``i`` (the
  template must render the conversation up to each assistant turn as the start of its text, else
  ValueError; other turns may be rendered together, as templates group tool results);
- ``all`` (``--loss-on all``): every token of the rendered conversation;
- ``plain`` (``--loss-on all`` and no template at all): each message's content followed by the
  tokenizer's EOS, every token a target (a message with fields only a template renders is refused);
- ``none`` (no template, ``--loss-on assistant``): only rows that need no template (standard
  prompt-completion); a conversation is refused naming ``--chat-template``.

A prompt-completion row (:meth:`ChatFormat.encode_completion`) is TRL's: its targets are the tokens past the
prompt's (``completion_mask``), every token with ``--loss-on all``.

Every message must render as some text: a role the template drops (or refuses) is a ValueError naming
the row. Errors name the row as ``FILE:LINE``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from loongtrain.data.messages import LOSS_ON, Message, content_text
from loongtrain.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

ASSISTANT = "assistant"
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def read_template(tokenizer: Tokenizer, template_file: str = "") -> str | None:
    """The chat template: ``template_file``'s text (a ``.json`` file: its ``chat_template``), else the
    tokenizer's own (``chat_template.jinja``, or ``tokenizer_config.json``'s ``chat_template`` beside it);
    None when there is none."""
    if template_file:
        path = Path(template_file)
        if not path.is_file():
            raise ValueError(f"--chat-template {template_file!r}: no such file (a Jinja chat template)")
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".json":
            template = _config_template(json.loads(text))
            if template is None:
                raise ValueError(f"--chat-template {template_file!r}: the JSON file holds no 'chat_template'")
            return template
        return text
    root = _tokenizer_dir(tokenizer)
    if root is None:
        return None
    if (root / "chat_template.jinja").is_file():
        return (root / "chat_template.jinja").read_text(encoding="utf-8")
    config = _tokenizer_config(root)
    return _config_template(config) if config else None


def _tokenizer_dir(tokenizer: Tokenizer) -> Path | None:
    if not isinstance(tokenizer, HFTokenizer):
        return None
    path = Path(tokenizer.name)
    return path if path.is_dir() else path.parent


def _tokenizer_config(root: Path) -> dict[str, Any]:
    file = root / "tokenizer_config.json"
    return json.loads(file.read_text(encoding="utf-8")) if file.is_file() else {}


def _config_template(config: dict[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def special_tokens(tokenizer: Tokenizer) -> dict[str, str]:
    """The tokenizer's special tokens by name (``eos_token``, ``bos_token``, ...): the variables HF's
    ``apply_chat_template`` gives a template. The byte tokenizer's EOS is NUL."""
    if isinstance(tokenizer, ByteTokenizer):
        return {"eos_token": "\0"}
    out: dict[str, str] = {}
    root = _tokenizer_dir(tokenizer)
    if root is not None:
        sources = [_tokenizer_config(root)]
        if (root / "special_tokens_map.json").is_file():
            sources.append(json.loads((root / "special_tokens_map.json").read_text(encoding="utf-8")))
        for source in sources:
            for key in _SPECIAL_KEYS:
                value = source.get(key)
                value = value.get("content") if isinstance(value, dict) else value
                if isinstance(value, str) and key not in out:
                    out[key] = value
    out.setdefault("eos_token", tokenizer.decode([tokenizer.eos_id]))
    return out


Tools = list[dict[str, Any]] | None


class ChatFormat:
    """How the run turns a conversation into tokens and targets (module docstring: the rules)."""

    def __init__(self, tokenizer: Tokenizer, template_file: str = "", loss_on: str = "assistant") -> None:
        if loss_on not in LOSS_ON:
            raise ValueError(f"--loss-on={loss_on!r} is not one of {LOSS_ON}")
        self.tokenizer, self.loss_on = tokenizer, loss_on
        self.template = read_template(tokenizer, template_file)
        self.source = (f"--chat-template {template_file!r}" if template_file else
                       f"the chat template of the tokenizer {tokenizer.name!r}")
        self.special = special_tokens(tokenizer)
        if self.template is None:
            self.rule = "plain" if loss_on == "all" else "none"
        else:
            _compile(self.template, self.source)
            self.rule = "all" if loss_on == "all" else "generation" if _GENERATION.search(self.template) else "role"
        self._known_roles: set[str] = set()

    def describe(self) -> str:
        """One line for the run's log: which tokens are targets."""
        return {
            "generation": "targets: the chat template's {% generation %} blocks (HF's return_assistant_tokens_mask)",
            "role": "targets by role: each assistant turn's tokens and its end-of-turn token (the chat template "
                    "has no {% generation %} blocks)",
            "all": "--loss-on all: every token of the rendered conversations is a target",
            "plain": "--loss-on all without a chat template: each message's content followed by EOS, every token "
                     "a target",
            "none": "no chat template: prompt-completion rows of text, targets their completions (TRL's "
                    "completion_mask)",
        }[self.rule]

    def identity(self) -> str:
        """What decides the tokens and targets beyond the tokenizer: the template's digest and the rule."""
        digest = hashlib.sha256((self.template or "").encode()).hexdigest()[:16]
        return f"{self.rule}:{digest}"

    def _need_template(self, where: str) -> None:
        if self.template is None and self.rule == "none":
            raise ValueError(f"{where}: the tokenizer {self.tokenizer.name!r} has no chat template to render "
                             f"conversations: pass --chat-template FILE (a Jinja chat template), or --loss-on all to "
                             f"train on every token of the messages' contents, each followed by EOS")

    def render(self, messages: Sequence[Message], where: str, *, add_generation_prompt: bool = False,
               spans: bool = False, tools: Tools = None) -> tuple[str, list[tuple[int, int]]]:
        """``(text, generation spans)`` of ``messages`` (and the row's ``tools``) by the template (spans only
        when asked for and the template has ``{% generation %}`` blocks); ValueError naming ``where`` when the
        template fails on them."""
        self._need_template(where)
        assert self.template is not None, "render needs a chat template"
        from transformers.utils.chat_template_utils import render_jinja_template

        try:
            rendered, indices = render_jinja_template(
                conversations=[list(messages)], tools=tools, chat_template=self.template,
                return_assistant_tokens_mask=spans, add_generation_prompt=add_generation_prompt, **self.special)
        except Exception as exc:  # jinja2's TemplateError (the template's raise_exception), or its own bugs
            raise ValueError(f"{where}: {self.source} refuses this conversation: {type(exc).__name__}: "
                             f"{str(exc).strip().splitlines()[0] if str(exc).strip() else 'no details'}") from None
        return rendered[0], [tuple(s) for s in (indices[0] if indices else [])]

    def encode(self, messages: Sequence[Message], where: str, tools: Tools = None) -> tuple[np.ndarray, np.ndarray]:
        """``(ids int64 [n], targets bool [n])`` of one conversation (module docstring: the rules)."""
        if self.rule == "plain":
            return self._plain(messages, where, tools)
        text, spans = self.render(messages, where, spans=self.rule == "generation", tools=tools)
        if self.rule == "role":
            spans = self._role_spans(messages, text, where, tools)
        else:
            self._check_roles(messages, where, tools)
        ids, offsets = self.tokenizer.encode_offsets(text)
        if self.rule == "all":
            return ids, np.ones(ids.size, dtype=bool)
        targets = np.zeros(ids.size, dtype=bool)
        for start, end in spans:  # HF's rule: a token overlapping a span is a target
            targets |= (offsets[:, 1] > start) & (offsets[:, 0] < end)
        return ids, targets

    def encode_completion(self, prompt: str | Sequence[Message], completion: str | Sequence[Message], where: str,
                          tools: Tools = None) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, targets)`` of a prompt-completion row, as TRL's SFT tokenizes it: text (two strings) is
        ``prompt + completion`` and the tokenizer's EOS; messages are ``render(prompt + completion)``. The targets
        are the tokens past ``encode(prompt)`` (``render(prompt, add_generation_prompt=True)``): TRL's
        ``completion_mask``; with ``--loss-on all`` every token."""
        if isinstance(prompt, str) and isinstance(completion, str):
            ids = self.tokenizer.encode(prompt + completion) + [self.tokenizer.eos_id]
            head = len(self.tokenizer.encode(prompt))
        elif isinstance(prompt, list) and isinstance(completion, list):
            if self.rule == "plain":
                raise ValueError(f"{where}: conversational prompt-completion rows need a chat template: pass "
                                 f"--chat-template FILE")
            text = self.render([*prompt, *completion], where, tools=tools)[0]
            self._check_roles([*prompt, *completion], where, tools)
            ids = self.tokenizer.encode(text)
            head = len(self.tokenizer.encode(self.render(prompt, where, add_generation_prompt=True, tools=tools)[0]))
        else:
            raise ValueError(f"{where}: 'prompt' and 'completion' must both be strings or both lists of messages")
        out = np.asarray(ids, dtype=np.int64)
        targets = np.ones(out.size, dtype=bool)
        if self.loss_on != "all":
            targets[:head] = False
        return out, targets

    def _plain(self, messages: Sequence[Message], where: str, tools: Tools) -> tuple[np.ndarray, np.ndarray]:
        """Rule ``plain``: each message's content and EOS; fields only a template renders are refused."""
        extra = sorted({k for m in messages for k in m if k not in ("role", "content")} | ({"tools"} if tools else
                                                                                          set()))
        if extra:
            raise ValueError(f"{where}: the row holds {extra}, which only a chat template renders (--loss-on all "
                             f"without one trains on the messages' contents alone): pass --chat-template FILE")
        eos = np.array([self.tokenizer.eos_id], dtype=np.int64)
        ids = np.concatenate([p for m in messages for p in (np.asarray(self.tokenizer.encode(content_text(m)),
                                                                       dtype=np.int64), eos)])
        return ids, np.ones(ids.size, dtype=bool)

    def _prefix(self, messages: Sequence[Message], count: int, where: str, tools: Tools, *,
                prompt: bool = False) -> str:
        """The text of the first ``count`` messages ('' for none when the template needs one)."""
        if count == 0 and not prompt:
            return ""
        try:
            return self.render(messages[:count], where, add_generation_prompt=prompt, tools=tools)[0]
        except ValueError:
            if count == 0:
                return ""
            raise

    def _check_roles(self, messages: Sequence[Message], where: str, tools: Tools) -> None:
        """Each message whose role this format has not yet seen renders as some text."""
        for i, message in enumerate(messages):
            if message["role"] not in self._known_roles:
                before, upto = self._prefix(messages, i, where, tools), self._prefix(messages, i + 1, where, tools)
                self._check_rendered(messages, i, before, upto, where)

    def _check_rendered(self, messages: Sequence[Message], i: int, before: str, upto: str, where: str) -> None:
        """Message ``i`` adds some text to the rendering of the ones before it (``before``: theirs, ``upto``:
        with it; a template may render a turn together with the next, so ``before`` need not be a prefix)."""
        role = messages[i]["role"]
        if len(upto) <= len(os.path.commonprefix([before, upto])):
            known = sorted(self._known_roles) or "none yet"
            raise ValueError(f"{where}: message {i} has role {role!r}, which the chat template does not render "
                             f"(roles it rendered so far: {known}); use a role the template knows, or give a "
                             f"template that renders it (--chat-template FILE)")
        self._known_roles.add(role)

    def _role_spans(self, messages: Sequence[Message], text: str, where: str, tools: Tools) -> list[tuple[int, int]]:
        """The assistant turns' character spans (module docstring, rule ``role``)."""
        spans = []
        before = ""
        for i, message in enumerate(messages):
            upto = self._prefix(messages, i + 1, where, tools)
            self._check_rendered(messages, i, before, upto, where)
            if message["role"] == ASSISTANT:
                if not text.startswith(upto.rstrip()):
                    raise ValueError(f"{where}: the chat template does not render this conversation's first {i + 1} "
                                     f"messages as the start of its text, so its assistant turns cannot be found by "
                                     f"role; give a template with {{% generation %}} blocks (--chat-template FILE)")
                head = self._prefix(messages, i, where, tools, prompt=True)
                common = len(os.path.commonprefix([before, upto]))
                start = len(head) if upto.startswith(head) and len(head) >= common else common
                spans.append((start, len(upto.rstrip())))
            before = upto
        return spans


def _compile(template: str, source: str) -> None:
    """Compile ``template`` as ``apply_chat_template`` does (cached there); ValueError naming ``source`` and the
    line for a syntax error."""
    from jinja2 import TemplateSyntaxError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(template)
    except TemplateSyntaxError as exc:
        raise ValueError(f"{source} is not a valid Jinja template: line {exc.lineno}: {exc.message}") from None
