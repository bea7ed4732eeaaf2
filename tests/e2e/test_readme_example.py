"""The README's post-training example (SFT with LoRA of a Hugging Face model, its export, then DPO) runs as
written and gives what the README says to expect: its commands and its figures are read from the README itself,
so the README cannot drift from what works. Checks the outputs each step promises too: the SFT run's
adapter-only checkpoint, the merged export with a PEFT adapter, and the DPO run's TRL-named reward metrics."""

from __future__ import annotations

import json
import math
import re
import shlex
from pathlib import Path

import pytest

from loongtrain.commands import main as cli_main

ROOT = Path(__file__).resolve().parents[2]
#: quiet, and one thread: a run in this process would otherwise take every core (pytest runs two of these at once)
QUICK = ["--progress", "off", "--no-plot", "--no-tensorboard", "--no-memory-report", "--peak-tflops", "1",
         "--threads", "1"]
HEADING = "## Post-training"


def readme_section(heading: str) -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start:end if end > 0 else None]


def readme_commands(heading: str) -> list[list[str]]:
    """The commands of the first bash block under ``heading`` (continuation lines joined, ``$E`` expanded)."""
    block = re.search(r"```bash\n(.*?)```", readme_section(heading), re.S).group(1).replace("\\\n", " ")
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


def expected_figures(heading: str) -> dict[str, float]:
    """The figures the README's "What to expect" paragraph states, by what they are."""
    text = " ".join(readme_section(heading).split())
    patterns = {"sft_first": r"SFT loss starts at ([\d.]+)", "sft_last": r"ends near ([\d.]+) at step \d+",
                "dpo_first": r"first step has loss ([\d.]+) \(log 2\)", "margin": r"rises to about ([\d.]+)",
                "dpo_last": r"loss falls to about ([\d.]+) at step \d+",
                "accuracy": r"`rewards/accuracies` is ([\d.]+)"}
    return {name: float(re.search(p, text).group(1)) for name, p in patterns.items()}


def _metrics(run: Path) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def test_readme_post_training_example_runs_and_gives_what_it_says(tmp_path, monkeypatch):
    commands = readme_commands(HEADING)
    assert [c[:2] for c in commands] == [["loongtrain", "train"], ["loongtrain", "export"], ["loongtrain", "train"]]
    want = expected_figures(HEADING)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    for argv in commands:
        argv = argv[1:]
        assert cli_main(argv + QUICK if argv[0] == "train" else argv) == 0, argv
    sft, dpo = _metrics(tmp_path / "runs/sft"), _metrics(tmp_path / "runs/dpo")
    steps = [int(c[c.index("--steps") + 1]) for c in commands if "--steps" in c]
    assert [len(sft), len(dpo)] == steps and all(r["targets"] > 0 for r in sft)
    assert abs(sft[0]["loss"] - want["sft_first"]) < 0.01 and abs(sft[-1]["loss"] - want["sft_last"]) < 0.05, sft
    export = tmp_path / "runs/sft-hf"
    assert (export / "model.safetensors").is_file()
    assert json.loads((export / "adapter/adapter_config.json").read_text())["r"] == 8
    rewards = {"rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"}
    assert rewards <= set(dpo[0])
    assert abs(dpo[0]["loss"] - want["dpo_first"]) < 1e-4 and abs(want["dpo_first"] - math.log(2)) < 1e-4
    assert dpo[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6) and dpo[0]["rewards/accuracies"] == 0.0
    assert all(r["rewards/accuracies"] == want["accuracy"] for r in dpo[1:]), [r["rewards/accuracies"] for r in dpo]
    assert abs(dpo[-1]["loss"] - want["dpo_last"]) < 0.03 and abs(dpo[-1]["rewards/margins"] - want["margin"]) < 0.05
    assert all(r["pairs"] == 2 for r in dpo)  # "each step holds two pairs"


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
