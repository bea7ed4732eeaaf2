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


#: ChatML with what tool-calling and reasoning models' templates render (written for these tests): the row's
#: ``tools`` in the system turn, an assistant turn's ``reasoning_content`` in <think>, its ``tool_calls`` as JSON,
#: consecutive ``tool`` results grouped into one turn, content given as text parts; the assistant's turns inside
#: {% generation %}
TOOLS_TEMPLATE = (
    "{%- macro text(content) -%}{%- if content is string -%}{{ content }}{%- elif content -%}"
    "{%- for part in content -%}{{ part['text'] }}{%- endfor -%}{%- endif -%}{%- endmacro -%}"
    "{%- if tools -%}{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' -%}{{ text(messages[0]['content']) + '\\n\\n' }}{%- endif -%}"
    "{{ '# Tools\\n<tools>' }}{%- for tool in tools -%}{{ '\\n' + (tool | tojson) }}{%- endfor -%}"
    "{{ '\\n</tools><|im_end|>\\n' }}{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{%- if not tools -%}"
    "{{ '<|im_start|>system\\n' + text(message['content']) + '<|im_end|>\\n' }}{%- endif -%}"
    "{%- elif message['role'] == 'user' -%}{{ '<|im_start|>user\\n' + text(message['content']) + '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' -%}{{ '<|im_start|>assistant\\n' }}{% generation %}"
    "{%- if message.get('reasoning_content') -%}{{ '<think>\\n' + message['reasoning_content'] + '\\n</think>\\n\\n' }}"
    "{%- endif -%}{{ text(message.get('content')) }}"
    "{%- for call in message.get('tool_calls') or [] -%}{%- set f = call['function'] if call['function'] else call -%}"
    "{{ '\\n<tool_call>\\n{\"name\": \"' + f['name'] + '\", \"arguments\": ' + (f['arguments'] | tojson) + "
    "'}\\n</tool_call>' }}{%- endfor -%}{{ '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{%- elif message['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}{{ '<|im_start|>user' }}{%- endif -%}"
    "{{ '\\n<tool_response>\\n' + text(message['content']) + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{ '<|im_end|>\\n' }}{%- endif -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}")
#: the same without the generation blocks (targets by role)
TOOLS_ROLE_TEMPLATE = TOOLS_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def tool_conversation(i: int) -> list[dict]:
    """A tool-calling conversation with reasoning, a turn of tool calls without content, two tool results and
    content given as text parts."""
    return [
        {"role": "system", "content": [{"type": "text", "text": f"be helpful {i}"}]},
        {"role": "user", "content": f"weather in city {i} and {i + 1}?"},
        {"role": "assistant", "reasoning_content": f"I need tools for {i}.",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": f"c{i}"}}},
                        {"type": "function", "function": {"name": "get_weather",
                                                          "arguments": {"city": f"c{i + 1}"}}}]},
        {"role": "tool", "name": "get_weather", "tool_call_id": "0", "content": f"sunny {i}"},
        {"role": "tool", "name": "get_weather", "tool_call_id": "1", "content": [{"type": "text", "text": "rain"}]},
        {"role": "assistant", "reasoning_content": "Both came back.", "content": f"c{i}: sunny, c{i + 1}: rain."},
    ]
