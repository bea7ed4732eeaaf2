"""``loongtrain train --model DIR`` with bad input exits 2 before any worker, with one line naming the value
(docs/hf-models.md#families): an architecture whose layers differ (naming what), hp that does not divide the heads,
a sliding window with the wrong sign; and a family not in the tested list whose layers match trains."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from loongtrain.commands import main

ARGS = ["--seq-len", "24", "--steps", "1", "--warmup", "1", "--progress", "off", "--no-tensorboard", "--no-plot",
        "--threads", "1", "--no-memory-report", "--peak-tflops", "1"]
COMMON = dict(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _model_dir(root: Path, name: str, **extra) -> Path:
    import transformers

    cls = getattr(transformers, name)
    config = cls.config_class(**{**COMMON, **extra})
    config.architectures = [name]
    directory = root / f"{name}{len(extra)}"
    directory.mkdir()
    values = json.loads(config.to_json_string())
    values.pop("_attn_implementation", None)
    (directory / "config.json").write_text(json.dumps(values))  # no weights: a seeded init
    return directory


@pytest.fixture()
def corpus(tmp_path) -> str:
    path = tmp_path / "corpus.txt"
    path.write_text("".join(f"line {i}: the quick brown fox\n" for i in range(100)))
    return str(path)


@pytest.mark.parametrize("name, extra, layout, needle", [
    ("Gemma2ForCausalLM", {}, ["--nproc", "1"], "'Gemma2ForCausalLM': config attn_logit_softcapping=50.0"),
    ("NemotronHForCausalLM", {}, ["--nproc", "1"], "layer_types[1]='moe'"),
    ("LlamaForCausalLM", {}, ["--nproc", "3", "--hp", "3", "--cp", "1"], "num_heads=4 must be divisible by hp=3"),
    ("MistralForCausalLM", {"sliding_window": -4}, ["--nproc", "1"], "sliding_window=-4 must be None"),
])
def test_bad_model_input_exits_2_with_one_line(tmp_path, corpus, capsys, name, extra, layout, needle):
    directory = _model_dir(tmp_path, name, **extra)
    out = tmp_path / "run"
    code = main(["train", "--model", str(directory), "--corpus", corpus, "--out-dir", str(out), *ARGS, *layout])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    errors = [line for line in err if "error:" in line]
    assert len(errors) == 1 and needle in errors[0], err
    assert not (out / "metrics.jsonl").exists()


def test_untested_family_with_matching_layers_trains(tmp_path, corpus):
    directory = _model_dir(tmp_path, "Olmo2ForCausalLM")
    out = tmp_path / "run"
    torch.manual_seed(0)
    assert main(["train", "--model", str(directory), "--corpus", corpus, "--out-dir", str(out), *ARGS,
                 "--nproc", "1", "--hp", "1", "--cp", "1"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("loss" in row for row in rows)
