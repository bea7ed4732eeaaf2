"""Validation during training (``--val-interval``): the training is bit-identical with and without it, and
``val_loss`` is the loss of the corpus's last samples."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from loongtrain.data import ByteTokenizer, PackedDataset, TokenStream, build_corpus
from loongtrain.launch.config import TrainConfig, run_of
from loongtrain.model.config import ModelConfig
from loongtrain.model.llama import Transformer
from loongtrain.parallel.config import ParallelConfig
from loongtrain.parallel.mesh import single_process_mesh
from loongtrain.train.validation import tail_batches
from tests.helpers.training import fit

MODEL = ModelConfig(vocab_size=256, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=64)


def _cfg(tmp_path, name: str, **kw) -> TrainConfig:
    corpus = tmp_path / "corpus.jsonl"
    if not corpus.exists():
        corpus.write_text("".join(json.dumps({"text": f"line {i}: the quick brown fox jumps over the lazy dog."}) + "\n"
                                  for i in range(60)))
    return TrainConfig.from_dict(dict(corpus=str(corpus), seq_len=32, steps=4, warmup=1, lr=1e-2, dtype="fp64",
                       parallel=ParallelConfig(), out_dir=str(tmp_path / name), peak_tflops=1.0, tensorboard=False,
                       plot=False, progress="off", memory_report=False, **kw))


@pytest.mark.parametrize("split", [{}, {"val_fraction": 0.25}], ids=["corpus-tail", "val-fraction"])
def test_training_is_bit_identical_with_validation(tmp_path, split):
    mesh, cpu = single_process_mesh(), torch.device("cpu")
    plain = fit(_cfg(tmp_path, "plain", **split), mesh, cpu, model_config=MODEL)
    checked = fit(_cfg(tmp_path, "eval", val_interval=2, val_batches=3, **split), mesh, cpu, model_config=MODEL)
    keys = ("loss", "grad_norm", "lr")
    assert [[r[k] for k in keys] for r in plain] == [[r[k] for k in keys] for r in checked]
    assert [r["step"] for r in checked if "val_loss" in r] == [2, 4]
    assert all("val_loss" not in r for r in plain)
    logged = [json.loads(line) for line in (tmp_path / "eval" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "val_loss" in r] == [2, 4]


def test_validation_restores_the_rng_and_equals_the_tail_loss(tmp_path):
    from loongtrain.train.trainer import Trainer
    from loongtrain.train.validation import validation_loss

    cfg = _cfg(tmp_path, "direct", val_batches=2)
    mesh = single_process_mesh()
    trainer = Trainer(run_of(cfg, MODEL), mesh, torch.device("cpu"))
    batches = tail_batches(cfg, mesh, 2)
    before = torch.get_rng_state()

    def loss_drawing_random_numbers(batch):  # like dropout would: validation must restore the stream
        torch.rand(3)
        return trainer.loss(batch)

    value = validation_loss(loss_drawing_random_numbers, trainer.model, batches, mesh)
    assert torch.equal(torch.get_rng_state(), before)
    assert trainer.model.training and all(p.grad is None for p in trainer.model.parameters())
    # reference: the unsharded model on the corpus's last two samples (the trainer's doc mask: on)
    dataset = PackedDataset(TokenStream(build_corpus(cfg.data.corpus), ByteTokenizer()), 32)
    n = dataset.num_samples()
    assert [b["input_ids"][0].tolist() for b in batches] == [dataset[i]["input_ids"].tolist() for i in (n - 2, n - 1)]
    reference = Transformer(MODEL, seed=cfg.optim.seed).double()
    losses = []
    for batch in batches:
        cu, positions = trainer.ctx.sharding.documents(batch)
        with torch.no_grad():
            logits = reference(batch["input_ids"], positions, cu_seqlens=cu)
        losses.append(F.cross_entropy(logits.reshape(-1, 256), batch["labels"].reshape(-1)).item())
    assert abs(value - sum(losses) / 2) < 1e-12


def test_tail_batches_split_the_tail_between_replicas(tmp_path):
    cfg = _cfg(tmp_path, "tail", batch_size=2)
    dataset = PackedDataset(TokenStream(build_corpus(cfg.data.corpus), ByteTokenizer()), 32)
    n = dataset.num_samples()

    class Replica:  # the two fields tail_batches reads
        def __init__(self, rank):
            self.dp, self.dp_rank = 2, rank

    rows = {r: [b["input_ids"].tolist() for b in tail_batches(cfg, Replica(r), 2)] for r in (0, 1)}
    want = [dataset[i]["input_ids"].tolist() for i in range(n - 8, n)]
    assert rows[0] == [want[0:2], want[4:6]] and rows[1] == [want[2:4], want[6:8]]


def test_tail_batches_read_prepared_corpora_and_mixtures(tmp_path):
    """--val-interval without a split reads the corpus like training does: a prepared corpus gives the
    raw corpus's tail bit for bit, and a mixture's corpora each give their share of the batches (first
    corpus first)."""

    from loongtrain.data.prepare import Sharding, prepare

    cfg = _cfg(tmp_path, "tail", batch_size=2)
    prepare([cfg.data.corpus], tmp_path / "prep", "byte", Sharding(shard_bytes=500), workers=1)
    other = tmp_path / "other.txt"
    other.write_text("".join(f"another corpus, line {i}\n" for i in range(80)))

    class Replica:
        dp, dp_rank = 1, 0

    raw = tail_batches(cfg, Replica(), 3)
    prepared = tail_batches(cfg.replace(corpus=str(tmp_path / "prep")), Replica(), 3)
    assert [b["input_ids"].tolist() for b in raw] == [b["input_ids"].tolist() for b in prepared]
    mixed = tail_batches(cfg.replace(corpus=f"{tmp_path / 'prep'}=0.5,{other}=0.5"), Replica(), 3)
    alone = tail_batches(cfg.replace(corpus=str(other)), Replica(), 1)
    two = tail_batches(cfg, Replica(), 2)  # the first corpus's share of 3: 2 batches, then 1 of the other
    assert [b["input_ids"].tolist() for b in mixed] == [b["input_ids"].tolist() for b in two + alone]


def test_val_interval_trains_on_prepared_corpora_and_mixtures(tmp_path):
    """`--val-interval` without a split on a prepared corpus and on a mixture runs to the end (the
    workers once failed reading the prepared directory as raw) and logs val_loss."""
    from loongtrain.commands import main
    from loongtrain.data.prepare import prepare
    from loongtrain.train.metrics import read_jsonl

    corpus = _cfg(tmp_path, "x").data.corpus
    prepare([corpus], tmp_path / "prep", workers=1)
    base = ["train", "--nproc", "1", "--hp", "1", "--cp", "1", "--seq-len", "16", "--steps", "2", "--warmup", "1",
            "--progress", "off", "--peak-tflops", "1", "--no-tensorboard", "--no-plot", "--threads", "1",
            "--no-memory-report", "--val-interval", "2", "--val-batches", "2"]
    for name, spec in (("prepared", str(tmp_path / "prep")), ("mixture", f"{tmp_path / 'prep'}=0.5,{corpus}=0.5")):
        assert main([*base, "--corpus", spec, "--out-dir", str(tmp_path / name)]) == 0
        assert read_jsonl(tmp_path / name / "metrics.jsonl")[-1]["val_loss"] > 0
