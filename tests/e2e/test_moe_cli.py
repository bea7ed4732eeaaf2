"""``loongtrain train --model MOE_DIR`` from the command line (docs/moe-and-gpt-oss.md#mixture-of-experts): a tiny
Qwen3-MoE directory (per-expert weight files, as ``save_pretrained`` writes them) trains with the same losses and
``aux_loss`` at world 1 and at world 4 (hp2 x cp2, ZeRO full; fp32, rel 1e-5) for three steps, and with recompute;
resuming continues the run bit for bit; the export loads in transformers; experts or a top-k that do not fit exit 2
before any worker; ``plan --max-seq-len`` of Qwen3-30B-A3B agrees with the simulation within 5%."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from loongtrain.commands import main
from tests.helpers.moe import write_moe_dir

pytest.importorskip("transformers", reason="the hf extra is not installed (pip install -e '.[hf]')")

BASE = ["--seq-len", "64", "--warmup", "1", "--lr", "1e-2", "--progress", "off", "--peak-tflops", "1",
        "--no-tensorboard", "--no-plot", "--threads", "1", "--no-memory-report", "--dtype", "fp32", "--steps", "3"]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    return write_moe_dir(tmp_path_factory.mktemp("moe_cli") / "qwen3_moe", "Qwen3MoeForCausalLM", vocab_size=256)


def _train(model: Path, out: Path, *extra: str) -> list[dict]:
    assert main(["train", *BASE, "--model", str(model), "--out-dir", str(out), *extra]) == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


@pytest.fixture(scope="module")
def runs(moe_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe_runs")
    _train(moe_dir, root / "w1", "--nproc", "1", "--hp", "1", "--cp", "1", "--ckpt-interval", "1")
    _train(moe_dir, root / "w4", "--nproc", "4", "--hp", "2", "--cp", "2", "--zero", "full")
    return {"w1": root / "w1", "w4": root / "w4"}


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


def test_world_1_and_world_4_give_the_same_losses_and_aux_loss(runs):
    one, four = _rows(runs["w1"]), _rows(runs["w4"])
    assert len(one) == len(four) == 3
    for a, b in zip(one, four):
        assert a["aux_loss"] > 1.0  # num_experts * sum f_e P_e >= 1 (equal at perfect balance)
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (a, b)
        assert b["aux_loss"] == pytest.approx(a["aux_loss"], rel=1e-5), (a, b)
    assert one[0]["loss"] != one[-1]["loss"] and one[0]["aux_loss"] != one[-1]["aux_loss"]  # it trains


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_recompute_gives_the_same_losses(recompute, runs, moe_dir, tmp_path):
    # the recomputing backward records no router statistics (they were the forward's) and saves what it did
    rows = _train(moe_dir, tmp_path / "run", "--nproc", "1", "--hp", "1", "--cp", "1", "--recompute", recompute)
    for a, b in zip(_rows(runs["w1"]), rows, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and b["aux_loss"] == pytest.approx(a["aux_loss"],
                                                                                                     rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)


def test_resume_continues_bit_for_bit(runs, moe_dir, tmp_path):
    straight = [(r["loss"], r["aux_loss"]) for r in _rows(runs["w1"])]
    args = ["--nproc", "1", "--hp", "1", "--cp", "1", "--ckpt-interval", "1"]
    first = _train(moe_dir, tmp_path / "run", *args, "--stop-after", "2")
    rest = _train(moe_dir, tmp_path / "run", *args, "--resume")
    assert len(first) == 2 and [(r["loss"], r["aux_loss"]) for r in rest] == straight


def test_export_loads_in_transformers(runs, moe_dir, tmp_path):
    import transformers

    from loongtrain.hf import load_hf_model

    out = tmp_path / "export"
    assert main(["export", str(runs["w1"]), "--hf", str(out)]) == 0
    exported = json.loads((out / "config.json").read_text())
    assert exported["architectures"] == ["Qwen3MoeForCausalLM"] and exported["output_router_logits"] is True
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = transformers.AutoModelForCausalLM.from_pretrained(out)(ids).logits
        ours = load_hf_model(out)(ids).logits
        base = transformers.AutoModelForCausalLM.from_pretrained(moe_dir)(ids).logits
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-6)
    assert (theirs - base).abs().max() > 1e-3  # three steps at lr 1e-2 moved the weights


def test_plan_max_seq_len_of_qwen3_30b_a3b_agrees_with_the_simulation(capsys):
    config = Path(__file__).resolve().parents[2] / "benchmarks/inputs/qwen3-30b-a3b"
    argv = ["plan", "--model", str(config), "--gpus", "8", "--cluster", "h200", "--max-seq-len"]
    assert main(argv) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.search(r"longest sequence for .* on 8 devices of h200: \d+ tokens .*; parameters 30\.53B total, "
                     r"3\.35B active$", line), line
    assert main([*argv, "--simulate", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["seq_len"] > 1 << 20 and result["fits"]
    assert abs(result["device_ratio"] - 1) <= 0.05, result


def _no_workers(monkeypatch) -> None:
    from loongtrain.launch import train_run

    def refuse(*args, **kwargs):
        raise AssertionError("a worker started")

    monkeypatch.setattr(train_run, "run_worker", refuse)
    monkeypatch.setattr(train_run, "_launch_local", refuse)


@pytest.mark.parametrize("change, message", [
    ({"num_experts_per_tok": 9}, r"num_experts_per_tok=9 must be between 1 and the number of experts \(8\)"),
    ({"num_experts_per_tok": 0}, r"num_experts_per_tok=0 must be between 1 and the number of experts \(8\)"),
    ({"num_local_experts": 4}, r"weight 'model\.layers\.0\.mlp\.\S+' has shape \(8, .*\) but config\.json needs "
                               r"\(4, "),
    ({"mlp_tiles": "2"}, r"--mlp-tiles 2: .* has experts, whose MLPs run untiled; use --mlp-tiles 1"),
], ids=["top-k-over-experts", "top-k-zero", "experts-not-the-weights", "mlp-tiles"])
def test_experts_or_top_k_that_do_not_fit_exit_2_before_any_worker(change, message, moe_dir, tmp_path, monkeypatch,
                                                                     capsys):
    _no_workers(monkeypatch)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").symlink_to(moe_dir / "model.safetensors")
    change = dict(change)
    tiles = change.pop("mlp_tiles", None)
    values = {**json.loads((moe_dir / "config.json").read_text()), **change}
    (bad / "config.json").write_text(json.dumps(values))
    argv = ["train", *BASE, "--nproc", "4", "--hp", "2", "--cp", "2", "--model", str(bad), "--out-dir",
            str(tmp_path / "run"), *(["--mlp-tiles", tiles] if tiles else [])]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("loongtrain train: error: ")
    assert re.search(message, err), err
