"""`loongtrain prepare` given bad input: --out by the ownership rule (never the cwd, an input, or files loongtrain
did not write), the output lock, changed sources, corpora without documents or text; interrupts and a full
disk leave nothing behind.

The rows, and what each must show: tests/helpers/bad_inputs.py."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess

import pytest

from loongtrain.commands import main
from loongtrain.data.tokenizer import ByteTokenizer
from tests.helpers.bad_inputs import (
    SAFETY,
    check_safety,
    full_disk_at,
    hold_lock,
    rows_of,
)


@pytest.mark.parametrize("case", rows_of(SAFETY, "prepare"), ids=[c.name for c in rows_of(SAFETY, "prepare")])
def test_data_safety(case, safety, tmp_path, monkeypatch, capsys, reached):
    check_safety(case, safety, tmp_path, monkeypatch, capsys, reached)


def test_output_lock_refuses_a_second_writer_and_takes_over_a_stale_one(tmp_path, monkeypatch, caplog):
    """A held lock refuses the next writer, naming the holder; a lock file left by a dead process is taken
    over (the kernel dropped its flock; without flock, its dead pid on this host decides)."""
    import socket

    from loongtrain import _files
    from loongtrain._files import LOCK_FILE, Output, OutputLock, lock_holder

    out = Output("prepare", "--out", ())
    fd = hold_lock(tmp_path / "held", os.getppid(), "prepare")
    try:
        with pytest.raises(ValueError, match=rf"is in use by `loongtrain prepare` \(pid {os.getppid()} on host "):
            OutputLock(out, tmp_path / "held").__enter__()
        assert f"pid {os.getppid()}" in lock_holder(tmp_path / "held")
    finally:
        os.close(fd)
    assert lock_holder(tmp_path / "held") is None  # its holder is gone
    dead = subprocess.Popen(["true"])
    dead.wait()
    for flock in (True, False):
        if not flock:
            monkeypatch.setattr(_files, "fcntl", None)
        stale = tmp_path / f"stale{flock}"
        stale.mkdir()
        (stale / LOCK_FILE).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "command": "x"}))
        with caplog.at_level(logging.INFO, logger="loongtrain"):
            logging.getLogger("loongtrain").addHandler(caplog.handler)
            with OutputLock(out, stale):
                assert json.loads((stale / LOCK_FILE).read_text())["pid"] == os.getpid()
            logging.getLogger("loongtrain").removeHandler(caplog.handler)
        assert not (stale / LOCK_FILE).exists()
        assert f"taking over the lock of pid {dead.pid}" in caplog.text
    live = tmp_path / "live"  # without flock: a live pid on this host holds it
    live.mkdir()
    (live / LOCK_FILE).write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname(), "command": "eval"}))
    with pytest.raises(ValueError, match="is in use by `loongtrain eval`"):
        OutputLock(out, live).__enter__()


def test_two_prepares_into_one_directory(tmp_path, capsys):
    """While one prepare writes DIR, a second one into DIR (even with --overwrite) exits 2 naming it and
    removes nothing; the first one finishes whole."""
    from loongtrain.data import prepare as prep
    from loongtrain.data.prepared import verify_prepared

    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"doc {i} " * 20}) + "\n" for i in range(100)))
    out = tmp_path / "p"
    codes = []

    def second(k):
        if k == 1:  # the first prepare is between shards: its marker, its temporary shards, its lock
            before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
            codes.append(main(["prepare", str(corpus), "--out", str(out), "--workers", "1", "--overwrite"]))
            assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before

    prep.prepare([str(corpus)], out, "byte", prep.Sharding(shard_bytes=300), workers=1, on_shard=second)
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("loongtrain prepare:")]
    assert codes == [2] and len(err) == 1 and "is in use by `loongtrain prepare`" in err[0], err
    verify_prepared(out, full=True)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_prepare_interrupted_prints_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch, signum):
    """Ctrl-C (SIGINT) or SIGTERM in the middle of a prepare: one line, exit 130 or 143, no traceback, and
    the directory as it was before (here: absent)."""
    from loongtrain.data import prepare as prep

    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"doc {i} " * 20}) + "\n" for i in range(100)))
    real = prep._tokenize_shard

    def signalled(task):
        if task[0] == 2:
            os.kill(os.getpid(), signum)  # delivered to this (main) thread at once
        return real(task)

    monkeypatch.setattr(prep, "_tokenize_shard", signalled)
    code = main(["prepare", str(corpus), "--out", str(tmp_path / "p"), "--workers", "1", "--shard-bytes", "300"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 128 + signum and err[-1] == ("loongtrain prepare: " + (
        "interrupted" if signum == signal.SIGINT else "terminated (SIGTERM)")), err
    assert not any("Traceback" in line for line in err) and not (tmp_path / "p").exists()


def test_a_full_disk_is_named_and_leaves_no_temporary_files(tmp_path, capsys, monkeypatch):
    """prepare on a full disk (in a shard, the index, the manifest): one line naming the file and "no
    space left", exit 1, no temporary file left; a previous prepared corpus stays whole."""
    from loongtrain.data.prepared import verify_prepared

    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"doc {i} " * 20}) + "\n" for i in range(100)))
    out = tmp_path / "p"
    for name in ("tokens-00002.bin", "documents.idx", "manifest.json"):
        with monkeypatch.context() as m:
            full_disk_at(m, name)
            code = main(["prepare", str(corpus), "--out", str(out), "--workers", "1", "--shard-bytes", "3000"])
        err = capsys.readouterr().err.strip().splitlines()
        path = out / f".tmp-{os.getpid()}" / name
        assert code == 1 and err == [f"loongtrain prepare: failed: {path}: no space left on device"
                                     f"{err[0].split('no space left on device')[1]}"], err
        assert " MiB free there); free space or write elsewhere" in err[0] and not out.exists(), err
    assert main(["prepare", str(corpus), "--out", str(out), "--workers", "1"]) == 0
    corpus.write_text(corpus.read_text() + json.dumps({"text": "one more"}) + "\n")
    with monkeypatch.context() as m:
        full_disk_at(m, "tokens-00000.bin")
        assert main(["prepare", str(corpus), "--out", str(out), "--workers", "1", "--overwrite"]) == 1
    capsys.readouterr()
    verify_prepared(out, full=True)  # the corpus of before, whole
    assert sorted(p.name for p in out.iterdir()) == [".loongtrain", "manifest.json", "shards"]


def test_prepare_of_empty_documents_and_decode_errors(tmp_path, capsys):
    """Documents that are all empty: exit 2 after reading them, the directory as before; prepare accepts
    the --decode-errors its UTF-8 message names."""
    (tmp_path / "e.jsonl").write_text('{"text": ""}\n' * 3)
    assert main(["prepare", str(tmp_path / "e.jsonl"), "--out", str(tmp_path / "p"), "--workers", "1"]) == 2
    assert "every one of the 3 documents" in capsys.readouterr().err and not (tmp_path / "p").exists()
    (tmp_path / "b.jsonl").write_bytes(b'{"text": "caf\xe9 au lait"}\n')
    assert main(["prepare", str(tmp_path / "b.jsonl"), "--out", str(tmp_path / "p"), "--workers", "1",
                 "--decode-errors", "replace"]) == 0
    from loongtrain.data.prepared import PreparedStream, read_manifest

    stream = PreparedStream(read_manifest(tmp_path / "p"), ByteTokenizer())
    assert bytes(stream.slice(0, len(stream)).tolist()) == "caf\ufffd au lait".encode() + b"\0"
