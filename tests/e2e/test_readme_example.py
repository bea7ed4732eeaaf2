"""The README's post-training example (SFT with LoRA of a Hugging Face model, its export, then DPO) runs as
written, with fewer steps: its commands are read from the README itself, so the README cannot drift from what
works. Checks the outputs each step promises: the SFT run's adapter-only checkpoint, the merged export with a
PEFT adapter, and the DPO run's TRL-named reward metrics."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from loongtrain.commands import main as cli_main

ROOT = Path(__file__).resolve().parents[2]
QUICK = ["--progress", "off", "--no-plot", "--no-tensorboard", "--no-memory-report", "--peak-tflops", "1"]


def readme_commands(heading: str) -> list[list[str]]:
    """The commands of the first bash block under ``heading`` (continuation lines joined, ``$E`` expanded)."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index(heading):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1).replace("\\\n", " ")
    env, commands = {}, []
    for line in block.splitlines():
        line = line.split("  #")[0].strip()
        if not line:
            continue
        if re.fullmatch(r"\w+=\S+", line):
            key, value = line.split("=", 1)
            env[key] = value
            continue
        for key, value in env.items():
            line = line.replace(f"${key}", value)
        commands.append(shlex.split(line))
    return commands


def _metrics(run: Path) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def test_readme_post_training_example_runs(tmp_path, monkeypatch):
    commands = readme_commands("## Post-training")
    assert [c[:2] for c in commands] == [["loongtrain", "train"], ["loongtrain", "export"], ["loongtrain", "train"]]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    for argv in commands:
        argv = argv[1:]
        if argv[0] == "train":
            argv[argv.index("--steps") + 1] = "2"
            argv += QUICK
        assert cli_main(argv) == 0, argv
    sft, dpo = _metrics(tmp_path / "runs/sft"), _metrics(tmp_path / "runs/dpo")
    assert len(sft) == 2 and all(r["loss"] == r["loss"] and r["targets"] > 0 for r in sft)
    export = tmp_path / "runs/sft-hf"
    assert (export / "model.safetensors").is_file()
    assert json.loads((export / "adapter/adapter_config.json").read_text())["r"] == 8
    rewards = {"rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"}
    assert len(dpo) == 2 and rewards <= set(dpo[0])
    assert abs(dpo[0]["loss"] - 0.6931471805599453) < 1e-6  # step 1: the policy is its own reference, log(2)


def test_readme_rl_example_runs(tmp_path, monkeypatch):
    """The README's GRPO example as written, two steps: the online loop's metrics (TRL's keys) come out."""
    (command,) = readme_commands("## Reinforcement learning")
    assert command[:2] == ["loongtrain", "train"] and "--prompts" in command
    monkeypatch.chdir(tmp_path)
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    argv = command[1:]
    argv[argv.index("--steps") + 1] = "2"
    assert cli_main(argv + QUICK) == 0, argv
    records = _metrics(tmp_path / "runs/grpo")
    keys = {"reward", "reward_std", "frac_reward_zero_std", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
            "clip_ratio/region_mean", "completions/mean_length", "time/generate_s", "rewards/lowercase/mean"}
    assert len(records) == 2 and all(keys <= set(r) for r in records)
    assert all(r["completions"] == 16 and 0 <= r["reward"] <= 1 for r in records)
