"""The seq-len stages (``--seq-len-stages``): the stages' batch rule, the checks before any worker starts,
and a stop and resume on and between stage boundaries that continues bit for bit (tiny preset, one process)."""

from __future__ import annotations

import json

import pytest

from loongtrain.commands import main
from loongtrain.commands.train import parse_args
from loongtrain.launch.config import TrainConfig
from loongtrain.launch.train_run import validate_run
from loongtrain.sections.stages import parse_stages, run_stages, stage_at
from loongtrain.train.metrics import read_jsonl
from loongtrain.train.optim import lr_factor
from loongtrain.train.stages import stage_config
from tests.helpers.fixtures import QUIET_FLAGS

SCHEDULE = ["--seq-len-stages", "32:3,64:2,128:2", "--batch-size", "2", "--grad-accum", "2"]


def test_parse_schedule_and_the_totals_it_makes():
    assert parse_stages("8K:1000, 32K:400,128K:100") == ((8192, 1000), (32768, 400), (131072, 100))
    cfg = parse_args(["--seq-len-stages", "1K:10,4K:5", "--grad-accum", "4"])
    assert (cfg.optim.steps, cfg.data.seq_len) == (15, 4096)
    again = TrainConfig.from_dict(cfg.to_dict())  # what a checkpoint records reads back unchanged
    again.validate()
    assert again == cfg
    assert parse_args(["--seq-len-stages", "1K:10,4K:5", "--grad-accum", "4", "--steps", "15"]).optim.steps == 15


def test_constant_tokens_count_from_the_longest_stage():
    """--batch-size and --grad-accum describe the longest stage; a shorter one of length L puts longest/L
    times as many sequences into each micro-batch (issue 41: the natural command with --batch-size 1)."""
    cfg = parse_args(["--seq-len-stages", "1K:10,2K:5,4K:4,8K:3", "--batch-size", "4", "--grad-accum", "2"])
    stages = run_stages(cfg.data, cfg.optim.steps)
    shapes = [(s.seq_len, s.batch_size, s.grad_accum, s.first_step, s.steps) for s in stages]
    assert shapes == [(1024, 32, 2, 0, 10), (2048, 16, 2, 10, 5), (4096, 8, 2, 15, 4), (8192, 4, 2, 19, 3)]
    assert {s.tokens_per_replica_step() for s in stages} == {4 * 2 * 8192}
    assert [stage_at(stages, step).index for step in (0, 9, 10, 14, 15, 18, 19, 21, 99)] == [0, 0, 1, 1, 2, 2, 3, 3, 3]
    late = stage_config(cfg, stages[2])
    assert (late.data.seq_len, late.data.batch_size, late.data.grad_accum, late.optim.steps) == \
        (4096, 8, 2, cfg.optim.steps)
    natural = run_stages(parse_args(["--seq-len-stages", "8K:1000,32K:400,128K:100"]).data, 1500)  # --batch-size 1
    assert [(s.batch_size, s.grad_accum) for s in natural] == [(16, 1), (4, 1), (1, 1)]
    free = run_stages(parse_args(["--seq-len-stages", "1K:10,8K:3", "--batch-size", "4", "--stage-tokens",
                                  "free"]).data, 13)
    assert [(s.batch_size, s.grad_accum) for s in free] == [(4, 1), (4, 1)]


@pytest.mark.parametrize("argv, needles", [
    (["--seq-len-stages", "8K:10,4K:5"], ["'4K:5'", "increase"]),
    (["--seq-len-stages", "8K:10,8K:5"], ["'8K:5'", "increase"]),
    (["--seq-len-stages", "8K:10,32K"], ["'32K'", "LENGTH:STEPS"]),
    (["--seq-len-stages", "8K:0"], ["'8K:0'"]),
    (["--seq-len-stages", "8K:10,32K:5", "--steps", "12"], ["--steps=12", "15 steps"]),
    (["--seq-len-stages", "8K:10,32K:5", "--seq-len", "8K"], ["--seq-len=8192", "32768"]),
    (["--seq-len-stages", "10K:10,32K:5", "--grad-accum", "2"], ["length 10240 does not divide the longest, 32768",
                                                                  "--stage-tokens free"]),
    (["--stage-tokens", "free"], ["--seq-len-stages"]),
    (["--seq-len-stages", "1K:2,2K:2", "--stage-tokens", "fixed"], ["'fixed'", "constant"]),
])
def test_bad_schedules_are_value_errors_naming_the_value(argv, needles):
    with pytest.raises(ValueError) as err:
        parse_args(argv)
    assert all(n in str(err.value) for n in needles), str(err.value)


def test_every_stage_must_suit_the_layout():
    cfg = parse_args(["--seq-len-stages", "64:2,100:2", "--hp", "2", "--cp", "2", "--stage-tokens", "free"])
    with pytest.raises(ValueError, match=r"stage 2 \(100 tokens\).*100"):
        validate_run(cfg, 4)
    validate_run(parse_args(["--seq-len-stages", "64:2,128:2", "--batch-size", "2", "--hp", "2", "--cp", "2"]), 4)


def test_cli_refuses_a_bad_stage_before_any_worker(tmp_path, capsys, monkeypatch):
    from loongtrain.launch import train_run

    monkeypatch.setattr(train_run, "_launch_local", lambda *a: pytest.fail("the workers were started"))
    argv = ["train", "--nproc", "4", "--hp", "2", "--cp", "2", "--seq-len-stages", "64:2,100:2",
            "--stage-tokens", "free", "--out-dir", str(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "loongtrain train: error:" in err and "100" in err and "stage 2" in err
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.fixture(scope="module")
def doc_corpus(tmp_path_factory) -> str:
    """A .jsonl corpus of many short documents (--val-fraction holds out whole documents)."""
    path = tmp_path_factory.mktemp("stages") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"doc {i}: the quick brown fox jumps over the lazy dog"}) + "\n"
                            for i in range(300)))
    return str(path)


def _train(corpus, out, *extra) -> int:
    return main(["train", "--nproc", "1", "--hp", "1", "--cp", "1", *SCHEDULE, "--warmup", "1", "--corpus", corpus,
                 "--out-dir", str(out), "--no-memory-report", "--val-fraction", "0.2", "--val-interval", "2",
                 *QUIET_FLAGS, *extra])


KEYS = ("step", "seq_len", "loss", "grad_norm", "lr", "val_loss", "tokens_seen")


def _rows(out) -> list[tuple]:
    rows = read_jsonl(out / "metrics.jsonl")
    return [tuple(r.get(k) if k != "tokens_seen" else tuple(v for n, v in r.items() if n.startswith(k))
                  for k in KEYS) for r in rows]


def test_stop_and_resume_on_and_between_stage_boundaries_is_exact(tmp_path, doc_corpus):
    assert _train(doc_corpus, tmp_path / "full") == 0
    full = _rows(tmp_path / "full")
    assert [r[1] for r in full] == [32, 32, 32, 64, 64, 128, 128]  # each row carries its stage's length
    assert [r[6] for r in full] == [(512 * k,) for k in range(1, 8)]  # 2 x 2 x 128 tokens per step, counted
    assert all(r[5] is not None for r in full if r[0] % 2 == 0)
    lrs = [r[4] for r in full]  # one warmup + cosine over the whole run, not per stage
    assert lrs == pytest.approx([3e-3 * lr_factor(s, warmup=1, total=7, min_ratio=0.1) for s in range(7)])
    out = tmp_path / "split"  # stops after steps 3 (a stage's last), 4 (inside one) and 5 (a stage's last)
    assert _train(doc_corpus, out, "--stop-after", "3") == 0
    for _ in range(2):
        assert _train(doc_corpus, out, "--resume", "--stop-after", "1") == 0
    assert _train(doc_corpus, out, "--resume") == 0
    assert _rows(out) == full


def _small_cluster(tmp_path, memory_gib: float):
    import dataclasses

    from loongtrain.plan.cluster import cluster_to_toml, load_cluster

    path = tmp_path / "small.toml"
    path.write_text(cluster_to_toml(dataclasses.replace(load_cluster("h100"), name="small", memory_gib=memory_gib)))
    return str(path)


def test_a_stage_that_does_not_fit_exits_2_naming_it(tmp_path, capsys):
    """tiny, fp32, one device: the planner predicts 0.03 GiB at 1K tokens and 1.4 GiB at 64K; on a
    0.5 GiB device (0.45 usable) the second stage cannot run, on a 2 GiB one both can."""
    from loongtrain.launch.autoplan import check_stage_memory
    from loongtrain.model.config import PRESETS
    from loongtrain.plan.cluster import load_cluster

    argv = ["--seq-len-stages", "1K:1,64K:1", "--stage-tokens", "free", "--dtype", "fp32", "--hp", "1",
            "--cp", "1", "--nproc", "1"]
    with pytest.raises(ValueError, match=r"stage 2 \(65536 tokens, batch 1\) does not fit on small") as err:
        check_stage_memory(parse_args(argv), 1, PRESETS["tiny"], load_cluster(_small_cluster(tmp_path, 0.5)))
    assert "0.45 usable" in str(err.value)
    check_stage_memory(parse_args(argv), 1, PRESETS["tiny"], load_cluster(_small_cluster(tmp_path, 2.0)))
    out = tmp_path / "run"
    assert main(["train", *argv, "--cluster", _small_cluster(tmp_path, 0.5), "--out-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "stage 2 (65536 tokens" in err and not out.exists()


def test_plan_auto_plans_for_the_longest_stage():
    from loongtrain.launch.autoplan import apply_plan
    from loongtrain.plan.search import best_fitting

    cfg = parse_args(["--model", "7b-gqa", "--seq-len-stages", "32K:10,128K:5", "--grad-accum", "4",
                      "--plan", "auto", "--cluster", "a100", "--dtype", "bf16"])
    planned = apply_plan(cfg, 16, under_launcher=True)
    best = best_fitting("7b-gqa", "a100", nodes=2, seq_len=131072, batch=1, dtype_bytes=2, modes="auto")
    first = best_fitting("7b-gqa", "a100", nodes=2, seq_len=32768, batch=1, dtype_bytes=2, modes="auto")
    assert planned.parallel == best.config != first.config and \
        planned.data.seq_len_stages == cfg.data.seq_len_stages
    validate_run(planned, 16)


def test_the_loss_plot_marks_each_stage_and_the_evaluations_are_plotted(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.axes

    from loongtrain.train.metrics import plot_evaluations, plot_loss_curve

    jsonl = tmp_path / "metrics.jsonl"
    jsonl.write_text("".join(json.dumps({"step": s, "loss": 5.0 - 0.1 * s, "seq_len": 32 if s <= 3 else 64}) + "\n"
                             for s in range(1, 7)))
    lines = []
    real = matplotlib.axes.Axes.axvline
    monkeypatch.setattr(matplotlib.axes.Axes, "axvline", lambda ax, x, **kw: lines.append(x) or real(ax, x, **kw))
    assert plot_loss_curve(jsonl, tmp_path / "loss.png", stages=[(0, 32), (3, 64)])
    assert lines == [0.5, 3.5] and (tmp_path / "loss.png").stat().st_size > 0
    assert not plot_evaluations(jsonl, tmp_path / "eval.png")  # no eval/ metrics: no plot
    with jsonl.open("a") as fh:
        fh.write(json.dumps({"step": 6, "loss": 4.0, "eval/passkey/4K": 0.5, "eval/position_loss/0-1K": 3.0}) + "\n")
    assert plot_evaluations(jsonl, tmp_path / "eval.png") and (tmp_path / "eval.png").stat().st_size > 0
