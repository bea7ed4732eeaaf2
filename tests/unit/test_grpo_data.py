"""GRPO's rollout rows and reward functions: TRL's tokenization (Hugging Face's own tokenizer and chat template
as the reference), the row layout (segments, per-sequence fields, old log-probabilities at their labels),
the online loop's packing rule, and every bad input named in one line."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from loongtrain.data.chat import ChatFormat
from loongtrain.data.rollouts import (
    RolloutDataset,
    read_prompts,
    read_rollouts,
    rows_fit,
    with_advantages,
)
from loongtrain.data.tokenizer import build_tokenizer
from loongtrain.data.whole_packing import pack_whole
from loongtrain.objectives.grpo_rewards import load_rewards, score
from tests.helpers import chat_data
from tests.helpers.post_training_reference import hf_tokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return chat_data.make_tokenizer(tmp_path_factory.mktemp("tok"))


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_rows_tokenize_as_trl_and_lay_out_by_sequence(tok_dir, tmp_path):
    tokenizer, hf = build_tokenizer(str(tok_dir)), hf_tokenizer(tok_dir)
    chat = ChatFormat(tokenizer, "", "all")
    rows = [{"prompt": "Q1?", "completion": " a1", "reward": 1.0},
            {"prompt": "Q1?", "completion": " b22", "reward": 0.0, "old_logps": [-0.5, -1.0, -1.5, -2.0, -2.5]},
            {"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "yo"}],
             "reward": 2.0, "group": 7},
            {"prompt": [{"role": "user", "content": "hey"}], "completion": [{"role": "assistant", "content": "no"}],
             "reward": 1.0, "group": 7}]
    with pytest.raises(ValueError, match="rollouts.jsonl:2: has 'old_logps', unlike"):
        read_rollouts(_write(tmp_path / "rollouts.jsonl", rows), tokenizer, chat)
    rows[1].pop("old_logps")
    rollouts = read_rollouts(_write(tmp_path / "rollouts.jsonl", rows), tokenizer, chat)
    eos = hf.eos_token_id
    assert rollouts[0].prompt_ids.tolist() == hf("Q1?", add_special_tokens=False)["input_ids"]
    assert rollouts[0].completion_ids.tolist() == hf(" a1", add_special_tokens=False)["input_ids"] + [eos]
    head = hf.apply_chat_template(rows[2]["prompt"], tokenize=False, add_generation_prompt=True)
    full = hf.apply_chat_template(rows[2]["prompt"] + rows[2]["completion"], tokenize=False)
    assert rollouts[2].prompt_ids.tolist() == hf(head, add_special_tokens=False)["input_ids"]
    assert rollouts[2].completion_ids.tolist() == hf(full[len(head):], add_special_tokens=False)["input_ids"] + [eos]
    done = with_advantages(rollouts, "group")
    assert rollouts[0].group == rollouts[1].group != rollouts[2].group == rollouts[3].group
    assert done[0].advantage == pytest.approx(0.5 / (math.sqrt(0.5) + 1e-4))
    dataset = RolloutDataset(done, 64, eos, "x", rows=[np.array([0, 1]), np.array([2]), np.array([3])])
    row = dataset[0]
    assert row["num_sequences"].item() == 2 and row["lengths"][:2].tolist() == [4, 5]
    for k, r in enumerate(done[:2]):
        at = (row["segment"] == k).nonzero().flatten()
        assert row["labels"][at].tolist() == r.completion_ids.tolist()  # every completion token, EOS included
        assert row["rewards"][k] == r.reward and row["advantages"][k] == r.advantage


def test_old_logps_sit_at_their_labels(tok_dir, tmp_path):
    tokenizer = build_tokenizer(str(tok_dir))
    rows = [{"prompt": "P", "completion": "ab", "reward": float(i), "old_logps": [-0.1 * i, -0.2, -0.3]}
            for i in range(3)]
    done = with_advantages(read_rollouts(_write(tmp_path / "r.jsonl", rows), tokenizer, None), "none")
    row = RolloutDataset(done, 32, tokenizer.eos_id, "x")[0]
    for k in range(3):
        assert row["old_logps"][row["segment"] == k].tolist() == pytest.approx(rows[k]["old_logps"])
    assert (row["old_logps"][row["segment"] < 0] == 0).all()


BAD_ROWS = [
    ({"prompt": "p", "completion": "c"}, "r.jsonl:1: a rollout row needs 'prompt', 'completion' and 'reward'"),
    ({"prompt": "p", "reward": 1}, "a rollout row needs 'prompt', 'completion' and 'reward'"),
    ('{"prompt": "p", "completion": "c", "reward": NaN}', "r.jsonl:1: 'reward' must be a finite number, got NaN"),
    ({"prompt": "p", "completion": "c", "reward": "1"}, "'reward' must be a finite number"),
    ({"prompt": "p", "completion": [], "reward": 1}, "must both be strings or both lists of messages"),
    ({"prompt": "p", "completion": "c", "reward": 1, "old_logps": [-1.0]},
     "'old_logps' has 1 values, the completion 2"),
    ({"prompt": "p", "completion": "c", "reward": 1, "old_logps": [0.5, -1]}, "numbers <= 0"),
    ({"prompt": "p", "completion": "c", "reward": 1, "group": [1]}, "'group' must be a string or an integer"),
]


@pytest.mark.parametrize("row,message", BAD_ROWS)
def test_bad_rows_are_named(tok_dir, tmp_path, row, message):
    tokenizer = build_tokenizer(str(tok_dir))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        read_rollouts(_write(tmp_path / "r.jsonl", [row]), tokenizer, None)


def test_groups_of_one_long_completions_and_partial_advantages_are_refused(tok_dir, tmp_path):
    tokenizer = build_tokenizer(str(tok_dir))
    one = read_rollouts(_write(tmp_path / "a.jsonl", [
        {"prompt": "p", "completion": "c", "reward": 1}, {"prompt": "q", "completion": "c", "reward": 1},
        {"prompt": "q", "completion": "d", "reward": 0}]), tokenizer, None)
    with pytest.raises(ValueError, match="a.jsonl:1: its group has one completion"):
        with_advantages(one, "group")
    part = read_rollouts(_write(tmp_path / "b.jsonl", [
        {"prompt": "p", "completion": "c", "reward": 1, "advantage": 1},
        {"prompt": "p", "completion": "d", "reward": 0}]), tokenizer, None)
    with pytest.raises(ValueError, match="b.jsonl:2: gives no 'advantage', unlike the other rows of its group"):
        with_advantages(part, "group")
    given = read_rollouts(_write(tmp_path / "c.jsonl", [{"prompt": "p", "completion": "c" * 40, "reward": 1,
                                                         "advantage": 0.5}]), tokenizer, None)
    assert with_advantages(given, "group")[0].advantage == 0.5  # a group of one with its advantage given
    with pytest.raises(ValueError, match=r"c.jsonl:1: prompt \+ completion is 42 tokens \(1 \+ 41\), more than "
                                         r"--seq-len 32"):
        RolloutDataset(with_advantages(given, "group"), 32, 0, "x")


def test_the_online_packing_rule_always_fits():
    """rows_fit's guarantee: prompts and completions at their longest, in-order packing needs at most the rows."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        rows, completions, longest, most = (int(rng.integers(1, 6)), int(rng.integers(1, 40)),
                                            int(rng.integers(1, 9)), int(rng.integers(1, 9)))
        seq_len = int(rng.integers(8, 80))
        lengths = rng.integers(2, longest + most + 1, size=completions)
        if rows_fit(longest, most, completions, rows, seq_len) is None:
            assert len(pack_whole(lengths, seq_len, "error", "completions")[0]) <= rows
    assert "raise --seq-len to 312" in rows_fit(15, 24, 16, 2, 256)


def test_prompts_rows(tok_dir, tmp_path):
    tokenizer = build_tokenizer(str(tok_dir))
    chat = ChatFormat(tokenizer, "", "all")
    rows = read_prompts(_write(tmp_path / "p.jsonl", [{"prompt": "x", "answer": 3},
                                                      {"prompt": [{"role": "user", "content": "y"}]}]), tokenizer, chat)
    assert rows[0].columns == {"answer": 3} and rows[1].conversational and not rows[0].conversational
    with pytest.raises(ValueError, match="p.jsonl:1: a --prompts row needs 'prompt'"):
        read_prompts(_write(tmp_path / "p.jsonl", [{"text": "x"}]), tokenizer, chat)


def test_reward_functions_load_and_fail_by_name(tmp_path):
    (tmp_path / "rw.py").write_text(
        "def good(prompts, completions, **kw):\n"
        "    return [len(c) + kw['answer'][i] for i, c in enumerate(completions)]\n"
        "def boom(prompts, completions, **kw):\n    raise KeyError('answer')\n"
        "def short(prompts, completions, **kw):\n    return [1.0]\n"
        "def nan(prompts, completions, **kw):\n    return [float('nan')] * len(completions)\n")
    f = str(tmp_path / "rw.py")
    funcs = load_rewards([f"{f}:good", "math:fsum"], [2.0, 0.5])
    rewards, means = score(funcs[:1], ["p", "p"], ["ab", "abc"], [[1], [2]], {"answer": [1, 10]})
    assert rewards.tolist() == [6.0, 26.0] and means == {"rewards/good/mean": 8.0}
    assert funcs[1].fn([1.0]) == 1.0
    for spec, message in ((f"{tmp_path}/none.py:f", "no such file"), (f"{f}:missing", "has no function 'missing'"),
                          ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
                          ("nocolon", "write FILE.py:FUNC or module:func")):
        with pytest.raises(ValueError, match=f"--reward '{spec}'.*{message}"):
            load_rewards([spec])
    for name, message in (("boom", "raised KeyError: 'answer'"), ("short", "returned 1 rewards for 2 completions"),
                          ("nan", "completion 0 got nan, not a finite number")):
        with pytest.raises(ValueError, match=f"--reward {f}:{name}: {message}"):
            score(load_rewards([f"{f}:{name}"]), ["p", "p"], ["a", "b"], [[1], [2]], {})
