"""Sharded evaluation equals unsharded evaluation (fp64, world 4, one launch for every layout): per-bucket
losses (zigzag, and the run's --chunk-order balanced, whose shard eval really takes) and validation losses
to 1e-10, the same passkey decisions; and a training step after a
validation and the in-loop evaluations (--eval-tasks) is bit-identical to one without, under FSDP2 with two
replicas."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from loongtrain.data import ByteTokenizer
from loongtrain.data.synthetic import global_batch
from loongtrain.eval.forward import sharded_forward
from loongtrain.eval.in_loop import PasskeyEvaluation, PositionLossEvaluation, PositionSequences
from loongtrain.eval.passkey import passkey, passkey_tokens
from loongtrain.eval.position_loss import position_loss
from loongtrain.model.config import ModelConfig
from loongtrain.model.llama import Transformer
from loongtrain.parallel.config import ParallelConfig
from loongtrain.parallel.mesh import destroy_mesh, init_mesh, single_process_mesh
from loongtrain.parallel.zigzag import shard_indices
from loongtrain.parallelize.compose import parallelize
from loongtrain.sections.data import DataSection
from loongtrain.train.batch import batch_chunk_order, batch_documents
from loongtrain.launch.config import TrainConfig, run_of
from loongtrain.train.validation import Validation, validation_loss
from tests.helpers.dist_utils import run_distributed

pytestmark = pytest.mark.distributed

MODEL = ModelConfig(vocab_size=256, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=64,
                    tie_embeddings=True)
LAYOUTS = [dict(hp=2, cp=2), dict(hp=1, cp=4), dict(hp=4, cp=1), dict(hp=1, cp=4, inner_ring=2),
           dict(hp=2, cp=1, zero="full")]  # the last: dp = 2 replicas, FSDP2
SEQ, LENGTHS, DEPTHS, TRIALS = 64, (96, 192), (0.0, 0.5, 1.0), 1  # two 96-token prompts a forward
CPU = torch.device("cpu")


def _model() -> torch.nn.Module:
    """A seeded model whose blocks barely change the residual stream (tied head): it mostly predicts the
    current token, so some passkey digits (a key digit after an equal one) are right, some wrong."""
    model = Transformer(MODEL, seed=0).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("wo.weight", "w2.weight")):
                p.mul_(0.05)
    return model


def _documents() -> list[dict[str, torch.Tensor]]:
    """Three sequences (an odd count: the two replicas pad) with packed-document marks."""
    out = []
    for i in range(3):
        batch = global_batch(i, 1, SEQ, MODEL.vocab_size, seed=3)
        starts = torch.zeros(1, SEQ, dtype=torch.bool)
        starts[0, [0, 40 + i]] = True
        out.append({**batch, "doc_starts": starts})
    return out


def _val_batches() -> list[dict[str, torch.Tensor]]:
    return [global_batch(10 + i, 1, SEQ, MODEL.vocab_size, seed=4) for i in range(4)]


def _cfg(parallel: ParallelConfig) -> TrainConfig:
    return TrainConfig.from_dict(dict(seq_len=SEQ, dtype="fp64", parallel=parallel, steps=3, warmup=1, lr=1e-2, memory_report=False))


def _evaluate(model, mesh) -> dict:
    tokens = passkey_tokens(ByteTokenizer())
    return {
        "buckets": position_loss(model, _documents(), mesh, CPU, SEQ, doc_mask="on"),
        "balanced": position_loss(model, _documents(), mesh, CPU, SEQ, doc_mask="on", chunk_order="balanced"),
        "passkey": passkey(model, tokens, LENGTHS, DEPTHS, TRIALS, mesh, CPU, seed=1),
    }


def _validate(parallel: ParallelConfig, mesh) -> float:
    from loongtrain.train.trainer import Trainer

    trainer = Trainer(run_of(_cfg(parallel), MODEL), mesh, CPU)
    mine = _val_batches()[mesh.dp_rank::mesh.dp]
    return validation_loss(trainer.loss, trainer.model, mine, mesh)


def _in_loop_evaluations() -> tuple:
    """Both tasks as the trainer runs them (--eval-tasks), on this file's prompts and documents."""
    sequences = PositionSequences(DataSection(corpus="unread", seq_len=SEQ), ByteTokenizer(), 3, 0)
    return (PasskeyEvaluation(passkey_tokens(ByteTokenizer()), LENGTHS, TRIALS, 1, DEPTHS),
            PositionLossEvaluation(sequences, "on", True, "zigzag", None, _batches=_documents()))


def _steps(parallel: ParallelConfig, mesh, validate: bool) -> list[tuple[float, float]]:
    """Two steps; with ``validate``, the trainer's hook between them: the validation loss and the in-loop
    evaluations (Validation.after_step)."""
    from loongtrain.train.trainer import Trainer

    cfg = _cfg(parallel).replace(val_interval=1)
    trainer = Trainer(run_of(cfg, MODEL), mesh, CPU)
    hook = Validation(cfg, trainer.ctx, trainer.objective.validation_loss, _val_batches()[:1],
                      evaluations=_in_loop_evaluations())
    out = []
    for step in range(2):
        batch = global_batch(step, mesh.dp, SEQ, MODEL.vocab_size, seed=5)
        result = trainer.step([{k: v[mesh.dp_rank:mesh.dp_rank + 1] for k, v in batch.items()}])
        out.append((result["loss"], result["grad_norm"]))
        if validate and step == 0:
            metrics = hook.after_step(1, cfg)
            assert {"val_loss", "eval/passkey/96", "eval/position_loss/0-8"} <= set(metrics), metrics
    return out


def _balanced_index(model, mesh) -> tuple[list[int], list[int], list[int]]:
    """The tokens this rank's balanced eval forward held, the trainer's balanced shard, and the zigzag one."""
    batch = _documents()[0]
    cu_seqlens, _ = batch_documents(batch, "on", True)
    order = batch_chunk_order(cu_seqlens, SEQ, mesh, "balanced", None)
    held = sharded_forward(model, batch, mesh, CPU, doc_mask="on", chunk_order="balanced").index.tolist()
    return (held, shard_indices(SEQ, mesh.hp, mesh.cp, mesh.cp_rank, mesh.hp_rank, order).tolist(),
            shard_indices(SEQ, mesh.hp, mesh.cp, mesh.cp_rank, mesh.hp_rank).tolist())


def _worker(rank: int, world: int) -> dict:
    results = {}
    for layout in LAYOUTS:
        parallel = ParallelConfig(**layout)
        mesh = init_mesh(parallel.hp, parallel.cp, inner_ring=parallel.inner_ring)
        model = parallelize(_model(), mesh, parallel, CPU)
        results[str(layout)] = {**_evaluate(model, mesh), "val_loss": _validate(parallel, mesh),
                                "index": _balanced_index(model, mesh)}
        if parallel.zero != "none":
            results[str(layout)]["steps"] = (_steps(parallel, mesh, True), _steps(parallel, mesh, False))
        destroy_mesh(mesh)
    return results


def test_sharded_eval_equals_unsharded():
    reference = _evaluate(_model(), single_process_mesh())
    reference_val = _validate(ParallelConfig(), single_process_mesh())
    decisions = sum(c["digits_correct"] for c in reference["passkey"])
    assert 0 < decisions < sum(c["digits"] for c in reference["passkey"])  # a mix of right and wrong digits
    by_rank = run_distributed(_worker, 4)
    other = 0  # layouts whose balanced shard is not the zigzag one
    for layout in LAYOUTS:
        for rank, results in enumerate(by_rank):
            got = results[str(layout)]
            where = f"{layout} rank {rank}"
            assert [(b["start"], b["end"], b["tokens"]) for b in got["buckets"]] == \
                [(b["start"], b["end"], b["tokens"]) for b in reference["buckets"]], where
            for mine, ref in zip(got["buckets"], reference["buckets"]):
                assert abs(mine["loss"] - ref["loss"]) < 1e-10, (where, mine, ref)
            assert got["passkey"] == reference["passkey"], where
            for mine, ref in zip(got["balanced"], reference["buckets"], strict=True):  # --chunk-order balanced
                assert mine["tokens"] == ref["tokens"] and abs(mine["loss"] - ref["loss"]) < 1e-10, (where, mine, ref)
            held, balanced, zigzag = got["index"]
            assert held == balanced, where
            other += balanced != zigzag
            assert abs(got["val_loss"] - reference_val) < 1e-10, (where, got["val_loss"], reference_val)
            if "steps" in got:
                with_validation, without = got["steps"]
                assert with_validation == without, where  # bit for bit
    assert other > 0  # the balanced layout really is another one somewhere
