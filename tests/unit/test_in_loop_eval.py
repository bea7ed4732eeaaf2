"""Evaluation inside the training loop (``--eval-tasks``): training is bit-identical with and without it (one
process here; a step after an in-loop evaluation under FSDP2 with two replicas in tests/dist/test_eval_dist.py),
its metrics are what ``loongtrain eval`` computes for the checkpoint of the same step, and its bad inputs
stop the run before any worker starts."""

from __future__ import annotations

import json
import math

import pytest
import torch

from loongtrain.commands import main
from loongtrain.data import build_tokenizer
from loongtrain.eval.in_loop import in_loop_evaluations, passkey_metrics
from loongtrain.launch.config import TrainConfig
from loongtrain.parallel.config import ParallelConfig
from loongtrain.parallel.mesh import single_process_mesh
from loongtrain.sections.data import DataSection
from loongtrain.train.metrics import read_jsonl
from tests.helpers.fixtures import QUIET_FLAGS, tiny_model
from tests.helpers.training import fit

MODEL = tiny_model(vocab_size=256)
TRAINED = ("step", "seq_len", "loss", "grad_norm", "lr", "val_loss")


def _corpus(tmp) -> str:
    path = tmp / "docs.jsonl"
    if not path.exists():
        path.write_text("".join(json.dumps({"text": f"doc {i}: " + "the quick brown fox jumps over a dog. " * (i % 5)})
                                + "\n" for i in range(120)))
    return str(path)


def _cfg(tmp, name: str, parallel: ParallelConfig, **kw) -> TrainConfig:
    base = dict(corpus=_corpus(tmp), seq_len_stages="32:2,64:2", seq_len=64, steps=4, batch_size=2, warmup=1,
                lr=1e-2, dtype="fp32", parallel=parallel, out_dir=str(tmp / name), peak_tflops=1.0, tensorboard=False,
                plot=False, progress="off", memory_report=False, val_interval=2, val_batches=1)
    return TrainConfig.from_dict(dict(**{**base, **kw}))


EVAL = dict(eval_tasks="passkey,position-loss", eval_lengths="128,256", eval_trials=1, eval_docs=2)


def _train_both(tmp, mesh, parallel: ParallelConfig, world: int) -> tuple[list[dict], list[dict]]:
    plain = fit(_cfg(tmp, "plain", parallel), mesh, torch.device("cpu"), model_config=MODEL)
    cfg = _cfg(tmp, "eval", parallel, **EVAL)
    evaluations = in_loop_evaluations(cfg, MODEL, build_tokenizer("byte"), world)
    checked = fit(cfg, mesh, torch.device("cpu"), model_config=MODEL, evaluations=evaluations)
    return plain, checked


def _check_equal(plain: list[dict], checked: list[dict], steps: list[int], keys: set[str]) -> None:
    assert [[r.get(k) for k in TRAINED] for r in plain] == [[r.get(k) for k in TRAINED] for r in checked]
    evaluated = [r for r in checked if any(k.startswith("eval/") for k in r)]
    assert [r["step"] for r in evaluated] == steps
    assert all(not any(k.startswith("eval/") for k in r) for r in plain)
    for r in evaluated:
        assert keys <= set(r)
        assert all(math.isfinite(v) for k, v in r.items() if k.startswith("eval/"))


def test_training_is_bit_identical_with_in_loop_evaluation(tmp_path):
    plain, checked = _train_both(tmp_path, single_process_mesh(), ParallelConfig(), 1)
    _check_equal(plain, checked, [2, 4], {"eval/passkey/128", "eval/passkey/256", "eval/position_loss/0-32",
                                          "eval/position_loss/128-256"})
    assert checked[1]["eval/position_loss/128-256"] != checked[3]["eval/position_loss/128-256"]  # it trained


def test_metrics_equal_loongtrain_eval_of_the_same_step(tmp_path, capsys):
    from loongtrain.eval.config import EvalConfig, evaluate
    from loongtrain.eval.source import build_model
    from loongtrain.launch.eval_run import prepare

    out = tmp_path / "run"
    argv = ["train", "--nproc", "1", "--hp", "1", "--cp", "1", "--corpus", _corpus(tmp_path), "--seq-len", "64",
            "--steps", "2", "--warmup", "1", "--batch-size", "2", "--val-interval", "2", "--eval-tasks",
            "passkey,position-loss", "--eval-lengths", "128,256", "--eval-trials", "1", "--eval-docs", "3",
            "--no-memory-report", "--out-dir", str(out), *QUIET_FLAGS]
    assert main(argv) == 0
    assert "--eval-lengths 256 is past the model's longest training --seq-len 64" in capsys.readouterr().err
    row = read_jsonl(out / "metrics.jsonl")[-1]
    mesh, cpu = single_process_mesh(), torch.device("cpu")
    for task, options in (("passkey", dict(lengths=(128, 256), trials=1)),
                          ("position-loss", dict(data=DataSection(corpus="", seq_len=256, doc_mask=""), docs=3))):
        job = prepare(EvalConfig(model=str(out), task=task, nproc=1, threads=1, **options))  # `loongtrain eval`'s
        rows = evaluate(job, build_model(job.source, job.run, mesh, cpu), mesh, cpu)
        if task == "passkey":
            expected = passkey_metrics(rows)
        else:
            expected = {f"eval/position_loss/{r['start']}-{r['end']}": r["loss"] for r in rows if r["loss"]}
        assert len(expected) > 1 and {k: row[k] for k in expected} == expected


def test_passkey_metrics_are_the_fraction_of_keys_per_length():
    rows = [{"length": 4096, "depth": 0.0, "trials": 3, "correct": 3}, {"length": 4096, "depth": 1.0, "trials": 3,
            "correct": 0}, {"length": 100, "depth": 0.5, "trials": 4, "correct": 1}]
    assert passkey_metrics(rows) == {"eval/passkey/4K": 0.5, "eval/passkey/100": 0.25}


@pytest.mark.parametrize("extra, needles", [
    (["--eval-lengths", "128,100"], ["--eval-lengths 100", "2*cp*hp"]),
    (["--eval-lengths", "2048", "--eval-docs", "50"], ["position-loss", "holds", "2048"]),
    (["--eval-lengths", "16"], ["--eval-lengths 16", "passkey prompt needs"]),
])
def test_bad_eval_options_exit_2_before_any_worker(tmp_path, capsys, extra, needles):
    argv = ["train", "--nproc", "4", "--hp", "2", "--cp", "2", "--seq-len", "64", "--corpus", _corpus(tmp_path),
            "--val-interval", "1", "--eval-tasks", "passkey,position-loss", *extra, "--out-dir", str(tmp_path / "r")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the warning of a length past the training's
    assert err.startswith("loongtrain train: error:") and all(n in err for n in needles), err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("values, needle", [
    ({"eval_tasks": "passkey"}, "--val-interval N"),
    ({"eval_tasks": "needle", "val_interval": 2}, "'needle'"),
    ({"eval_lengths": "4K"}, "--eval-lengths '4K' gives the lengths of --eval-tasks"),
    ({"eval_tasks": "passkey", "val_interval": 2, "eval_lengths": "4Q"}, "4Q"),
])
def test_eval_options_are_checked(values, needle):
    with pytest.raises(ValueError, match=needle):
        TrainConfig.from_dict(values).validate()


def test_evaluations_go_to_tensorboard_under_their_own_names():
    from loongtrain.train.metrics import _tensorboard_tag

    assert [_tensorboard_tag(k) for k in ("eval/passkey/4K", "eval/position_loss/0-1K", "val_loss", "seq_len")] == [
        "eval/passkey/4K", "eval/position_loss/0-1K", "val/loss", "train/seq_len"]
