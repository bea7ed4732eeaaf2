"""`loongtrain train` end to end through ``loongtrain.commands.main``: runs, resume, help, and user errors."""

from __future__ import annotations

import math

import pytest
import torch

from loongtrain.commands import main
from loongtrain.train.metrics import read_jsonl
from tests.helpers.fixtures import QUIET_FLAGS


@pytest.fixture(scope="module")
def corpus(line_corpus):
    return line_corpus


def _common(out_dir, corpus) -> list[str]:
    return ["--corpus", corpus, "--seq-len", "64", "--out-dir", str(out_dir), *QUIET_FLAGS]


@pytest.mark.distributed
def test_two_workers_spawned(tmp_path, corpus):
    argv = ["train", "--nproc", "2", "--hp", "2", "--cp", "1", "--steps", "3", "--warmup", "1",
            *_common(tmp_path, corpus)]
    assert main(argv) == 0
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and r["tokens_per_s"] > 0 for r in records)
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000003"


def test_single_process_stop_and_resume(tmp_path, corpus):
    argv = ["train", "--nproc", "1", "--hp", "1", "--cp", "1", "--steps", "4", "--warmup", "1",
            *_common(tmp_path, corpus)]
    before = torch.get_num_threads()
    assert main([*argv, "--stop-after", "2", "--threads", str(before + 1)]) == 0
    assert torch.get_num_threads() == before  # a run in this process leaves the caller's thread count as it was
    assert main([*argv, "--resume"]) == 0
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) for r in records)
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "tflops", "mfu", "peak_mem_gib"):
        assert key in records[-1]


def test_one_process_without_layout_flags_trains(tmp_path, corpus):
    """``loongtrain train --nproc 1`` with no --hp/--cp: the layout follows the world (hp = cp = 1), as on one GPU."""
    import json

    assert main(["train", "--nproc", "1", "--steps", "2", "--warmup", "1", *_common(tmp_path, corpus)]) == 0
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2] and all(math.isfinite(r["loss"]) for r in records)
    state = json.loads(next((tmp_path / "checkpoints").glob("step_*/trainer_state.json")).read_text())
    assert (state["config"]["parallel"]["hp"], state["config"]["parallel"]["cp"]) == (1, 1)


def test_help_exits_zero(capsys):
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--seq-len" in out and "--peak-tflops" in out and "default" in out


@pytest.mark.parametrize(
    "argv, needles",
    [
        (["--no-such-option", "3"], ["--no-such-option"]),
        (["--nproc", "3", "--hp", "2", "--cp", "1"], ["3", "hp*cp"]),
        (["--nproc", "4", "--seq-len", "100"], ["100", "2*cp*hp"]),
        (["--nproc", "8", "--hp", "8", "--cp", "1", "--seq-len", "64"], ["hp=8", "num_heads=4"]),
        (["--inner-ring", "3"], ["inner_ring=3"]),
        (["--steps", "-1"], ["--steps=-1"]),
        (["--model", "huge"], ["huge"]),
        (["--nproc", "1", "--hp", "1", "--cp", "1", "--resume"], ["--resume", "no complete checkpoint"]),
        (["--zero", "half"], ["half"]),
    ],
)
def test_user_errors_exit_nonzero_before_spawning(argv, needles, capsys, tmp_path, monkeypatch):
    from loongtrain.launch import train_run

    monkeypatch.setattr(train_run, "_launch_local", lambda *a: pytest.fail("validation must not start workers"))
    assert main(["train", *argv, "--out-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err, (needle, err)
