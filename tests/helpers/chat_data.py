"""Tiny chat data for the post-training tests: a byte-level Hugging Face tokenizer directory with a chat
template (``{% generation %}`` blocks or not), a tiny random HF causal LM of its vocabulary, and ``.jsonl``
files of conversations and preference pairs."""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers.hf_models import make_hf_dir

SPECIAL = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
#: ChatML, the assistant's content and end-of-turn token inside {% generation %}
GENERATION_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
#: the same template without the generation blocks (targets by role)
ROLE_TEMPLATE = GENERATION_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
#: a template that knows only user and assistant (any other role renders nothing)
TWO_ROLES_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] in ['user', 'assistant'] %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def make_tokenizer(path: Path, template: str | None = GENERATION_TEMPLATE) -> Path:
    """A byte-level BPE tokenizer (256 byte tokens, no merges, the ChatML specials: vocabulary 259, EOS
    ``<|endoftext|>``) saved as ``tokenizer.json`` + ``tokenizer_config.json`` (with ``template``)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}
    if template is not None:
        config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


VOCAB = 259


def make_model_dir(path: Path, family: str = "LlamaForCausalLM", *, seed: int = 3, template: str | None =
                   GENERATION_TEMPLATE, **overrides) -> Path:
    """A tiny random HF model (``family``: Llama or Qwen2) with the chat tokenizer in its directory."""
    assert family in ("LlamaForCausalLM", "Qwen2ForCausalLM"), family
    make_hf_dir(path, family, seed=seed, **{"vocab_size": VOCAB, **overrides})
    make_tokenizer(path, template)
    return path


def conversation(i: int, turns: int = 2) -> list[dict[str, str]]:
    """A small conversation, different per ``i``: a system prompt, then ``turns`` user/assistant turns."""
    messages = [{"role": "system", "content": f"be brief {i % 3}"}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"q{i}.{t}: what is {i} + {t}?"})
        messages.append({"role": "assistant", "content": f"{i + t}, as {i} plus {t} gives"})
    return messages


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_conversations(path: Path, count: int = 24, turns: int = 2) -> Path:
    return write_rows(path, [{"messages": conversation(i, turns)} for i in range(count)])


def pair(i: int, conversational: bool = False) -> dict:
    """A preference pair, different per ``i``."""
    prompt, chosen, rejected = f"Q{i}: name {i} twice.", f" {i} {i}.", f" maybe {i * 7 % 11}?"
    if not conversational:
        return {"prompt": prompt, "chosen": chosen, "rejected": rejected}
    return {"prompt": [{"role": "user", "content": prompt}], "chosen": [{"role": "assistant", "content": chosen}],
            "rejected": [{"role": "assistant", "content": rejected}]}


def write_pairs(path: Path, count: int = 24, conversational: bool = False) -> Path:
    return write_rows(path, [pair(i, conversational) for i in range(count)])
