"""Fault injection: killed and stopped workers, mismatched collectives across ranks, NaN training, torchrun
restarts. Each fault must end the job promptly, by name, and leave a run that ``--resume auto`` finishes
exactly. (Killing the launcher: tests/e2e/test_launch.py::test_workers_die_with_the_launcher; a rerun without
``--resume``: tests/e2e/test_cli_errors.py, which also checks the directory is untouched.)"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from loongtrain.commands import main
from loongtrain.parallel.mesh import init_mesh
from loongtrain.parallel.workers import WorkerError, run_local
from loongtrain.train.metrics import read_jsonl
from tests.helpers.cli_cases import COMMON, STEPS, live_workers, parent_pid, wait_for

pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def corpus(code_corpus) -> str:
    return code_corpus


def _steps_logged(out: Path) -> int:
    path = out / "metrics.jsonl"
    return max((r["step"] for r in read_jsonl(path)), default=0) if path.is_file() else 0


def _kill_rank_when(argv: list[str], rank: int, ready, what: str, capsys, restarts: int = 0) -> None:
    """Run ``main(argv)`` (the launcher: this process, in a thread), SIGKILL worker ``rank`` once
    ``ready()``; the launcher must then return 1 promptly, naming the rank, with no worker left (with
    ``restarts``: restart and finish, returning 0)."""
    import threading

    codes: list[int] = []
    launcher = threading.Thread(target=lambda: codes.append(main(argv)), daemon=True)
    launcher.start()
    alive = lambda: launcher.is_alive() or pytest.fail(f"the run ended (codes {codes}) before {what}")  # noqa: E731
    workers = wait_for(lambda: alive() and (w := live_workers(os.getpid())) and len(w) == 2 and w, 60, "workers")
    wait_for(lambda: alive() and ready(), 60, what, poll=0.002)
    os.kill(workers[rank], signal.SIGKILL)
    launcher.join(timeout=120)  # a bound on the test, not a measurement: the run must have ended by then
    err = capsys.readouterr().err
    if restarts:
        assert codes == [0], err  # the restart shows as one more "start" event in metrics.jsonl
    else:
        assert codes == [1], err
        assert f"failed: rank {rank} of 2:" in err and "SIGKILL" in err, err
    assert not any(parent_pid(pid) is not None for pid in workers.values()), "a worker outlived the job"


def test_kill_mid_step_and_mid_checkpoint_then_resume_auto_is_exact(tmp_path, corpus, capsys):
    args = ["train", "--nproc", "2", "--hp", "2", "--cp", "1", "--corpus", corpus, *COMMON]
    reference = tmp_path / "reference"
    assert main([*args, "--out-dir", str(reference)]) == 0
    out = tmp_path / "run"
    run = [*args, "--out-dir", str(out), "--ckpt-interval", "1", "--resume", "auto"]
    # 1. a worker killed while training (the run has logged step 3 and is inside a later one)
    _kill_rank_when(run, 1, lambda: _steps_logged(out) >= 3, "step 3", capsys)
    # 2. resumed, then a worker killed while a checkpoint is being written
    ckpts = out / "checkpoints"
    tmp_seen = lambda: any(p.name.endswith(".tmp") and int(p.name[5:13]) >= 5 for p in ckpts.glob("step_*"))  # noqa: E731
    _kill_rank_when(run, 0, tmp_seen, "a checkpoint of step >= 5 being written", capsys)
    # 3. resumed with --max-restarts 1, a worker killed again: the launcher restarts and finishes; every
    # step's loss equals the uninterrupted run's, bit for bit
    _kill_rank_when([*run, "--max-restarts", "1"], 1, lambda: _steps_logged(out) >= 7, "step 7", capsys,
                    restarts=1)
    want = {r["step"]: r["loss"] for r in read_jsonl(reference / "metrics.jsonl")}
    got = {r["step"]: r["loss"] for r in read_jsonl(out / "metrics.jsonl")}
    assert got == want and sorted(got) == list(range(1, STEPS + 1))
    starts = [r["step"] for r in read_jsonl(out / "metrics.jsonl", raw=True) if r.get("event") == "start"]
    assert len(starts) == 4 and starts[0] == 0 and starts == sorted(starts), starts
    assert not list(ckpts.glob("*.tmp")), "a stale partial checkpoint was left"


def _stop_rank(rank: int, world_size: int, pid_dir: str) -> None:
    Path(pid_dir, f"{rank}.pid").write_text(str(os.getpid()))
    for _ in range(100_000):
        dist.barrier()
        time.sleep(0.01)


def test_stopped_worker_ends_the_job_naming_it(tmp_path):
    import threading

    def stop_rank_1():
        pid = wait_for(lambda: Path(tmp_path, "1.pid").is_file() and Path(tmp_path, "1.pid").read_text(), 60,
                        "rank 1 to start")
        time.sleep(0.5)
        os.kill(int(pid), signal.SIGSTOP)
        stopped.append(time.monotonic())

    stopped: list[float] = []
    thread = threading.Thread(target=stop_rank_1, daemon=True)
    thread.start()
    with pytest.raises(WorkerError) as info:
        run_local(_stop_rank, 2, str(tmp_path), backend="gloo", timeout=120, heartbeat_timeout=3.0)
    assert stopped, f"the job failed before rank 1 was stopped: {info.value}"
    assert info.value.rank == 1 and "no heartbeat" in str(info.value) and "SIGSTOP" in str(info.value)
    # the monitor's own decision, as it recorded it: silent for at least the timeout when it ended the job
    silent = float(re.search(r"no heartbeat for ([0-9.]+) s \(heartbeat_timeout=3 s\)", str(info.value)).group(1))
    assert silent >= 3.0, str(info.value)
    assert parent_pid(int(Path(tmp_path, "1.pid").read_text())) is None, "the stopped worker was not killed"


def _skip_a_collective(rank: int, world_size: int) -> None:
    if rank == 0:
        time.sleep(600)  # never joins: its peers' all-reduce must time out, not hang
    dist.all_reduce(torch.ones(1))


def test_collective_timeout_ends_a_hang():
    """Rank 0 sleeps 600 s: only the collective timeout can end rank 1's all-reduce with an error."""
    with pytest.raises(WorkerError) as info:
        run_local(_skip_a_collective, 2, backend="gloo", timeout=120, collective_timeout=3)
    details = info.value.details.lower()
    assert info.value.rank == 1 and ("timed out" in details or "timeout" in details), info.value.details


def _mismatched_calls(rank: int, world_size: int) -> list[str]:
    """Every rank records the ValueError of each mismatched call (all ranks must raise, at once)."""
    from loongtrain import attention, shard_sequence

    errors = []
    try:
        init_mesh(2, 2) if rank == 0 else init_mesh(1, 4)
    except ValueError as exc:
        errors.append(str(exc))
    mesh = init_mesh(1, 4)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 32, 4, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    local = [shard_sequence(t, mesh, dim=1) for t in (q, k, v)]
    # each mismatch at the first call of a signature on every rank (a fresh softmax_scale per case), as
    # when ranks run different configurations; a later divergence from an already agreed signature:
    # tests/e2e/test_bad_inputs.py::test_a_later_disagreement_raises_on_every_rank
    bad_calls = {
        "causal": lambda: attention(*local, mesh, causal=rank != 3, softmax_scale=0.31),
        "seq": lambda: attention(*(t[:, : 4 if rank == 2 else 8] for t in local), mesh, softmax_scale=0.32),
        "dtype": lambda: attention(*(t.float() if rank == 1 else t for t in local), mesh, softmax_scale=0.33),
        "num_heads": lambda: attention(local[0][:, :, : 2 if rank == 0 else 4], *local[1:], mesh,
                                       softmax_scale=0.34),
    }
    for fn in bad_calls.values():
        try:
            fn()
        except ValueError as exc:
            errors.append(str(exc))
    good = attention(*local, mesh)  # agreed: runs
    assert torch.equal(good, attention(*local, mesh))
    return errors


def test_mismatched_init_mesh_and_attention_raise_on_every_rank():
    results = run_local(_mismatched_calls, 4, backend="gloo", timeout=120, collective_timeout=30)
    for errors in results:
        assert len(errors) == 5, errors
        init, causal, seq, dtype, heads = errors
        assert "init_mesh" in init and "hp: 2 on ranks [0], 1 on ranks [1, 2, 3]" in init
        assert "causal: True on ranks [0, 1, 2], False on ranks [3]" in causal
        assert "seq: 8 on ranks [0, 1, 3], 4 on ranks [2]" in seq
        assert "dtype" in dtype and "ranks [1]" in dtype
        assert "num_heads: 2 on ranks [0], 4 on ranks [1, 2, 3]" in heads


def _load_all(checkpoint: Path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = checkpoint.parent / (checkpoint.name + ".pt")
    dcp_to_torch_save(str(checkpoint), str(target))
    state = torch.load(target, weights_only=False)
    target.unlink()
    return state


def test_nan_lr_skips_steps_stops_with_exit_1_and_writes_no_nan_checkpoint(tmp_path, corpus, capsys):
    out = tmp_path / "nan"
    argv = ["train", "--nproc", "1", "--hp", "1", "--cp", "1", "--corpus", corpus, *COMMON, "--lr", "1e6",
            "--max-bad-steps", "2", "--ckpt-interval", "1", "--out-dir", str(out)]
    assert main(argv) == 1
    assert "--max-bad-steps=2" in capsys.readouterr().err
    records = read_jsonl(out / "metrics.jsonl")
    skipped = [r["step"] for r in records if r["skipped"]]
    assert len(skipped) == 2 and skipped[-1] == records[-1]["step"] < STEPS
    for ckpt in (out / "checkpoints").glob("step_*"):
        tensors = [t for t in _flatten(_load_all(ckpt)) if t.is_floating_point()]
        assert tensors and all(bool(torch.isfinite(t).all()) for t in tensors), ckpt


def _flatten(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _flatten(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _flatten(value)


@pytest.mark.skipif(shutil.which("torchrun", path=str(Path(sys.executable).parent)) is None,
                    reason="torchrun not installed next to this Python")
def test_torchrun_standalone_restart_resumes(tmp_path, corpus):
    """The README's command, at 2 ranks (4 and hp=2 x cp=2 across two agents: tests/e2e/test_nodes.py): torchrun
    --standalone (gloo); a worker killed in the first attempt; torchrun's restart resumes from the newest
    checkpoint and finishes."""
    out = tmp_path / "torchrun"
    torchrun = str(Path(sys.executable).parent / "torchrun")
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "-m", "loongtrain.commands",
           "train", "--hp", "2", "--cp", "1", "--corpus", corpus, *COMMON, "--ckpt-interval", "2",
           "--out-dir", str(out)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        wait_for(lambda: (out / "checkpoints" / "step_00000002").is_dir(), 90, "the first checkpoint", proc)
        ranks = [pid for pid in _children(proc.pid)]
        assert len(ranks) == 2
        os.kill(ranks[1], signal.SIGKILL)
        code = proc.wait(timeout=120)
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0, err[-3000:]
    assert "resumed from" in err, err[-3000:]
    steps = [r["step"] for r in read_jsonl(out / "metrics.jsonl")]
    assert steps == list(range(1, STEPS + 1))


def _children(pid: int) -> list[int]:
    return sorted(int(e) for e in os.listdir("/proc") if e.isdigit() and parent_pid(int(e)) == pid)
