"""Several nodes: two torchrun agents on the loopback act as two nodes (c10d rendezvous on 127.0.0.1,
``--nnodes 2 --nproc-per-node 2``, hp=2 x cp=2, one shared out-dir as on a cluster filesystem).

- a worker killed on node 1 (``LOONGTRAIN_KILL_AT``) with ``--max-restarts 1``: both nodes restart and
  resume from one checkpoint, and every step's loss (the steps before the kill from the first attempt, the
  rest from the restart) equals a single-node run's of the same layout, bit for bit;
- node 1's agent killed (kill -9): node 0 ends within its timeouts naming node 1, and a relaunch of both
  nodes with ``--resume auto`` (an uninterrupted two-node run from the checkpoint to the end) finishes
  with the single-node losses, bit for bit.
(The single-node torchrun restart: tests/e2e/test_faults.py::test_torchrun_standalone_restart_resumes.)"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loongtrain.commands import main
from loongtrain.train.metrics import read_jsonl
from tests.helpers.cli_cases import COMMON, wait_for

TORCHRUN = Path(sys.executable).parent / "torchrun"
pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="two agents on the loopback"),
              pytest.mark.skipif(shutil.which("torchrun", path=str(TORCHRUN.parent)) is None,
                                 reason="torchrun not installed next to this Python")]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 6
KILL_STEP = 4  # after the checkpoint of step 2: a restart resumes there and redoes step 3
ARGS = ["--hp", "2", "--cp", "2", *COMMON, "--steps", str(STEPS), "--ckpt-interval", "2"]
JOIN_TIMEOUT_S = 10  # torchrun's rendezvous join timeout (default 600 s)
END_S = 120  # a whole two-node run, start-up included, on a loaded machine


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("nodes") / "corpus.txt"
    path.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(200)))
    return str(path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Nodes:
    """Two torchrun agents, node 0 hosting the rendezvous; their output goes to ``OUT{tag}.nodeN.log``."""

    def __init__(self, out: Path, corpus: str, *extra: str, max_restarts: int = 0, kill: str = "",
                 tag: str = "") -> None:
        port, run_id = _free_port(), f"nodes-{out.name}-{os.getpid()}"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "LOONGTRAIN_KILL_AT": kill}
        self.logs = [out.parent / f"{out.name}{tag}.node{n}.log" for n in (0, 1)]
        self.procs = []
        for n, log in enumerate(self.logs):
            cmd = [str(TORCHRUN), "--nnodes", "2", "--nproc-per-node", "2", "--max-restarts", str(max_restarts),
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
                   "--rdzv-conf", f"is_host={int(n == 0)},join_timeout={JOIN_TIMEOUT_S}",
                   "-m", "loongtrain.commands", "train", *ARGS, "--corpus", corpus, "--out-dir", str(out), *extra]
            with open(log, "w") as sink:
                self.procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT))

    def wait(self, timeout: float = END_S) -> list[int]:
        deadline = time.monotonic() + timeout
        try:
            return [p.wait(timeout=max(0.1, deadline - time.monotonic())) for p in self.procs]
        finally:
            for p in self.procs:
                if p.poll() is None:
                    p.kill()

    def log(self, n: int) -> str:
        return self.logs[n].read_text()


def _workers_of(out: Path) -> list[int]:
    """pids of live processes training into ``out``."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"loongtrain.commands" in cmdline and str(out).encode() in cmdline:
            found.append(int(entry))
    return found


def _losses(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(out / "metrics.jsonl")}


def _starts(out: Path) -> list[int]:
    return [r["step"] for r in read_jsonl(out / "metrics.jsonl", raw=True) if r.get("event") == "start"]


@pytest.fixture(scope="module")
def single_node(tmp_path_factory, corpus) -> dict[int, float]:
    """The losses of the same layout trained on one node (4 local workers), uninterrupted."""
    out = tmp_path_factory.mktemp("one_node") / "run"
    assert main(["train", "--nproc", "4", *ARGS, "--corpus", corpus, "--out-dir", str(out)]) == 0
    losses = _losses(out)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


def test_worker_killed_on_one_node_every_node_resumes_exactly(tmp_path, corpus, single_node):
    out = tmp_path / "run"
    nodes = Nodes(out, corpus, max_restarts=1, kill=f"3:{KILL_STEP}")
    codes = nodes.wait()
    assert codes == [0, 0], nodes.log(0)[-3000:] + nodes.log(1)[-3000:]
    assert "exitcode: -9" in nodes.log(1)  # rank 3 died as planned, on node 1
    assert "torchrun attempt 2" in nodes.log(0) and "resumed from" in nodes.log(0), nodes.log(0)[-3000:]
    assert _starts(out) == [0, 2]  # one restart, from the checkpoint of step 2, on every rank
    assert _losses(out) == single_node


def test_agent_killed_the_other_node_ends_naming_it_and_resume_auto_finishes(tmp_path, corpus, single_node):
    out = tmp_path / "run"
    nodes = Nodes(out, corpus, max_restarts=1, kill=f"3:{KILL_STEP}:agent")
    assert nodes.procs[1].wait(timeout=END_S) == -9, nodes.log(1)[-3000:]  # node 1's agent, killed
    # node 0's workers end at once, naming node 1; node 1's workers ended with their agent
    wait_for(lambda: not _workers_of(out), 30, "every worker to end", nodes.procs[0])
    failed = [line for line in nodes.log(0).splitlines() if "loongtrain train: failed:" in line]
    assert len(failed) == 2, nodes.log(0)[-3000:]  # ranks 0 and 1, each naming node 1
    assert all("lost node 1 (host" in line and "ranks 2-3" in line for line in failed), failed
    # every node relaunched, as a user would after replacing the lost one (while node 0's old agent still
    # waits in its rendezvous for node 1, up to join_timeout)
    again = Nodes(out, corpus, "--resume", "auto", tag=".again")
    assert nodes.wait(JOIN_TIMEOUT_S + 30)[0] not in (0, None), nodes.log(0)[-3000:]  # ended: its join timed out
    assert "RendezvousTimeoutError" in nodes.log(0)
    codes = again.wait()
    assert codes == [0, 0], again.log(0)[-3000:] + again.log(1)[-3000:]
    assert _starts(out) == [0, 2]
    assert _losses(out) == single_node
