"""The rows TRL users bring (docs/post-training.md#rows), against Hugging Face's and TRL's own rules: every
message field and the row's ``tools`` reach the chat template as ``apply_chat_template`` gets them (tool calls,
tool results, ``reasoning_content``, content as text parts), prompt-completion rows (TRL's ``completion_mask``),
implicit-prompt pairs (TRL's ``extract_prompt``), and saved Hugging Face datasets of each form."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from loongtrain.data.chat import ChatFormat
from loongtrain.data.conversations import encode_conversations, encode_row
from loongtrain.data.messages import split_implicit_prompt
from loongtrain.data.preference import encode_pairs, pair_texts
from loongtrain.data.tokenizer import ByteTokenizer, build_tokenizer
from tests.helpers import chat_data
from tests.helpers.post_training_reference import hf_tokenizer

TOOLS = [chat_data.WEATHER_TOOL]


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tools")
    return {name: chat_data.make_tokenizer(tmp / name, template) for name, template in
            (("generation", chat_data.TOOLS_TEMPLATE), ("role", chat_data.TOOLS_ROLE_TEMPLATE), ("none", None))}


def _hf(hf, messages, tools=None):
    out = hf.apply_chat_template(messages, tools=tools, return_dict=True, return_assistant_tokens_mask=True)
    return out["input_ids"], [bool(m) for m in out["assistant_masks"]]


ROWS = [({"messages": chat_data.tool_conversation(i), "tools": TOOLS}, TOOLS) for i in range(3)] + [
    ({"messages": chat_data.tool_conversation(7), "tools": json.dumps(TOOLS)}, TOOLS),  # tools as a JSON string
    ({"messages": chat_data.tool_conversation(8)[1:]}, None),  # no tools block
    ({"messages": chat_data.conversation(5, 2)}, None)]


@pytest.mark.parametrize("rule", ["generation", "role"])
def test_every_message_field_reaches_the_template_as_hf_gives_it(toks, rule):
    """Tokens and targets equal transformers' apply_chat_template with the same row, template and tools (the
    role rule against the mask of the same template with generation blocks: tool results grouped in one turn)."""
    chat, hf = ChatFormat(build_tokenizer(str(toks[rule]))), hf_tokenizer(toks["generation"])
    assert chat.rule == rule
    for row, tools in ROWS:
        ids, targets = encode_row(chat, row, "r")
        ref_ids, ref_mask = _hf(hf, row["messages"], tools)
        assert ids.tolist() == ref_ids and targets.tolist() == ref_mask
    ids, targets = encode_row(chat, ROWS[0][0], "r")
    trained = chat.tokenizer.decode(ids[targets].tolist())
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "c0"}}' in trained  # the tool calls
    assert "<think>\nI need tools for 0.\n</think>" in trained and "c0: sunny, c1: rain." in trained


def test_what_the_template_cannot_take_is_named(toks):
    chat = ChatFormat(build_tokenizer(str(toks["generation"])))
    bad = [({"messages": [{"role": "user", "content": 3}]}, r"r:1: messages\[0\]'s 'content' is neither a string"),
           ({"messages": [{"role": "user", "content": [{"type": "image", "url": "x"}]}]}, "list of text parts"),
           ({"messages": [{"content": "no role"}]}, r"messages\[0\] is not a message with a string 'role'"),
           ({"messages": chat_data.conversation(0), "tools": "{not json"}, "'tools' is a string that is not JSON"),
           ({"messages": chat_data.conversation(0), "tools": [1]}, "'tools' must be a list of JSON schemas"),
           ({"text": "plain"}, "nor a 'prompt' and a 'completion' .*plain text trains with --objective pretrain")]
    for row, pattern in bad:
        with pytest.raises(ValueError, match=pattern):
            encode_row(chat, row, "r:1")
    plain = ChatFormat(build_tokenizer(str(toks["none"])), loss_on="all")
    with pytest.raises(ValueError, match=r"r:1: the row holds \['name', 'reasoning_content', 'tool_call_id', "
                                         r"'tool_calls', 'tools'\], which only a chat template renders"):
        encode_row(plain, ROWS[0][0], "r:1")


def test_a_template_that_does_not_compile_is_named_not_a_row(toks, tmp_path):
    file = tmp_path / "broken.jinja"
    file.write_text("{% for m in messages %}\n{{ m['content'] }\n{% endfor %}")
    with pytest.raises(ValueError, match=rf"--chat-template '{file}' is not a valid Jinja template: line 2: "):
        ChatFormat(build_tokenizer(str(toks["none"])), str(file))


def test_prompt_completion_rows_are_trls(toks):
    """Standard: prompt + completion + EOS, the targets past the prompt's own tokens; conversational: the
    rendering of prompt + completion, the targets past ``render(prompt, add_generation_prompt=True)``."""
    tok, hf = build_tokenizer(str(toks["generation"])), hf_tokenizer(toks["generation"])
    chat = ChatFormat(tok)
    ids, targets = encode_row(chat, {"prompt": "The sky is", "completion": " blue."}, "r")
    prompt = hf("The sky is", add_special_tokens=False)["input_ids"]
    full = hf("The sky is blue.", add_special_tokens=False)["input_ids"] + [hf.eos_token_id]
    assert ids.tolist() == full and targets.tolist() == [False] * len(prompt) + [True] * (len(full) - len(prompt))
    messages = chat_data.tool_conversation(2)
    row = {"prompt": messages[:5], "completion": messages[5:], "tools": TOOLS}
    ids, targets = encode_row(chat, row, "r")
    head = hf.apply_chat_template(messages[:5], tools=TOOLS, add_generation_prompt=True, return_dict=True)["input_ids"]
    whole = hf.apply_chat_template(messages, tools=TOOLS, return_dict=True)["input_ids"]
    assert ids.tolist() == whole and targets.tolist() == [False] * len(head) + [True] * (len(whole) - len(head))
    assert ChatFormat(tok, loss_on="all").encode_completion("a", "b", "r")[1].all()
    byte = ChatFormat(ByteTokenizer())  # text rows need no template at all
    ids, targets = encode_row(byte, {"prompt": "ab", "completion": "c"}, "r")
    assert ids.tolist() == [97, 98, 99, 0] and targets.tolist() == [False, False, True, True]


def test_implicit_prompts_are_split_as_trl_does(toks):
    assert split_implicit_prompt("The sky is blue.", "The sky is green.", "r") == ("The sky is", " blue.", " green.")
    chosen = [{"role": "user", "content": "What color is the sky?"}, {"role": "assistant", "content": "It is blue."}]
    rejected = [chosen[0], {"role": "assistant", "content": "It is green."}]
    assert split_implicit_prompt(chosen, rejected, "r") == ([chosen[0]], chosen[1:], rejected[1:])
    chat = ChatFormat(build_tokenizer(str(toks["generation"])), loss_on="all")
    implicit = pair_texts({"chosen": chosen, "rejected": rejected, "tools": TOOLS}, "r", chat)
    explicit = pair_texts({"prompt": chosen[:1], "chosen": chosen[1:], "rejected": rejected[1:], "tools": TOOLS}, "r",
                          chat)
    assert implicit == explicit and "get_weather" in implicit[0]
    for a, b, pattern in (("same", "same", "are the same"), ("x", ["y"], "both be strings or both lists"),
                          (chosen[1:], rejected[1:], "share no first message")):
        with pytest.raises(ValueError, match=pattern):
            split_implicit_prompt(a, b, "r")


def _saved(path, rows):
    import datasets

    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return str(path)


def _text_contents(messages: list[dict]) -> list[dict]:
    """``messages`` with text parts joined into strings (an Arrow column holds one type)."""
    return [{**m, "content": "".join(p["text"] for p in m["content"])} if isinstance(m.get("content"), list) else m
            for m in messages]


def test_saved_datasets_read_as_their_rows(toks, tmp_path):
    """A saved Hugging Face dataset of each form gives the tokens of the same rows as JSON lines (Arrow's
    ``None`` for the fields a message lacks removed, as TRL does), and names its rows ``DATASET[i]``."""
    chat = ChatFormat(build_tokenizer(str(toks["generation"])))
    tool_rows = [{"messages": _text_contents(chat_data.tool_conversation(i)), "tools": TOOLS} for i in range(3)]
    for name, rows in (("messages", tool_rows + [{"messages": chat_data.conversation(1), "tools": TOOLS}]),
                       ("prompt_completion", [{"prompt": m[:2], "completion": m[2:]} for m in
                                              (chat_data.conversation(i) for i in range(3))])):
        jsonl = chat_data.write_rows(tmp_path / f"{name}.jsonl", rows)
        saved = _saved(tmp_path / name, rows)
        got, want = encode_conversations(saved, chat), encode_conversations(str(jsonl), chat)
        assert np.array_equal(got.tokens, want.tokens) and np.array_equal(got.targets, want.targets)
    pairs = [{"chosen": f"Q{i}? yes {i}", "rejected": f"Q{i}? no {i * 3}"} for i in range(4)]
    got = encode_pairs(_saved(tmp_path / "pairs", pairs), chat.tokenizer, None)
    want = encode_pairs(str(chat_data.write_rows(tmp_path / "pairs.jsonl", pairs)), chat.tokenizer, None)
    assert np.array_equal(got.tokens, want.tokens) and np.array_equal(got.offsets, want.offsets)
    bad = _saved(tmp_path / "bad", [{"messages": chat_data.conversation(0)}, {"text": "plain"}])
    with pytest.raises(ValueError, match=rf"{bad}\[1\]: no 'messages' list"):
        encode_conversations(bad, chat)


@pytest.mark.parametrize("objective", ["sft", "dpo"])
def test_prepared_rows_give_the_raw_rows_batches(toks, tmp_path, objective):
    """``loongtrain prepare --objective sft|dpo`` of every form (tool-calling conversations, prompt-completion
    rows; explicit and implicit-prompt pairs, text and messages) gives the raw rows' batches bit for bit."""
    from loongtrain.data.prepare import Sharding, prepare
    from loongtrain.objectives.registry import objective_spec

    tok = build_tokenizer(str(toks["generation"]))
    if objective == "sft":
        rows = [*(r for r, _ in ROWS), {"prompt": "Say hi.", "completion": " hi"},
                {"prompt": chat_data.conversation(3)[:2], "completion": chat_data.conversation(3)[2:3]}]
    else:
        messages = chat_data.conversation(2, 1)
        rows = [chat_data.pair(0), chat_data.pair(1, conversational=True),
                {"chosen": "Q: sky? A: blue", "rejected": "Q: sky? A: green"},
                {"chosen": messages, "rejected": [*messages[:-1], {"role": "assistant", "content": "no"}],
                 "tools": TOOLS}]
    corpus = chat_data.write_rows(tmp_path / "rows.jsonl", rows * 3)
    spec = objective_spec(objective)
    options = type("Options", (), dict(chat_template="", loss_on="assistant", on_long="drop", dpo_beta=0.1,
                                       ref_model=""))()
    prepare([str(corpus)], tmp_path / "prep", str(toks["generation"]), Sharding(shard_bytes=300), workers=1,
            rows=lambda tokenizer: spec.row_encoder(tokenizer, options))
    manifest = json.loads((tmp_path / "prep" / "manifest.json").read_text())
    assert manifest["objective"] == objective and len(manifest["shards"]) > 1
    cfg = type("Cfg", (), dict(data=type("Data", (), dict(seq_len=1024, decode_errors="strict"))(),
                               optim=type("Optim", (), dict(seed=0))(), objective=options))()
    reader = spec.reader(cfg, tok)
    raw, prepared = (reader.batches(spec_, 2, 0, 1) for spec_ in (str(corpus), str(tmp_path / "prep")))
    for _ in range(4):
        a, b = next(raw), next(prepared)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
