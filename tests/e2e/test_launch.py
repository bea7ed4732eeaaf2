"""The local launcher (run_local; its lifeline: parallel/liveness.py) and the per-layout process groups of
init_mesh (docs/launching.md)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from loongtrain.parallel.mesh import _ROLES, destroy_all_meshes, destroy_mesh, init_mesh
from loongtrain.parallel.workers import WorkerError, resolve_backend, run_local

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]


def _threads() -> int:
    """OS threads of this process (gloo's C++ threads included, unlike threading.active_count())."""
    return len(os.listdir("/proc/self/task"))


def _check_groups(mesh) -> None:
    """Every group of ``mesh`` connects its members: an all-reduce of ones gives the group size."""
    for role in _ROLES:
        group = getattr(mesh, role)
        if group is not None:
            x = torch.ones(1)
            dist.all_reduce(x, group=group)
            assert x.item() == dist.get_world_size(group), (role, mesh)


# layouts of world 4 that the churn creates and destroys; (2, 2) stays live throughout
DISTINCT = [
    dict(hp=1, cp=4), dict(hp=1, cp=4, inner_ring=2), dict(hp=1, cp=4, inner_ring=2, interleaved=True),
    dict(hp=1, cp=4, inner_ring=2, placement="context_first"), dict(hp=4, cp=1), dict(hp=1, cp=2),
    dict(hp=2, cp=1), dict(hp=1, cp=1), dict(hp=2, cp=2, placement="context_first"), dict(hp=2, cp=2, inner_ring=2),
]


def _mesh_churn(rank: int, world_size: int) -> dict:
    kept = init_mesh(2, 2)
    assert init_mesh(2, 2) is kept
    small = init_mesh(2, 1)  # same head groups as (2, 2): shared, not made twice
    assert small.hp_group is kept.hp_group and small.sp_group is not kept.sp_group
    destroy_mesh(small)
    _check_groups(kept)  # the shared head group survived
    for cfg in DISTINCT[:3]:  # warm-up: first meshes, first destroys
        mesh = init_mesh(**cfg)
        _check_groups(mesh)
        destroy_mesh(mesh)
    del mesh
    settled = _threads()
    peak = settled
    for i in range(50):
        if i % 3 == 0:
            assert init_mesh(2, 2) is kept
        else:
            mesh = init_mesh(**DISTINCT[i % len(DISTINCT)])
            _check_groups(mesh)  # a group made after others were destroyed still connects
            peak = max(peak, _threads())
            destroy_mesh(mesh)
            assert init_mesh(**DISTINCT[i % len(DISTINCT)]) is not mesh
            destroy_mesh(init_mesh(**DISTINCT[i % len(DISTINCT)]))
        peak = max(peak, _threads())
    del mesh
    _check_groups(kept)
    after = _threads()
    destroy_all_meshes()
    assert init_mesh(2, 2) is not kept
    return {"settled": settled, "peak": peak, "after": after}


def test_meshes_are_cached_and_freed():
    for r in run_local(_mesh_churn, 4, backend="gloo"):
        # one live distinct mesh at a time: at most its 8 groups x 3 gloo threads above the settled count
        assert r["peak"] <= r["settled"] + 8 * 3, r
        assert r["after"] <= r["settled"], r  # destroyed groups' threads are gone


def _rank_info(rank: int, world_size: int, scale: int) -> tuple:
    return (rank * scale, world_size, os.environ["RANK"], os.environ["LOCAL_WORLD_SIZE"],
            dist.get_rank(), torch.get_num_threads(), os.environ.get("LOONGTRAIN_TEST_VAR"))


def test_results_by_rank_and_environment():
    got = run_local(_rank_info, 3, 10, backend="gloo", threads=2, env={"LOONGTRAIN_TEST_VAR": "x"})
    assert got == [(10 * r, 3, str(r), "3", r, 2, "x") for r in range(3)]


def _fail_on(rank: int, world_size: int, bad: int, how: str) -> None:
    if rank == bad:
        if how == "raise":
            raise ValueError(f"boom on rank {rank}")
        os._exit(3)
    dist.barrier()  # the others block until the failure stops them


@pytest.mark.parametrize("how, needle", [("raise", "ValueError: boom on rank 1"), ("exit", "exited with code 3")])
def test_failing_rank_is_named_with_its_traceback(how, needle):
    with pytest.raises(WorkerError) as info:
        run_local(_fail_on, 3, 1, how, backend="gloo", timeout=120)
    assert info.value.rank == 1
    assert "rank 1 of 3 failed" in str(info.value) and needle in str(info.value)
    if how == "raise":
        assert "_fail_on" in info.value.details  # the traceback, not just the message


def _sleep(rank: int, world_size: int, seconds: float) -> None:
    time.sleep(seconds)


def test_hang_times_out():
    with pytest.raises(TimeoutError, match="ranks \\[0, 1\\] of 2"):  # (600 s asleep: only the timeout ends it)
        run_local(_sleep, 2, 600.0, backend="gloo", timeout=1)


def test_backend_choice():
    assert resolve_backend("gloo", 64) == "gloo"
    with pytest.raises(ValueError, match="mpi"):
        resolve_backend("mpi", 2)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert resolve_backend(None, gpus + 1) == "gloo"
    with pytest.raises(ValueError, match="one GPU per rank"):
        resolve_backend("nccl", gpus + 1)


def _write_pid_and_sleep(rank: int, world_size: int, pid_dir: str) -> None:
    Path(pid_dir, f"{rank}.pid").write_text(str(os.getpid()))
    time.sleep(600)


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")  # exited (a zombie waits for a reaper that may never come)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_workers_die_with_the_launcher(tmp_path, sig):
    code = ("import sys; from loongtrain.parallel.workers import run_local; "
            "from tests.e2e.test_launch import _write_pid_and_sleep; "
            "run_local(_write_pid_and_sleep, 2, sys.argv[1], backend='gloo')")
    launcher = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("*.pid"))) < 2:
            assert launcher.poll() is None, "the launcher exited early"
            assert time.monotonic() < deadline, "workers did not start"
            time.sleep(0.1)
        pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
        assert not any(_gone(pid) for pid in pids)
        launcher.send_signal(sig)
        launcher.wait(timeout=30)
        deadline = time.monotonic() + 10
        while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(_gone(pid) for pid in pids), "workers outlived their launcher"
    finally:
        if launcher.poll() is None:
            launcher.kill()
