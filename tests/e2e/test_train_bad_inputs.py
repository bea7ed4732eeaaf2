"""`loongtrain train` given bad input: files that parse but say the wrong thing, outputs that would destroy
files, bytes that are not text, usage and TOML errors, the data-safety rows (ownership, locks, complete
checkpoints, corpus identity, validation), and how a run ends on SIGTERM, Ctrl-C, a full disk or a failure a
restart cannot fix.

The rows, and what each must show: tests/helpers/bad_inputs.py."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from loongtrain.commands import main
from loongtrain.data.tokenizer import ByteTokenizer
from tests.helpers.bad_inputs import (
    CASES,
    SAFETY,
    case_ids,
    check_bad_input,
    check_ctrl_c,
    check_safety,
    rows_of,
)
from tests.helpers.cli_cases import BASE, live_workers


@pytest.mark.parametrize("argv, needle", rows_of(CASES, "train"), ids=case_ids(rows_of(CASES, "train")))
def test_bad_input_exits_2_with_one_line(argv, needle, files, capsys, no_workers):
    check_bad_input(argv, needle, files, capsys)


@pytest.mark.parametrize("case", rows_of(SAFETY, "train"), ids=[c.name for c in rows_of(SAFETY, "train")])
def test_data_safety(case, safety, tmp_path, monkeypatch, capsys, reached):
    check_safety(case, safety, tmp_path, monkeypatch, capsys, reached)


def test_decode_errors_opt_in_and_control_bytes_warn(files, caplog):
    """--decode-errors replace reads random bytes (with a warning naming their share); the strict
    default refuses them (the table above); a corpus of control characters warns."""
    from loongtrain.launch.config import TrainConfig
    from loongtrain.launch.preflight import check_corpus

    caplog.set_level(logging.INFO, logger="loongtrain")
    logging.getLogger("loongtrain").addHandler(caplog.handler)  # the CLI's logger does not propagate
    for corpus, errors in (("random.txt", "replace"), ("random.txt", "ignore"), ("control.txt", "strict")):
        caplog.clear()
        cfg = TrainConfig.from_dict(dict(corpus=str(Path(files["dir"], corpus)), seq_len=16, decode_errors=errors))
        check_corpus(cfg, ByteTokenizer())
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warned) == 1 and "% of its first" in warned[0] and corpus in warned[0], warned
    caplog.clear()
    check_corpus(TrainConfig.from_dict(dict(corpus=files["corpus"], seq_len=16)), ByteTokenizer())
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    logging.getLogger("loongtrain").removeHandler(caplog.handler)


def test_restart_rule_and_one_line_report(monkeypatch, files, capsys):
    """A failure a restart cannot fix (a full disk, even wrapped by DCP; a ValueError; NonFiniteError)
    is not retried by --max-restarts, and the launcher prints its cause once."""
    import errno

    from loongtrain.launch import train_run as launch
    from loongtrain.parallel.failures import restartable
    from loongtrain.parallel.workers import WorkerError
    from loongtrain.train.checkpoint import NonFiniteError

    full = OSError(errno.ENOSPC, "No space left on device")

    class Wrapper(BaseException):  # like DCP's CheckpointException: {rank: (exception, trace)}
        failures = {1: (full, None)}

    for exc, again in ((full, False), (Wrapper(), False), (ValueError("x"), False), (NonFiniteError("x"), False),
                       (RuntimeError("connection reset by peer"), True), (OSError(errno.EIO, "io"), True)):
        assert restartable(exc)[0] is again, exc
    try:
        raise RuntimeError("save failed") from full
    except RuntimeError as exc:
        assert restartable(exc) == (False, full)

    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        raise WorkerError(1, 2, "Traceback ...\nOSError: [Errno 28] No space left on device",
                          "OSError: [Errno 28] No space left on device", "OSError", restartable=False)

    monkeypatch.setattr(launch, "run_local", failing)
    argv = ["train", *BASE, "--nproc", "2", "--hp", "2", "--max-restarts", "3", "--corpus", files["corpus"],
            "--out-dir", str(Path(files["dir"], "full"))]
    assert main(argv) == 1
    assert calls == [1], "retried a failure a restart cannot fix"
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "loongtrain train: failed: rank 1 of 2: OSError: [Errno 28] No space left on device"
    assert not any("Traceback" in line for line in err), err


@pytest.mark.distributed
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_is_handled_like_sigint(files, tmp_path, capsys):
    """SIGTERM to the launcher: one line, exit 143, no worker left, no partial checkpoint."""
    out = tmp_path / "run"
    argv = ["train", *BASE, "--nproc", "2", "--hp", "2", "--steps", "200", "--ckpt-interval", "1",
            "--corpus", files["corpus"], "--out-dir", str(out)]
    seen: list[int] = []

    def terminate_when_training():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (out / "metrics.jsonl").is_file():
            time.sleep(0.05)
        seen.extend(live_workers(os.getpid()).values())
        os.kill(os.getpid(), signal.SIGTERM)

    killer = threading.Thread(target=terminate_when_training, daemon=True)
    killer.start()
    code = main(argv)
    killer.join(5)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 128 + signal.SIGTERM, err
    assert err[-1].startswith("loongtrain train: terminated (SIGTERM)"), err
    assert not any("Traceback" in line for line in err), err
    assert seen, "no worker was seen"
    time.sleep(0.2)
    assert not live_workers(os.getpid()), "a worker outlived the launcher"
    assert not list((out / "checkpoints").glob("*.tmp")), "a partial checkpoint was left"


def test_ctrl_c_is_one_line(files, tmp_path, capsys, monkeypatch):
    check_ctrl_c("train", files, tmp_path, capsys, monkeypatch)


def test_a_full_disk_in_a_checkpoint_save_is_named(tmp_path, monkeypatch):
    import errno

    from loongtrain._files import DiskFullError
    from loongtrain.train import checkpoint

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint.dcp, "save", no_space)
    with pytest.raises(DiskFullError, match=r"step_00000001.tmp: no space left on device \(.* MiB free there\)"):
        checkpoint.save_checkpoint(tmp_path / "ck", 1, model, optimizer, scheduler, {})
