"""CLI test cases: the base flags of a quick run, a small BPE tokenizer, and the local workers of a launcher."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

STEPS = 16  # long enough that a kill at step 7 lands before the run ends, even on a loaded machine


def parent_pid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError):
        return None


BASE = ["--nproc", "1", "--hp", "1", "--cp", "1", "--seq-len", "16", "--steps", "2", "--warmup", "1",
        "--progress", "off", "--peak-tflops", "1", "--no-tensorboard", "--no-plot", "--threads", "1",
        "--no-memory-report"]


def bpe_tokenizer(path: Path, vocab_size: int = 300) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator([f"document {i}: the quick brown fox" for i in range(50)], trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))
    return path


COMMON = ["--seq-len", "32", "--steps", str(STEPS), "--warmup", "1", "--progress", "off", "--peak-tflops", "1",
          "--no-tensorboard", "--no-plot", "--threads", "1", "--no-memory-report", "--dtype", "fp32"]


def live_workers(launcher: int) -> dict[int, int]:
    """rank -> pid of the local workers of ``launcher`` (named ``lt-rankN``; children of its fork server)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            comm = Path(f"/proc/{entry}/comm").read_text().strip()
        except OSError:
            continue
        if comm.startswith("lt-rank"):
            parent = parent_pid(int(entry))
            if parent is not None and (parent == launcher or parent_pid(parent) == launcher):
                found[int(comm[7:])] = int(entry)
    return found


def wait_for(condition, timeout: float, what: str, proc: subprocess.Popen | None = None, poll: float = 0.02):
    """Poll ``condition()`` until it is truthy (its value) or ``timeout`` s pass (or ``proc`` ends)."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run ended (code {proc.returncode}) before {what}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(poll)
    return value
