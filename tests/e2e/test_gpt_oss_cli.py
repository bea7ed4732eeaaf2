"""``loongtrain train --model GPT_OSS_DIR`` (docs/attention.md#attention-sinks): a tiny gpt-oss directory (sinks,
alternating sliding/full layers, YaRN, attention biases, experts) trains with the same losses and ``aux_loss`` at
world 1 and at world 4 (hp2 x cp2 with a sliding window shorter than the sequence, hp1 x cp4 under ZeRO full; fp32,
rel 1e-5) for three steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loongtrain.commands import main
from tests.helpers.gpt_oss import hf_gpt_oss

BASE = ["--seq-len", "64", "--warmup", "1", "--lr", "1e-2", "--progress", "off", "--peak-tflops", "1",
        "--no-tensorboard", "--no-plot", "--threads", "1", "--no-memory-report", "--dtype", "fp32", "--steps", "3",
        "--tokenizer", "byte"]


def _gpt_oss_dir(path: Path) -> Path:
    model = hf_gpt_oss(vocab_size=256, router_aux_loss_coef=0.05).float()
    model.config.output_router_logits = True
    model.save_pretrained(path)
    values = json.loads((path / "config.json").read_text())
    for key in ("_attn_implementation", "_experts_implementation"):
        values.pop(key, None)
    (path / "config.json").write_text(json.dumps(values))
    return path


def _train(model: Path, out: Path, *extra: str) -> list[dict]:
    assert main(["train", *BASE, "--model", str(model), "--out-dir", str(out), *extra]) == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


def test_world_1_and_world_4_give_the_same_losses(tmp_path):
    model = _gpt_oss_dir(tmp_path / "gpt_oss")
    one = _train(model, tmp_path / "w1", "--nproc", "1", "--hp", "1", "--cp", "1")
    for layout in (["--hp", "2", "--cp", "2"], ["--hp", "1", "--cp", "4", "--zero", "full"]):
        four = _train(model, tmp_path / ("w4" + "".join(layout)), "--nproc", "4", *layout)
        assert len(one) == len(four) == 3
        for a, b in zip(one, four):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (layout, a, b)
            assert a["aux_loss"] > 1.0 and b["aux_loss"] == pytest.approx(a["aux_loss"], rel=1e-5), (layout, a, b)
    assert one[0]["loss"] != one[-1]["loss"]  # it trains
