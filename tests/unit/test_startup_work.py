"""Start-up does each piece of work once (one training path): every rank tokenizes each document
of the corpus once, with the memory report on, and the launcher builds the tokenizer once."""

from __future__ import annotations

import json
from collections import Counter

import torch

from loongtrain.data.tokenizer import ByteTokenizer
from loongtrain.launch import train_run as launch_module
from loongtrain.launch.config import TrainConfig
from loongtrain.launch.train_run import resolve_run
from loongtrain.parallel.mesh import single_process_mesh
from loongtrain.train import model_setup
from loongtrain.train.trainer import Trainer

DOCS = [f"document {i}: " + "lorem ipsum dolor sit amet " * (20 + i) for i in range(12)]


def _cfg(tmp_path) -> TrainConfig:
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS))
    return TrainConfig.from_dict(dict(
        corpus=str(corpus), seq_len=256, steps=1, out_dir=str(tmp_path / "run"), tokenizer="byte", progress="off",
        tensorboard=False, plot=False, memory_report=True, hp=1, cp=1, peak_tflops=1.0))


def test_each_document_is_tokenized_once_per_rank_with_the_memory_report_on(tmp_path, monkeypatch):
    run = resolve_run(_cfg(tmp_path), world=1)
    calls: Counter[str] = Counter()
    real = ByteTokenizer.encode_tensor

    def counting(self, text: str) -> torch.Tensor:
        calls[text] += 1
        return real(self, text)

    monkeypatch.setattr(ByteTokenizer, "encode_tensor", counting)
    records = Trainer(run, single_process_mesh(), torch.device("cpu")).train()
    assert len(records) == 1 and "mem_total_gib" in records[0]  # the report ran
    assert set(calls) == set(DOCS), "the shuffled sampler reads the whole corpus"
    assert max(calls.values()) == 1, f"documents tokenized more than once: {calls.most_common(2)}"


def test_the_launcher_builds_the_tokenizer_once(tmp_path, monkeypatch):
    built = []
    real = model_setup.build_run_tokenizer

    def counting(cfg):
        built.append(cfg.tokenizer)
        return real(cfg)

    monkeypatch.setattr(launch_module, "build_run_tokenizer", counting)
    run = resolve_run(_cfg(tmp_path), world=1)
    assert built == ["byte"] and run.tokenizer is not None
    assert run.model_config.vocab_size >= run.tokenizer.vocab_size
