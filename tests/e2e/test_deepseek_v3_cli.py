"""``loongtrain train --model DEEPSEEK_V3_DIR`` from the command line (docs/moe-and-gpt-oss.md#deepseek-v3-and-mla): a
tiny DeepSeek-V3 directory (MLA, routed experts written apart as ``save_pretrained`` does, shared experts, the
score-correction biases, a dense first layer) trains with the same losses at world 1, at hp2 x cp2 under ZeRO full
(the model built on the meta device, its weights and biases read from the files) and on the double ring (hp1 x cp4,
inner ring 2), the packed documents masked as by default (fp32, rel 1e-5), for three steps; no load-balancing loss
(HF's DeepSeek-V3 has none), the biases unchanged; the export loads in transformers with the same logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from loongtrain.commands import main
from tests.helpers.deepseek import write_deepseek_dir

BASE = ["--seq-len", "64", "--warmup", "1", "--lr", "1e-2", "--progress", "off", "--peak-tflops", "1",
        "--no-tensorboard", "--no-plot", "--threads", "1", "--no-memory-report", "--dtype", "fp32", "--steps", "3"]
LAYOUTS = {"w1": ["--nproc", "1", "--hp", "1", "--cp", "1"],
           "hp2cp2": ["--nproc", "4", "--hp", "2", "--cp", "2", "--zero", "full"],
           "double_ring": ["--nproc", "4", "--hp", "1", "--cp", "4", "--inner-ring", "2"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("deepseek_cli")
    model = write_deepseek_dir(root / "deepseek_v3")
    for name, layout in LAYOUTS.items():
        assert main(["train", *BASE, "--model", str(model), "--out-dir", str(root / name), *layout]) == 0
    return {"model": model, **{name: root / name for name in LAYOUTS}}


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


def test_world_1_and_world_4_give_the_same_losses(runs):
    one = _rows(runs["w1"])
    assert len(one) == 3 and one[0]["loss"] != one[-1]["loss"]  # it trains
    assert all("aux_loss" not in row for row in one)  # HF's DeepSeek-V3 trains without a load-balancing loss
    for name in ("hp2cp2", "double_ring"):
        rows = _rows(runs[name])
        assert len(rows) == 3
        for a, b in zip(one, rows):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (name, a, b)
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5), (name, a, b)


def test_export_loads_in_transformers(runs, tmp_path):
    import transformers

    from loongtrain.hf import load_hf_model

    out = tmp_path / "export"
    assert main(["export", str(runs["hp2cp2"]), "--hf", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["architectures"] == ["DeepseekV3ForCausalLM"]
    biases = {k: v for k, v in load_file(str(out / "model.safetensors")).items() if k.endswith("score_correction_bias")}
    source = load_file(str(runs["model"] / "model.safetensors"))
    assert len(biases) == 2 and all(torch.equal(v, source[k]) for k, v in biases.items())  # buffers, not trained
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = transformers.AutoModelForCausalLM.from_pretrained(out)(ids).logits
        ours = load_hf_model(out)(ids).logits
        base = transformers.AutoModelForCausalLM.from_pretrained(runs["model"])(ids).logits
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-6)
    assert (theirs - base).abs().max() > 1e-3  # three steps at lr 1e-2 moved the weights


def test_plan_max_seq_len_of_the_deepseek_v3_like_preset(capsys):
    """DeepSeek-V3's shape (MLA, 3 dense layers, 256 experts and a shared one) on 64 H200s: an answer, with its
    parameters (the simulation at 128 devices: within 2%, benchmarks/results/RESULTS.md#21-mla-and-deepseek-v3)."""
    import re

    assert main(["plan", "--model", "deepseek-v3-like", "--gpus", "64", "--cluster", "h200", "--max-seq-len"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.search(r"longest sequence for deepseek-v3-like on 64 devices of h200: \d{7} tokens .*; parameters "
                     r"671\.03B total, 37\.55B active$", line), line
