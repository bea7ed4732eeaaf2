"""``loongtrain train --objective sft|dpo`` through the command line (docs/post-training.md).

- The step-1 loss of SFT on identical conversations is the per-token mean Hugging Face's model gives on one
  of them with ``apply_chat_template``'s assistant mask (float32, 1e-4), at world 1 and world 4 (hp2 x cp2);
  the same for DPO on identical pairs with a ``--ref-model`` unlike the policy (world 1 and hp1 x cp4), its
  ``rewards/*`` metrics too.
- A run stopped and resumed gives the losses of an uninterrupted one bit for bit (SFT, and DPO with the
  default reference, which a resume rebuilds from the initial weights), with validation (``val_loss``) and,
  for SFT, the in-loop passkey evaluation on, and ``loongtrain export`` of it loads in transformers.
- A prepared SFT corpus trains like the raw rows; a step whose rows hold no target is skipped with a message.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from loongtrain.commands import main as cli_main
from tests.helpers import chat_data
from tests.helpers.post_training_reference import completion_logp, hf_model, hf_tokenizer, sft_sums, trl_pair_ids

pytest.importorskip("transformers", reason="the hf extra is not installed (pip install -e '.[hf]')")

COMMON = ["--seq-len", "512", "--batch-size", "2", "--dtype", "fp32", "--progress", "off", "--no-plot",
          "--no-tensorboard", "--no-memory-report", "--warmup", "1", "--lr", "1e-2", "--peak-tflops", "1",
          "--threads", "1"]  # one thread: a run in this process would otherwise take every core


def _train(tmp: Path, name: str, *args: str) -> list[dict]:
    out = tmp / name
    assert cli_main(["train", *COMMON, "--out-dir", str(out), *args]) == 0
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def _layout(world: int, hp: int, cp: int) -> list[str]:
    return ["--nproc", str(world), "--hp", str(hp), "--cp", str(cp)]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("post_training_cli")
    chat_data.make_model_dir(tmp / "policy", seed=3)
    chat_data.make_model_dir(tmp / "reference", seed=5)
    return tmp


def test_sft_step1_loss_equals_hf_mean_world1_and_4(dirs, tmp_path):
    one = chat_data.conversation(7, 2)
    corpus = chat_data.write_rows(tmp_path / "same.jsonl", [{"messages": one}] * 12)
    total, count = sft_sums(hf_model(dirs / "policy", torch.float32), hf_tokenizer(dirs / "policy"), [one])
    expected = float(total.detach() / count)
    args = ["--model", str(dirs / "policy"), "--objective", "sft", "--corpus", str(corpus), "--steps", "1"]
    for name, layout in (("w1", _layout(1, 1, 1)), ("w4", _layout(4, 2, 2))):
        record = _train(tmp_path, name, *args, *layout)[0]
        assert abs(record["loss"] - expected) < 1e-4, (name, record["loss"], expected)
        assert record["targets"] == count * 6  # three conversations a row, two rows


def test_dpo_step1_loss_equals_formula_with_ref_model_world1_and_4(dirs, tmp_path):
    pair, beta = chat_data.pair(4), 0.5
    corpus = chat_data.write_rows(tmp_path / "same.jsonl", [pair] * 12)
    tokenizer = hf_tokenizer(dirs / "policy")
    p, c, r = trl_pair_ids(tokenizer, pair["prompt"], pair["chosen"], pair["rejected"])
    policy, ref = hf_model(dirs / "policy", torch.float32), hf_model(dirs / "reference", torch.float32)
    with torch.no_grad():
        chosen = beta * (completion_logp(policy, p, c) - completion_logp(ref, p, c))
        rejected = beta * (completion_logp(policy, p, r) - completion_logp(ref, p, r))
    expected = float(-F.logsigmoid(chosen - rejected))
    assert abs(expected - 0.6931) > 1e-3  # the reference differs from the policy
    args = ["--model", str(dirs / "policy"), "--objective", "dpo", "--corpus", str(corpus), "--steps", "1",
            "--ref-model", str(dirs / "reference"), "--dpo-beta", str(beta)]
    for name, layout in (("w1", _layout(1, 1, 1)), ("w4", _layout(4, 1, 4))):
        record = _train(tmp_path, name, *args, *layout)[0]
        assert abs(record["loss"] - expected) < 1e-4, (name, record["loss"], expected)
        assert abs(record["rewards/chosen"] - float(chosen)) < 1e-4
        assert abs(record["rewards/margins"] - float(chosen - rejected)) < 1e-4
        assert record["rewards/accuracies"] == float(chosen > rejected)


@pytest.mark.parametrize("objective", ["sft", "dpo"])
def test_resume_is_bitwise_with_validation_and_export(dirs, tmp_path, objective):
    corpus = (chat_data.write_conversations(tmp_path / "chat.jsonl", 40) if objective == "sft" else
              chat_data.write_pairs(tmp_path / "pairs.jsonl", 40))
    args = ["--model", str(dirs / "policy"), "--objective", objective, "--corpus", str(corpus), "--steps", "4",
            "--ckpt-interval", "2", "--val-interval", "2", "--val-fraction", "0.25", "--seq-len", "256",
            *_layout(1, 1, 1)]
    if objective == "sft":  # in-loop evaluation beside val_loss
        args += ["--eval-tasks", "passkey", "--eval-lengths", "256", "--eval-trials", "1"]
    whole = _train(tmp_path, "whole", *args)
    _train(tmp_path, "parts", *args, "--stop-after", "2")
    resumed = _train(tmp_path, "parts", *args, "--resume", "auto")
    assert [r["loss"] for r in whole] == [r["loss"] for r in resumed]
    assert [r["grad_norm"] for r in whole] == [r["grad_norm"] for r in resumed]
    assert whole[1]["val_loss"] == resumed[1]["val_loss"] and whole[3]["val_loss"] == resumed[3]["val_loss"]
    assert all(torch.isfinite(torch.tensor(r["loss"])) and not r["skipped"] for r in whole)
    if objective == "sft":
        assert 0 <= whole[1]["eval/passkey/256"] <= 1 and whole[3]["eval/passkey/256"] == resumed[3]["eval/passkey/256"]
    if objective == "dpo":
        assert abs(whole[0]["loss"] - 0.6931471805599453) < 1e-6  # the reference is the policy's initial weights
        assert whole[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    assert cli_main(["export", str(tmp_path / "whole"), "--hf", str(tmp_path / "hf")]) == 0
    exported = hf_model(tmp_path / "hf", torch.float32)
    assert type(exported).__name__ == "LlamaForCausalLM"


def test_prepared_equals_raw_and_no_target_steps_are_skipped(dirs, tmp_path, capsys):
    corpus = chat_data.write_conversations(tmp_path / "chat.jsonl", 12)
    assert cli_main(["prepare", str(corpus), "--objective", "sft", "--tokenizer", str(dirs / "policy"),
                     "--out", str(tmp_path / "prep"), "--workers", "1"]) == 0
    args = ["--model", str(dirs / "policy"), "--objective", "sft", "--steps", "2", *_layout(1, 1, 1)]
    raw = _train(tmp_path, "raw", *args, "--corpus", str(corpus))
    prepared = _train(tmp_path, "prepared", *args, "--corpus", str(tmp_path / "prep"))
    assert [r["loss"] for r in raw] == [r["loss"] for r in prepared]
    # rows of one conversation each; half of them without an assistant turn: some steps have no target
    rows = [{"messages": chat_data.conversation(i, 1)[:2 if i % 2 else 3]} for i in range(8)]
    mixed = chat_data.write_rows(tmp_path / "mixed.jsonl", rows)
    capsys.readouterr()
    records = _train(tmp_path, "mixed", "--model", str(dirs / "policy"), "--objective", "sft", "--corpus", str(mixed),
                     "--steps", "6", "--batch-size", "1", "--seq-len", "128", *_layout(1, 1, 1))
    skipped = [r for r in records if r.get("no_targets")]
    assert skipped and len(skipped) < len(records)
    assert all(r["targets"] == 0 and r["skipped"] == 1 for r in skipped)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in records)
    err = capsys.readouterr().err
    assert f"step {skipped[0]['step']}: no target tokens in any of its sequences" in err
    assert "steps skipped" not in err and "not finite" not in err


def test_trl_formats_train_from_the_command_line(dirs, tmp_path):
    """A saved Hugging Face dataset of prompt-completion rows trains (its targets: the completions' tokens, TRL's
    completion mask), and implicit-prompt pairs prepared with ``loongtrain prepare --objective dpo`` train from
    log(2) (the policy is its own reference at step 1)."""
    import datasets

    from loongtrain.data.chat import ChatFormat
    from loongtrain.data.conversations import encode_row
    from loongtrain.data.tokenizer import build_tokenizer

    rows = [{"prompt": chat_data.conversation(i)[:2], "completion": chat_data.conversation(i)[2:3]} for i in range(8)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "pc"))
    chat = ChatFormat(build_tokenizer(str(dirs / "policy")))
    completion_tokens = [int(encode_row(chat, r, "r")[1][1:].sum()) for r in rows]
    sft = _train(tmp_path, "sft", "--model", str(dirs / "policy"), "--objective", "sft", "--corpus",
                 str(tmp_path / "pc"), "--steps", "1", "--batch-size", "1", "--seq-len", "1024", *_layout(1, 1, 1))
    assert sft[0]["targets"] == sum(completion_tokens) and sft[0]["loss"] == sft[0]["loss"]  # all 8 in one row
    pairs = [{"chosen": chat_data.conversation(i, 1), "rejected": [*chat_data.conversation(i, 1)[:-1],
              {"role": "assistant", "content": f"no idea {i}"}]} for i in range(8)]
    corpus = chat_data.write_rows(tmp_path / "implicit.jsonl", pairs)
    assert cli_main(["prepare", str(corpus), "--objective", "dpo", "--tokenizer", str(dirs / "policy"),
                     "--out", str(tmp_path / "prep"), "--workers", "1"]) == 0
    dpo = _train(tmp_path, "dpo", "--model", str(dirs / "policy"), "--objective", "dpo", "--corpus",
                 str(tmp_path / "prep"), "--steps", "1", *_layout(1, 1, 1))
    assert abs(dpo[0]["loss"] - 0.6931471805599453) < 1e-6 and dpo[0]["pairs"] > 0
