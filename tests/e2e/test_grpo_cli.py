"""``loongtrain train --objective grpo`` through the command line (docs/rl.md).

- Bar AB: the step-1 loss on a rollout file equals TRL's own ``GRPOTrainer._compute_loss`` on Hugging Face's
  model (float32, 1e-4) at world 1 and world 4 (hp2 x cp2), for ``--grpo-loss dapo --grpo-beta 0.04
  --ref-model R`` (the reference's log-probabilities from transformers) and for ``--grpo-loss grpo`` on rows
  whose ``old_logps`` push the ratio out of the clip range; TRL's metrics too; the step-2 loss is the same at
  world 1 and world 4.
- The online loop (``--prompts``, a reward from a ``.py`` file) stopped and resumed gives the uninterrupted
  run's losses and rewards bit for bit.
- Bad input exits 2 with one line naming the row or the function, before any worker where it can be known.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from loongtrain.commands import main as cli_main
from tests.helpers import chat_data
from tests.helpers.grpo_reference import completion_logps, trl_advantages, trl_loss, trl_trainer
from tests.helpers.post_training_reference import hf_model, hf_tokenizer, trl_pair_ids

COMMON = ["--seq-len", "128", "--batch-size", "1", "--dtype", "fp32", "--progress", "off", "--no-plot",
          "--no-tensorboard", "--no-memory-report", "--warmup", "0", "--lr", "1e-2", "--peak-tflops", "1",
          "--objective", "grpo", "--threads", "1"]  # one thread: a run in this process would otherwise take every core
G = 4
#: two prompts, four completions each (lengths differ, so dapo's token mean is not grpo's sequence mean)
GROUPS = [("Q1: name a fruit.", [" apple", " no", " a pear, ripe", " fig"], [1.0, 0.0, 0.5, 1.0]),
          ("Q2: count to 3.", [" 1 2 3", " 3", " one two three", " 1 2"], [1.0, 0.0, 0.25, 0.5])]


def _train(tmp: Path, name: str, *args: str) -> list[dict]:
    out = tmp / name
    assert cli_main(["train", *COMMON, "--out-dir", str(out), *args]) == 0
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def _layout(world: int, hp: int, cp: int) -> list[str]:
    return ["--nproc", str(world), "--hp", str(hp), "--cp", str(cp)]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("grpo_cli")
    chat_data.make_model_dir(tmp / "policy", seed=3)
    chat_data.make_model_dir(tmp / "reference", seed=5)
    return tmp


def test_step1_loss_equals_trls_own_world1_and_4_and_step2_agrees(dirs, tmp_path):
    tokenizer = hf_tokenizer(dirs / "policy")
    policy, ref_model = hf_model(dirs / "policy", torch.float32), hf_model(dirs / "reference", torch.float32)
    pieces = [trl_pair_ids(tokenizer, prompt, c, c)[:2] for prompt, completions, _ in GROUPS for c in completions]
    advantages = trl_advantages([r for _, _, rewards in GROUPS for r in rewards], G).tolist()
    with torch.no_grad():
        own = [completion_logps(policy, p, c, hf=True)[0] for p, c in pieces]
        ref = [completion_logps(ref_model, p, c, hf=True)[0] for p, c in pieces]
    # the behaviour policy 0.5 away against each advantage's sign: every ratio leaves [0.8, 1.2]
    old = [(lp - 0.5 * (1 if a > 0 else -1)).tolist() for lp, a in zip(own, advantages)]
    rows = [{"prompt": prompt, "completion": c, "reward": r} for prompt, completions, rewards in GROUPS
            for c, r in zip(completions, rewards)]
    plain = chat_data.write_rows(tmp_path / "rollouts.jsonl", rows)
    with_old = chat_data.write_rows(tmp_path / "old.jsonl", [{**r, "old_logps": o} for r, o in zip(rows, old)])
    cases = {
        "dapo": (["--grpo-loss", "dapo", "--grpo-beta", "0.04", "--ref-model", str(dirs / "reference"),
                  "--corpus", str(plain), "--steps", "2"], dict(loss_type="dapo", beta=0.04), None, ref),
        "grpo": (["--grpo-loss", "grpo", "--corpus", str(with_old), "--steps", "1"], dict(loss_type="grpo"), old, None),
    }
    for name, (args, config, behaviour, reference) in cases.items():
        trainer = trl_trainer(hf_model(dirs / "policy", torch.float32), hf_tokenizer(dirs / "policy"),
                              str(tmp_path / f"trl_{name}"), num_generations=G, max_completion_length=16, **config)
        expected, metrics = trl_loss(trainer, pieces, advantages, pad_id=tokenizer.eos_token_id, old=behaviour,
                                     ref=reference)
        if name == "grpo":
            assert metrics["clip_ratio/region_mean"] == 1.0  # every ratio clipped
        else:
            assert metrics["kl"] > 1e-3 and abs(expected) > 1e-4  # the reference differs; lengths differ
        records = {}
        for world, layout in ((1, _layout(1, 1, 1)), (4, _layout(4, 2, 2))):
            records[world] = _train(tmp_path, f"{name}{world}", "--model", str(dirs / "policy"), *args, *layout,
                                    "--batch-size", "2")  # the eight completions pack into two rows: one step
            first = records[world][0]
            assert abs(first["loss"] - expected) < 1e-4, (name, world, first["loss"], expected)
            for key in ("entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                        *(["kl"] if name == "dapo" else [])):
                assert abs(first[key] - metrics[key]) < 1e-4, (name, world, key, first[key], metrics[key])
            assert first["completions"] == 2 * G and first["frac_reward_zero_std"] == 0.0
        if name == "dapo":  # step 2: after one update, world 1 and world 4 still agree
            assert abs(records[1][1]["loss"] - records[4][1]["loss"]) < 1e-5, (records[1][1], records[4][1])
            assert records[1][1]["loss"] != records[1][0]["loss"]


REWARD = ("def lowercase(prompts, completions, **columns):\n"
          "    return [sum('a' <= c <= 'z' for c in text) / max(1, len(text)) for text in completions]\n"
          "def boom(prompts, completions, **columns):\n    raise KeyError('answer')\n")
PROMPTS = [{"prompt": p} for p in ("Write a word:", "Say something:", "Letters please:", "Go on:", "Type:",
                                   "Next:", "Text:", "More:")]


def _online(dirs: Path, tmp: Path, *extra: str) -> list[str]:
    (tmp / "reward.py").write_text(REWARD)
    prompts = chat_data.write_rows(tmp / "prompts.jsonl", PROMPTS)
    return ["--model", str(dirs / "policy"), "--prompts", str(prompts), "--reward", f"{tmp / 'reward.py'}:lowercase",
            "--num-generations", "4", "--generation-batch-size", "8", "--max-completion-length", "12",
            "--seq-len", "128", "--batch-size", "2", *_layout(1, 1, 1), *extra]


def test_online_loop_resumes_bitwise(dirs, tmp_path):
    """The loop's state (prompt position, sampling generator) is the checkpoint's: stopped after step 2 and
    resumed, steps 3-4 are the uninterrupted run's bit for bit (the reward rising is the reported check of
    examples/rl/, 30 steps: docs/rl.md)."""
    args = _online(dirs, tmp_path, "--steps", "4", "--ckpt-interval", "2")
    whole = _train(tmp_path, "whole", *args)
    _train(tmp_path, "parts", *args, "--stop-after", "2")
    resumed = _train(tmp_path, "parts", *args, "--resume", "auto")[2:]  # metrics.jsonl continues
    assert [r["step"] for r in resumed] == [3, 4]
    for key in ("loss", "grad_norm", "reward", "reward_std", "entropy", "completions/mean_length",
                "rewards/lowercase/mean"):
        assert [r[key] for r in whole[2:]] == [r[key] for r in resumed], key
    assert len({r["reward"] for r in whole}) > 1 and all(r["completions"] == 8 for r in whole)
    assert all(r["time/generate_s"] > 0 for r in whole)


BAD = [
    (["--corpus", "{rows_no_reward}"], "rows.jsonl:1: a rollout row needs 'prompt', 'completion' and 'reward'"),
    (["--corpus", "{rows_single}"], "single.jsonl:1: its group has one completion"),
    (["--corpus", "{rows_long}"], "long.jsonl:1: prompt + completion is"),
    (["--grpo-beta", "0", "--ref-model", "{ref}", "--corpus", "{rows_single}"], "--ref-model"),
    (["--prompts", "{prompts}", "--reward", "{dir}/missing.py:f"], "--reward '{dir}/missing.py:f': no such file"),
    (["--prompts", "{prompts}", "--reward", "{dir}/reward.py:nope"], "has no function 'nope'"),
    (["--prompts", "{prompts}"], "--prompts needs at least one --reward"),
    (["--prompts", "{prompts}", "--reward", "{dir}/reward.py:lowercase", "--num-generations", "1"],
     "--num-generations=1: a group needs at least 2 completions"),
    (["--prompts", "{prompts}", "--reward", "{dir}/reward.py:lowercase", "--reward-weights", "1,2"],
     "2 weights for 1 reward functions"),
    (["--dpo-beta", "0.2", "--corpus", "{rows_single}"], "--dpo-beta applies to --objective dpo"),
]


@pytest.mark.parametrize("args,message", BAD)
def test_bad_inputs_exit_2_before_any_worker(dirs, tmp_path, capsys, no_workers, args, message):
    (tmp_path / "reward.py").write_text(REWARD)
    files = {"dir": str(tmp_path), "ref": str(dirs / "reference"),
             "prompts": str(chat_data.write_rows(tmp_path / "prompts.jsonl", PROMPTS)),
             "rows_no_reward": str(chat_data.write_rows(tmp_path / "rows.jsonl", [{"prompt": "p", "completion": "c"}])),
             "rows_single": str(chat_data.write_rows(tmp_path / "single.jsonl", [
                 {"prompt": "p", "completion": "c", "reward": 1}, {"prompt": "q", "completion": "c", "reward": 1}])),
             "rows_long": str(chat_data.write_rows(tmp_path / "long.jsonl", [
                 {"prompt": "p", "completion": "c" * 200, "reward": 1},
                 {"prompt": "p", "completion": "d", "reward": 0}]))}
    argv = ["train", *COMMON, "--model", str(dirs / "policy"), "--out-dir", str(tmp_path / "out"),
            *[a.format(**files) for a in args]]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message.format(**files) in err[-1], err[-1]


def test_a_reward_that_raises_stops_the_run_naming_it(dirs, tmp_path, capsys):
    args = _online(dirs, tmp_path, "--steps", "2")
    args[args.index("--reward") + 1] = f"{tmp_path / 'reward.py'}:boom"
    assert cli_main(["train", *COMMON, "--out-dir", str(tmp_path / "out"), *args]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"step 1: --reward {tmp_path / 'reward.py'}:boom: raised KeyError: 'answer'" in last, last
