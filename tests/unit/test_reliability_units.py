"""Reliability pieces without processes: the non-finite step guard, append-only metrics, choosing the
checkpoint to resume, and edge inputs of ``loongtrain.attention``."""

from __future__ import annotations

import json
import math

import pytest
import torch

from loongtrain import attention
from loongtrain.data.synthetic import global_batch
from loongtrain.launch.config import TrainConfig, run_of
from loongtrain.parallel.config import ParallelConfig
from loongtrain.parallel.mesh import single_process_mesh
from loongtrain.train.checkpoint import (
    LATEST,
    STATE_FILE,
    find_checkpoint,
    newest_checkpoint,
    parameters_finite,
    read_latest,
    resolve_checkpoint,
)
from loongtrain.train.metrics import MetricsLogger, read_jsonl
from loongtrain.train.trainer import Trainer
from tests.helpers.fixtures import tiny_model

MODEL = tiny_model(num_layers=1, num_kv_heads=4)


def _trainer(**kw) -> Trainer:
    cfg = TrainConfig.from_dict(dict(seq_len=16, steps=4, warmup=1, parallel=ParallelConfig(), dtype="fp64", **kw))
    return Trainer(run_of(cfg, MODEL), single_process_mesh(), torch.device("cpu"))


def test_non_finite_step_is_skipped_without_update():
    trainer = _trainer()
    batch = global_batch(0, 2, 16, 64, seed=0)
    assert trainer.step([batch])["skipped"] == 0
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    adam_steps = [s["step"].item() for s in trainer.optimizer.state.values()]
    name, poisoned = next((n, p) for n, p in trainer.model.named_parameters() if p.dim() == 2)
    with torch.no_grad():
        poisoned[0, 0] = math.inf
    lr_before = trainer.scheduler.get_last_lr()
    result = trainer.step([batch])
    assert result["skipped"] == 1 and not (math.isfinite(result["loss"]) and math.isfinite(result["grad_norm"]))
    for n, p in trainer.model.named_parameters():
        if n != name:
            assert torch.equal(p, before[n]), n  # no optimizer update
    assert [s["step"].item() for s in trainer.optimizer.state.values()] == adam_steps
    assert trainer.scheduler.get_last_lr() != lr_before  # the schedule follows the step count
    assert not parameters_finite(trainer.model)


def test_values_read_only_at_log_steps_are_the_same_values(tmp_path):
    """Between log steps a step reads only its NaN/inf guard; the loss, gradient norm and attention pairs read
    later (at the next log step, or at the end) equal those read at every step, in the records and in the
    log lines; a skipped step between log steps is read and logged at once."""
    from loongtrain.data.synthetic import synthetic_source

    def run(interval: int, out: str, poison_at: int | None = None) -> tuple[list[dict], list[dict]]:
        cfg = TrainConfig.from_dict(dict(seq_len=16, steps=5, warmup=1, parallel=ParallelConfig(), dtype="fp64",
                                         log_interval=interval,
                          out_dir=str(tmp_path / out), peak_tflops=1.0, tensorboard=False, plot=False, progress="off",
                          memory_report=False, max_bad_steps=0))
        made: list[Trainer] = []

        def source(cfg, mesh, start):  # for micro-step ``poison_at`` one weight is inf (that step is skipped)
            kept = []
            for i, batch in enumerate(synthetic_source(64)(cfg, mesh, start)):
                if poison_at is not None and i in (poison_at, poison_at + 1):
                    weight = next(p for p in made[0].model.parameters() if p.dim() == 2)
                    with torch.no_grad():
                        if i == poison_at:
                            kept.append(weight[0, 0].item())
                        weight[0, 0] = math.inf if i == poison_at else kept[0]
                yield batch

        made.append(Trainer(run_of(cfg, MODEL), single_process_mesh(), torch.device("cpu"), source))
        return made[0].train(), read_jsonl(tmp_path / out / "metrics.jsonl")

    every, every_log = run(1, "every")
    sparse, sparse_log = run(3, "sparse")
    keys = ("step", "loss", "grad_norm", "lr", "skipped", "attention_pairs")
    assert [{k: r[k] for k in keys} for r in sparse] == [{k: r[k] for k in keys} for r in every]
    assert all(isinstance(r["loss"], float) and isinstance(r["attention_pairs"], int) for r in sparse)
    assert all(r["tflops"] > 0 for r in sparse)
    assert [r["step"] for r in sparse_log] == [3, 5]
    assert [{k: r[k] for k in keys} for r in sparse_log] == [{k: every_log[i][k] for k in keys} for i in (2, 4)]
    _, bad_log = run(3, "bad", poison_at=3)  # step 4, between log steps
    assert [(r["step"], r["skipped"]) for r in bad_log] == [(3, 0), (4, 1), (5, 0)]
    assert not math.isfinite(bad_log[1]["loss"]) and isinstance(bad_log[1]["grad_norm"], float)


def test_metrics_are_appended_and_redone_steps_replace_old_ones(tmp_path):
    def run(start: int, steps: range) -> None:
        logger = MetricsLogger(tmp_path, total_steps=9, start_step=start, tensorboard=False, progress="off")
        for step in steps:
            logger.log({"step": step, "total_steps": 9, "loss": float(step + 10 * start), "lr": 0.1,
                        "tokens_per_s": 1.0, "tflops": 0.0, "mfu": 0.0, "peak_mem_gib": 0.0})
        logger.close()

    run(0, range(1, 6))  # steps 1-5, then killed; the checkpoint was at step 3
    with open(tmp_path / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 6, "lo')  # killed mid-line
    run(3, range(4, 8))  # resumed from step 3
    raw = (tmp_path / "metrics.jsonl").read_text()
    assert raw.count('"step": 5,') == 2, "the first run's step 5 is kept in the file (nothing truncated)"
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6, 7]
    assert [r["loss"] for r in records] == [1.0, 2.0, 3.0, 34.0, 35.0, 36.0, 37.0]
    events = [r for r in read_jsonl(tmp_path / "metrics.jsonl", raw=True) if "event" in r]
    assert [e["step"] for e in events] == [0, 3]


def _ckpt(root, step: int, complete: bool = True):
    path = root / f"step_{step:08d}"
    path.mkdir(parents=True)
    if complete:
        (path / STATE_FILE).write_text(json.dumps({"step": step, "scheduler": {}}))
        (path / "checksums.json").write_text("{}")
    return path


def test_resume_auto_picks_latest_else_newest_complete(tmp_path):
    root = tmp_path / "checkpoints"
    assert resolve_checkpoint("auto", tmp_path) is None  # nothing yet: start fresh
    with pytest.raises(ValueError, match="no complete checkpoint"):
        resolve_checkpoint("latest", tmp_path)
    _ckpt(root, 2)
    _ckpt(root, 10)
    _ckpt(root, 12, complete=False)
    assert newest_checkpoint(root).name == "step_00000010"
    (root / LATEST).write_text("step_00000002\n")
    assert resolve_checkpoint("auto", tmp_path).name == "step_00000002"  # the pointer wins
    (root / LATEST).write_text("step_00000012\n")  # names an incomplete one
    assert resolve_checkpoint("auto", tmp_path).name == "step_00000010"


@pytest.mark.parametrize("shape_q, shape_kv, scale, needle", [
    ((1, 0, 4, 8), (1, 0, 4, 8), None, "seq"),
    ((1, 8, 4, 0), (1, 8, 4, 0), None, "head_dim"),
    ((1, 8, 0, 8), (1, 8, 0, 8), None, "num_heads"),
    ((0, 8, 4, 8), (0, 8, 4, 8), None, "batch"),
    ((1, 8, 4, 8), (1, 8, 4, 8), 0.0, "softmax_scale=0.0"),
    ((1, 8, 4, 8), (1, 8, 4, 8), -1.0, "softmax_scale=-1.0"),
    ((1, 8, 4, 8), (1, 8, 4, 8), math.nan, "softmax_scale=nan"),
    ((1, 8, 4, 8), (1, 8, 4, 8), math.inf, "softmax_scale=inf"),
])
def test_attention_edge_inputs_raise_value_error(shape_q, shape_kv, scale, needle):
    q = torch.randn(shape_q)
    k, v = torch.randn(shape_kv), torch.randn(shape_kv)
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        attention(q, k, v, None, softmax_scale=scale)


def test_one_latest_reader_serves_resume_and_export_paths(tmp_path):
    """``latest`` is read in one place: resume's 'latest', a checkpoints root, a run directory and the
    pointer file itself all name the same checkpoint (``loongtrain export runs/x/checkpoints/latest``)."""
    root = tmp_path / "run" / "checkpoints"
    for step in (1, 2):
        (root / f"step_{step:08d}").mkdir(parents=True)
        (root / f"step_{step:08d}" / STATE_FILE).write_text(json.dumps({"step": step, "scheduler": {}}))
        (root / f"step_{step:08d}" / "checksums.json").write_text("{}")
    (root / LATEST).write_text("step_00000001\n")  # latest need not be the newest
    want = root / "step_00000001"
    assert read_latest(root) == want and read_latest(tmp_path) is None
    for spec in (root / LATEST, root, tmp_path / "run", want):
        assert find_checkpoint(spec) == want, spec
    assert resolve_checkpoint("latest", tmp_path / "run") == want
    assert resolve_checkpoint(str(root / LATEST), tmp_path / "elsewhere") == want
    with pytest.raises(ValueError, match="not a loongtrain checkpoint"):
        find_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="--resume='latest'"):
        resolve_checkpoint("latest", tmp_path)
