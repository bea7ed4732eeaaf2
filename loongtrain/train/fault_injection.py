"""A test hook that kills one worker at a chosen step, for the restart tests (docs/design.md §10).

``LOONGTRAIN_KILL_AT=RANK:STEP``: global rank RANK sends itself SIGKILL just before it runs optimizer
step STEP (1-based), in a run that started from step 0. ``RANK:STEP:agent`` first kills its parent, the
torchrun agent of its node (as when a node is lost; the node's other workers end with their agent). A
resumed attempt never fires, so a restart from a checkpoint before STEP finishes (with STEP at or before
the first checkpoint, every attempt dies).
"""

from __future__ import annotations

import functools
import os
import signal
import time

from loongtrain.parallel import runtime

ENV = "LOONGTRAIN_KILL_AT"


@functools.lru_cache(maxsize=4)
def _parse(spec: str) -> tuple[int, int, bool]:
    parts = spec.split(":")
    try:
        if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "agent"):
            raise ValueError
        return int(parts[0]), int(parts[1]), len(parts) == 3
    except ValueError:
        raise ValueError(f"{ENV}={spec!r}: expected RANK:STEP or RANK:STEP:agent, e.g. 3:12") from None


def kill_point(step: int, start_step: int) -> None:
    """SIGKILL this process (and first its parent, with ``:agent``) if ``LOONGTRAIN_KILL_AT`` names its
    rank and ``step`` (only when the run started at step 0)."""
    spec = os.environ.get(ENV)
    if not spec or start_step != 0:
        return
    rank, at, agent = _parse(spec)
    me = runtime.rank()
    if step == at and me == rank:
        if agent:  # a lost node: its agent gone first (this process reparented), then its workers
            parent = os.getppid()
            os.kill(parent, signal.SIGKILL)
            deadline = time.monotonic() + 5.0
            while os.getppid() == parent and time.monotonic() < deadline:
                time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)
