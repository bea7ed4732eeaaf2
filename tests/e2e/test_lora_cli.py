"""``loongtrain train --lora``, ``loongtrain export`` and ``loongtrain plan --lora`` from the command line
(docs/lora.md), in this process:

- bad ``--lora`` values exit 2 before any worker starts, with one line naming the value and the fix (targets
  that match no module list the valid names; r, alpha, dropout out of range; an unknown key);
- a LoRA run of the native preset and of an HF Llama directory writes checkpoints that hold only the
  adapters and name their base; resuming is bit-identical to the uninterrupted run;
- export writes the merged model and ``OUT/adapter/`` in PEFT's format: ``PeftModel.from_pretrained(base,
  OUT/adapter)`` gives the merged model's logits, and they differ from the base's (the adapters trained);
- a base whose files changed is refused by ``--resume`` and ``export``, naming it;
- ``plan --max-seq-len --lora`` prints how much longer a sequence fits than full training."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from loongtrain.commands import main
from tests.helpers.lora import make_llama_dir

pytest.importorskip("peft", reason="the hf extra is not installed (pip install -e '.[hf]')")

BASE = ["--nproc", "1", "--hp", "1", "--cp", "1", "--seq-len", "64", "--warmup", "1", "--lr", "1e-2",
        "--progress", "off", "--peak-tflops", "1", "--no-tensorboard", "--no-plot", "--threads", "1",
        "--no-memory-report"]
LORA = "r=4,alpha=8,targets=all-linear"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return make_llama_dir(tmp_path_factory.mktemp("lora_cli") / "llama")


def _no_workers(monkeypatch) -> None:
    from loongtrain.launch import train_run

    def refuse(*args, **kwargs):
        raise AssertionError("a worker started")

    monkeypatch.setattr(train_run, "run_worker", refuse)
    monkeypatch.setattr(train_run, "_launch_local", refuse)


@pytest.mark.parametrize("model, lora, message", [
    ("tiny", "targets=x_proj", r"--lora targets=x_proj: x_proj matches no linear module of the Transformer decoder "
     r"blocks; valid module names: down_proj \(w2\), gate_proj \(w1\), k_proj \(wk\), o_proj \(wo\), q_proj \(wq\), "
     r"up_proj \(w3\), v_proj \(wv\), or all-linear"),
    ("hf", "targets=q_proj,wq", r"--lora targets=q_proj,wq: wq matches no linear module of the LlamaForCausalLM "
     r"decoder blocks; valid module names: down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj"),
    ("tiny", "r=0", r"--lora r=0 must be a positive integer \(e.g. r=16\)"),
    ("tiny", "r=-4", r"--lora r=-4 must be a positive integer"),
    ("tiny", "r=2.5", r"--lora 'r=2.5': r='2.5' is not an integer"),
    ("tiny", "alpha=0", r"--lora alpha=0.0 must be a positive number \(e.g. alpha=32"),
    ("tiny", "alpha=-1", r"--lora alpha=-1.0 must be a positive number"),
    ("tiny", "dropout=1", r"--lora dropout=1.0 must be in \[0, 1\)"),
    ("tiny", "dropout=-0.1", r"--lora dropout=-0.1 must be in \[0, 1\)"),
    ("tiny", "rank=8", r"--lora 'rank=8': unknown key 'rank'; valid keys: r, alpha, dropout, targets"),
    ("tiny", "r=8,r=4", r"--lora 'r=8,r=4': r is given twice"),
    ("tiny", "16", r"--lora '16': '16' is not key=value"),
    ("tiny", "targets=", r"--lora targets='' must name at least one module"),
], ids=["no-module", "hf-native-name", "r-zero", "r-negative", "r-float", "alpha-zero", "alpha-negative",
        "dropout-one", "dropout-negative", "unknown-key", "twice", "no-key", "no-targets"])
def test_bad_lora_exits_2_before_any_worker(model, lora, message, hf_dir, tmp_path, monkeypatch, capsys):
    _no_workers(monkeypatch)
    argv = ["train", *BASE, "--model", str(hf_dir) if model == "hf" else model, "--lora", lora,
            "--out-dir", str(tmp_path / "run")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("loongtrain train: error: ")
    assert re.search(message, err), err


def test_lora_refuses_what_it_does_not_compose_with(tmp_path, monkeypatch, capsys):
    _no_workers(monkeypatch)
    argv = ["train", *BASE, "--lora", "dropout=0.1,targets=up_proj", "--mlp-tiles", "2", "--out-dir", str(tmp_path)]
    assert main(argv) == 2
    assert "--lora dropout=0.1 on MLP modules with --mlp-tiles 2" in capsys.readouterr().err
    argv = ["train", *BASE, "--lora", "r=4", "--init-from", str(tmp_path), "--out-dir", str(tmp_path / "b")]
    assert main(argv) == 2
    assert "--lora with --init-from" in capsys.readouterr().err
    assert main(["plan", "--model", "7b-gqa", "--gpus", "1", "--cluster", "h200", "--seq-len", "8K",
                 "--lora", "r=0"]) == 2
    assert "--lora r=0 must be a positive integer" in capsys.readouterr().err


def _train(model: str, out: Path, *extra: str) -> list[float]:
    assert main(["train", *BASE, "--model", model, "--lora", LORA, "--out-dir", str(out), *extra]) == 0
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in line]


@pytest.fixture(scope="module")
def runs(hf_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora_runs")
    out = {}
    for kind, model in (("native", "tiny"), ("hf", str(hf_dir))):
        _train(model, root / kind, "--steps", "3", "--ckpt-interval", "1")
        out[kind] = root / kind
    return out


def test_checkpoints_hold_only_the_adapters_and_name_the_base(runs, hf_dir):
    import torch.distributed.checkpoint as dcp

    for kind, run in runs.items():
        step = run / "checkpoints" / "step_00000003"
        keys = dcp.FileSystemReader(str(step)).read_metadata().state_dict_metadata
        model_keys = [k for k in keys if k.startswith("model.")]
        assert len(model_keys) == 2 * 7 * 2 and all(".lora_A." in k or ".lora_B." in k for k in model_keys), keys
        record = json.loads((step / "trainer_state.json").read_text())["lora"]
        assert record["config"] == {"r": 4, "alpha": 8.0, "dropout": 0.0, "targets": ["all-linear"]}
        base = record["base"]
        assert base["identity"].startswith("sha256:")
        assert (base["kind"], base.get("directory")) == (("preset", None) if kind == "native"
                                                         else ("hf", str(hf_dir.resolve())))


def test_resume_is_bit_identical(runs, tmp_path):
    straight = [json.loads(line)["loss"] for line in (runs["native"] / "metrics.jsonl").read_text().splitlines()
                if '"loss"' in line]
    first = _train("tiny", tmp_path, "--steps", "3", "--stop-after", "2")
    rest = _train("tiny", tmp_path, "--steps", "3", "--resume")
    assert len(first) == 2 and rest[:2] == first and rest == straight  # metrics.jsonl continues: the 3 steps


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("kind", ["native", "hf"])
def test_export_writes_the_merged_model_and_a_peft_adapter(kind, runs, hf_dir, tmp_path, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "export"
    assert main(["export", str(runs[kind]), "--hf", str(out)]) == 0
    assert "adapter/" in capsys.readouterr().out
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    base_dir = out / "base" if kind == "native" else hf_dir
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["lora_dropout"]) == ("LORA", 4, 8.0, 0.0)
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert config["base_model_name_or_path"] == str(base_dir.resolve())
    merged = AutoModelForCausalLM.from_pretrained(out)
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    ids = torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(0))
    plain = _logits(base, ids)
    adapted = _logits(PeftModel.from_pretrained(base, out / "adapter"), ids)
    want = _logits(merged, ids)
    assert (adapted - want).abs().max() <= 1e-4 * want.abs().max()  # fp32: the merge rounds once
    assert (plain - want).abs().max() > 100 * (adapted - want).abs().max()  # the adapters trained


def test_a_changed_base_is_refused(hf_dir, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    base = tmp_path / "llama"
    shutil.copytree(hf_dir, base)
    _train(str(base), tmp_path / "run", "--steps", "1")
    weights = load_file(str(base / "model.safetensors"))
    name = sorted(weights)[0]
    weights[name] = weights[name] + 1.0
    save_file(weights, str(base / "model.safetensors"), metadata={"format": "pt"})
    capsys.readouterr()
    assert main(["export", str(tmp_path / "run"), "--hf", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"its LoRA base {str(base.resolve())!r} changed since training" in err and len(err.splitlines()) == 1
    assert main(["train", *BASE, "--model", str(base), "--lora", LORA, "--out-dir", str(tmp_path / "run"),
                 "--steps", "2", "--resume"]) == 2
    assert "changed since training" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_plan_max_seq_len_shows_how_much_longer_lora_fits(capsys):
    argv = ["plan", "--model", "7b-gqa", "--gpus", "1", "--cluster", "h200", "--max-seq-len", "--modes", "off",
            "--json"]
    assert main([*argv, "--lora", "r=16,alpha=32,dropout=0,targets=q_proj,k_proj,v_proj,o_proj"]) == 0
    lora = json.loads(capsys.readouterr().out)
    assert main(argv) == 0
    full = json.loads(capsys.readouterr().out)
    assert lora["full_training_max_seq_len"] == full["max_seq_len"]
    assert lora["max_seq_len"] > 1.5 * full["max_seq_len"]  # 16 bytes of states per weight become 4
    parts, full_parts = lora["candidate"]["memory_parts_gib"], full["candidate"]["memory_parts_gib"]
    assert parts["states"] < 0.3 * full_parts["states"]
    assert main([*argv[:-1], "--lora", "r=16"]) == 0
    assert "LoRA fits" in capsys.readouterr().out


def test_eval_of_a_lora_checkpoint_equals_eval_of_its_export(runs, tmp_path):
    assert main(["export", str(runs["native"]), "--hf", str(tmp_path / "export")]) == 0
    results = []
    for name, model in (("lora", runs["native"]), ("merged", tmp_path / "export")):
        out = tmp_path / name
        assert main(["eval", str(model), "--task", "position-loss", "--seq-len", "64", "--docs", "1", "--nproc", "1",
                     "--threads", "1", "--hp", "1", "--cp", "1", "--corpus", "stdlib", "--out", str(out)]) == 0
        results.append(json.loads((out / "results.json").read_text()))
    lora, merged = results
    assert [r["tokens"] for r in lora] == [r["tokens"] for r in merged] and lora
    assert all(abs(a["loss"] - b["loss"]) <= 1e-4 for a, b in zip(lora, merged, strict=True)), (lora, merged)
