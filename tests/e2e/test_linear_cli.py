"""``loongtrain train --model QWEN3_5_DIR`` from the command line (docs/linear-attention.md): a tiny Qwen3.5
directory (linear and full attention layers) trains with the same losses at world 1 and world 4 (hp2 x cp2 under
ZeRO full without document masks, and hp1 x cp4 on the double ring with packed documents (the default) against
world 1 with them; fp32, rel 1e-5) for
three steps; selective recompute gives the same losses; the export loads in transformers with the trained weights;
a linear-attention block loongtrain does not run exits 2 before any worker."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from loongtrain.commands import main
from tests.helpers.linear_models import write_qwen3_5_dir

BASE = ["--seq-len", "64", "--warmup", "1", "--lr", "1e-2", "--progress", "off", "--peak-tflops", "1",
        "--no-tensorboard", "--no-plot", "--threads", "1", "--no-memory-report", "--dtype", "fp32", "--steps", "3"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("linear_cli")
    corpus = root / "short_documents.jsonl"  # documents of 14 to 40 bytes: several per sequence of 64
    corpus.write_text("".join(json.dumps({"text": f"doc {i}: " + "ab cd " * (i % 6)}) + "\n" for i in range(400)))
    return write_qwen3_5_dir(root / "qwen3_5")


def _train(model: Path, out: Path, *extra: str) -> list[dict]:
    corpus = model.parent / "short_documents.jsonl"
    assert main(["train", *BASE, "--corpus", str(corpus), "--model", str(model), "--out-dir", str(out), *extra]) == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


@pytest.fixture(scope="module")
def runs(model_dir, tmp_path_factory) -> dict[str, list[dict]]:
    root = tmp_path_factory.mktemp("linear_runs")
    return {
        "w1": _train(model_dir, root / "w1", "--nproc", "1", "--hp", "1", "--cp", "1", "--doc-mask", "off"),
        "w4": _train(model_dir, root / "w4", "--nproc", "4", "--hp", "2", "--cp", "2", "--zero", "full",
                     "--doc-mask", "off"),
        "w1_docs": _train(model_dir, root / "w1_docs", "--nproc", "1", "--hp", "1", "--cp", "1"),
        "w4_docs": _train(model_dir, root / "w4_docs", "--nproc", "4", "--hp", "1", "--cp", "4", "--inner-ring", "2"),
        "root": root,  # type: ignore[dict-item]
    }


@pytest.mark.parametrize("one, four", [("w1", "w4"), ("w1_docs", "w4_docs")])
def test_world_1_and_world_4_give_the_same_losses(runs, one, four):
    assert len(runs[one]) == len(runs[four]) == 3
    for a, b in zip(runs[one], runs[four]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (a, b)
    assert runs[one][0]["loss"] != runs[one][-1]["loss"]  # it trains
    assert runs["w1_docs"][0]["loss"] != runs["w1"][0]["loss"]  # the documents reached the model


def test_selective_recompute_gives_the_same_losses(runs, model_dir, tmp_path):
    rows = _train(model_dir, tmp_path / "run", "--nproc", "1", "--hp", "1", "--cp", "1", "--recompute", "selective",
                  "--doc-mask", "off")
    for a, b in zip(runs["w1"], rows, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and b["grad_norm"] == pytest.approx(a["grad_norm"],
                                                                                                     rel=1e-5)


def test_export_loads_in_transformers(runs, model_dir, tmp_path):
    import transformers

    from loongtrain.hf import load_hf_model

    out = tmp_path / "export"
    assert main(["export", str(runs["root"] / "w1"), "--hf", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3_5ForCausalLM"]
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = transformers.AutoModelForCausalLM.from_pretrained(out)(ids).logits
        ours = load_hf_model(out)(ids).logits
        base = transformers.AutoModelForCausalLM.from_pretrained(model_dir)(ids).logits
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-6)
    assert (theirs - base).abs().max() > 1e-3  # three steps at lr 1e-2 moved the weights


def test_a_linear_block_loongtrain_does_not_run_exits_2(model_dir, tmp_path, capsys):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").symlink_to(model_dir / "model.safetensors")
    values = {**json.loads((model_dir / "config.json").read_text()), "hidden_act": "gelu"}
    (bad / "config.json").write_text(json.dumps(values))
    argv = ["train", *BASE, "--nproc", "4", "--hp", "2", "--cp", "2", "--model", str(bad), "--out-dir",
            str(tmp_path / "run")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "activation='gelu'" in err, err


def test_plan_max_seq_len_of_a_qwen3_5_27b_shape_on_8_h200s(capsys):
    import re

    config = Path(__file__).resolve().parents[2] / "benchmarks/inputs/qwen3.5-27b"
    assert main(["plan", "--model", str(config), "--gpus", "8", "--cluster", "h200", "--max-seq-len"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    found = re.search(r"longest sequence for .* on 8 devices of h200: (\d+) tokens .*; parameters 26\.90B$", line)
    assert found and int(found.group(1)) > 1 << 20, line
