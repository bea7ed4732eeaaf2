"""``loongtrain train --model DIR`` of Qwen3-Next and Kimi-Linear directories (docs/linear-attention.md,
docs/moe-and-gpt-oss.md#deepseek-v3-and-mla): linear-attention layers, softmax attention (Kimi-Linear's MLA) and
experts with shared ones train three steps with the same losses at world 1 and at hp2 x cp2 under ZeRO full (the
model built on the meta device and filled from the files: Kimi-Linear's checkpoint names renamed, its convolutions
concatenated, its score-correction biases read), fp32, rel 1e-5; Qwen3-Next's load-balancing loss the same too; the
export loads in transformers with the logits of loongtrain's own load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from loongtrain.commands import main
from tests.helpers.hybrid_moe import FAMILIES, write_hybrid_dir

BASE = ["--seq-len", "64", "--warmup", "1", "--lr", "1e-2", "--progress", "off", "--peak-tflops", "1",
        "--no-tensorboard", "--no-plot", "--threads", "1", "--no-memory-report", "--dtype", "fp32", "--steps", "3"]
LAYOUTS = {"w1": ["--nproc", "1", "--hp", "1", "--cp", "1"],
           "hp2cp2": ["--nproc", "4", "--hp", "2", "--cp", "2", "--zero", "full"]}


@pytest.fixture(scope="module", params=list(FAMILIES))
def runs(request, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp(request.param)
    model = write_hybrid_dir(root / "model", request.param)
    for name, layout in LAYOUTS.items():
        assert main(["train", *BASE, "--model", str(model), "--out-dir", str(root / name), *layout]) == 0
    return {"family": request.param, "model": model, **{name: root / name for name in LAYOUTS}}


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


def test_world_1_and_world_4_give_the_same_losses(runs):
    one, four = _rows(runs["w1"]), _rows(runs["hp2cp2"])
    assert len(one) == len(four) == 3 and one[0]["loss"] != one[-1]["loss"]
    balanced = runs["family"] == "Qwen3NextForCausalLM"  # Kimi-Linear, as DeepSeek-V3, trains without one
    for a, b in zip(one, four):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (a, b)
        assert ("aux_loss" in a) == balanced
        if balanced:
            assert b["aux_loss"] == pytest.approx(a["aux_loss"], rel=1e-5), (a, b)


def test_export_loads_in_transformers(runs, tmp_path):
    import transformers

    from loongtrain.hf import load_hf_model

    out = tmp_path / "export"
    assert main(["export", str(runs["hp2cp2"]), "--hf", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["architectures"] == [runs["family"]]
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = transformers.AutoModelForCausalLM.from_pretrained(out)(ids).logits
        ours = load_hf_model(out)(ids).logits
        base = transformers.AutoModelForCausalLM.from_pretrained(runs["model"])(ids).logits
        base_ours = load_hf_model(runs["model"])(ids).logits  # the checkpoint's own names read as transformers does
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-6)
    torch.testing.assert_close(base_ours, base, rtol=0, atol=1e-6)
    assert (theirs - base).abs().max() > 1e-3  # three steps at lr 1e-2 moved the weights
