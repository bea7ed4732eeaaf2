"""Post-training data (docs/post-training.md): chat templates and target masks against transformers'
``apply_chat_template(..., return_assistant_tokens_mask=True)``, TRL's pair tokenization spelled with the HF
tokenizer, whole-unit packing and the rows it builds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loongtrain.data.chat import ChatFormat
from loongtrain.data.preference import PreferenceDataset, encode_pairs, pair_texts, tokenize_pair
from loongtrain.data.tokenizer import ByteTokenizer, build_tokenizer
from loongtrain.data.whole_packing import build_row, concat_docs, pack_whole
from loongtrain.objectives.sft import ConversationReader
from tests.helpers import chat_data
from tests.helpers.post_training_reference import assistant_tokens, hf_tokenizer, trl_pair_ids

pytest.importorskip("transformers", reason="the hf extra is not installed (pip install -e '.[hf]')")

CONVERSATIONS = [chat_data.conversation(i, turns) for i, turns in ((0, 1), (1, 2), (2, 3))] + [
    [{"role": "user", "content": "héllo ✓"}, {"role": "assistant", "content": "ünïcode ok"}],
    [{"role": "user", "content": "no answer"}]]


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chat")
    return {name: chat_data.make_tokenizer(tmp / name, template) for name, template in
            (("generation", chat_data.GENERATION_TEMPLATE), ("role", chat_data.ROLE_TEMPLATE), ("none", None))}


def test_generation_blocks_equal_hf_assistant_mask(toks):
    chat, hf = ChatFormat(build_tokenizer(str(toks["generation"]))), hf_tokenizer(toks["generation"])
    assert chat.rule == "generation"
    for messages in CONVERSATIONS:
        ids, targets = chat.encode(messages, "t")
        ref_ids, ref_mask = assistant_tokens(hf, messages)
        assert ids.tolist() == ref_ids.tolist() and targets.tolist() == ref_mask.tolist()
    assert chat.encode(CONVERSATIONS[-1], "t")[1].sum() == 0


def test_role_rule_equals_hf_mask_of_the_template_with_generation_blocks(toks):
    """Without {% generation %}, each assistant turn and its end-of-turn token: the same tokens HF marks when
    the blocks wrap exactly those (the two templates render the same text)."""
    chat, hf = ChatFormat(build_tokenizer(str(toks["role"]))), hf_tokenizer(toks["generation"])
    assert chat.rule == "role" and "role" in chat.describe()
    for messages in CONVERSATIONS:
        ids, targets = chat.encode(messages, "t")
        ref_ids, ref_mask = assistant_tokens(hf, messages)
        assert ids.tolist() == ref_ids.tolist() and targets.tolist() == ref_mask.tolist()


def test_loss_on_all_and_templates_from_a_file(toks, tmp_path):
    tok = build_tokenizer(str(toks["generation"]))
    ids, targets = ChatFormat(tok, loss_on="all").encode(CONVERSATIONS[1], "t")
    ref_ids, _ = assistant_tokens(hf_tokenizer(toks["generation"]), CONVERSATIONS[1])
    assert targets.all() and ids.tolist() == ref_ids.tolist()
    plain = ChatFormat(build_tokenizer(str(toks["none"])), loss_on="all")
    assert plain.rule == "plain"
    ids, targets = plain.encode(CONVERSATIONS[0], "t")
    eos = plain.tokenizer.eos_id
    assert targets.all() and (ids == eos).sum() == len(CONVERSATIONS[0]) and ids[-1] == eos
    file = tmp_path / "t.jinja"
    file.write_text(chat_data.GENERATION_TEMPLATE)
    from_file = ChatFormat(build_tokenizer(str(toks["none"])), str(file))
    assert from_file.rule == "generation"
    own = ChatFormat(tok).encode(CONVERSATIONS[2], "t")[1]
    assert from_file.encode(CONVERSATIONS[2], "t")[1].tolist() == own.tolist()
    without = ChatFormat(build_tokenizer(str(toks["none"])))  # text prompt-completion rows need no template
    assert without.rule == "none"
    with pytest.raises(ValueError, match="f:1: the tokenizer .* has no chat template .*--chat-template FILE"):
        without.encode(CONVERSATIONS[0], "f:1")


def test_byte_tokenizer_offsets_map_characters_to_bytes():
    ids, offsets = ByteTokenizer().encode_offsets("aé✓")
    assert ids.tolist() == list("aé✓".encode()) and offsets[:, 0].tolist() == [0, 1, 1, 2, 2, 2]


def test_pairs_are_tokenized_as_trl_does(toks):
    tok, hf = build_tokenizer(str(toks["generation"])), hf_tokenizer(toks["generation"])
    pair = chat_data.pair(3)
    got = tokenize_pair(tok, *pair_texts(pair, "t", None))
    assert [g.tolist() for g in got] == list(trl_pair_ids(hf, pair["prompt"], pair["chosen"], pair["rejected"]))
    # conversational: TRL renders the prompt with the generation prompt, each completion past it
    conv = chat_data.pair(3, conversational=True)
    prompt, chosen, rejected = pair_texts(conv, "t", ChatFormat(tok, loss_on="all"))
    head = hf.apply_chat_template(conv["prompt"], tokenize=False, add_generation_prompt=True)
    full = hf.apply_chat_template(conv["prompt"] + conv["chosen"], tokenize=False)
    assert prompt == head and chosen == full[len(head):] and chosen.endswith("<|im_end|>\n")
    with pytest.raises(ValueError, match="need a chat template"):
        pair_texts(conv, "f:1", None)


def test_pack_whole_keeps_units_whole_and_counts_the_long_ones():
    rows, dropped = pack_whole(np.array([3, 4, 9, 2, 5, 1]), 8, "drop", "units")
    assert [r.tolist() for r in rows] == [[0, 1], [3, 4, 5]] and dropped == 1
    with pytest.raises(ValueError, match=r"unit 2 \(counting from 0\) has 9 tokens"):
        pack_whole(np.array([3, 4, 9]), 8, "error", "units")
    with pytest.raises(ValueError, match="every one of the 2 units is longer than --seq-len 2"):
        pack_whole(np.array([3, 4]), 2, "drop", "units")


def test_rows_mask_prompts_padding_and_document_ends():
    a = (np.array([5, 6, 7, 8]), np.array([0, 0, 1, 1], bool))
    b = (np.array([9, 10, 11]), np.array([0, 1, 1], bool))
    row = build_row([a, b], 10, pad_id=0, segments=[4, 5])
    assert row["input_ids"].tolist() == [5, 6, 7, 8, 9, 10, 11, 0, 0, 0]
    assert row["labels"].tolist() == [-100, 7, 8, -100, 10, 11, -100, -100, -100, -100]
    assert row["segment"].tolist() == [-1, 4, 4, -1, 5, 5, -1, -1, -1, -1]
    assert row["doc_starts"].nonzero().flatten().tolist() == [0, 4, 7]  # the padding is a document of its own
    assert concat_docs([a, b]).marks(1).tolist() == b[1].tolist()


def test_preference_rows(toks, tmp_path):
    tok = build_tokenizer(str(toks["generation"]))
    corpus = chat_data.write_pairs(tmp_path / "p.jsonl", 9)
    dataset = PreferenceDataset(encode_pairs(str(corpus), tok, None), 128, tok.eos_id, "p")
    hf = hf_tokenizer(toks["generation"])
    for index in range(dataset.num_samples()):
        row, pairs = dataset[index], dataset.rows[index].tolist()
        assert int(row["num_pairs"]) == len(pairs) and int(row["ref_key"]) == index
        targets = 0
        for k, i in enumerate(pairs):
            p, c, r = trl_pair_ids(hf, **chat_data.pair(i))
            targets += len(c) + len(r)
            assert int((row["segment"] == 2 * k).sum()) == len(c) and int((row["segment"] == 2 * k + 1).sum()) == len(r)
        assert int((row["labels"] != -100).sum()) == targets
        assert torch.equal(row["labels"] != -100, row["segment"] >= 0)
    held = PreferenceDataset(encode_pairs(str(corpus), tok, None), 128, tok.eos_id, "p", held_out=True)
    assert int(held[0]["ref_key"]) == -1


def test_validation_rows_are_held_out_and_split_over_replicas(toks, tmp_path):
    tok = build_tokenizer(str(toks["generation"]))
    corpus = str(chat_data.write_conversations(tmp_path / "c.jsonl", 40, turns=1))
    reader = ConversationReader(tok, ChatFormat(tok), 128)
    train = reader.dataset(corpus, val_fraction=0.3, part="train")
    held = reader.dataset(corpus, val_fraction=0.3, part="validation", held_out=True)
    assert train.docs.num_documents + held.docs.num_documents == 40 and held.docs.num_documents > 4
    replicas = [reader.validation_batches(corpus, "", 0.3, 2, d, 2, 10) for d in range(2)]
    assert len(replicas[0]) == len(replicas[1]) == held.num_samples() // 4
    first = {tuple(b["input_ids"][i].tolist()) for b in replicas[0] for i in range(2)}
    second = {tuple(b["input_ids"][i].tolist()) for b in replicas[1] for i in range(2)}
    assert not first & second
    tail, whole = reader.validation_batches(corpus, "", 0.0, 1, 0, 1, 2), reader.dataset(corpus)
    assert len(tail) == 2 and torch.equal(tail[-1]["input_ids"][0], whole[whole.num_samples() - 1]["input_ids"])
