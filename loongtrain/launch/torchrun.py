"""torchrun jobs on one or several nodes: one agreed attempt, one start decision, workers that end with
their agent, and a lost node named (docs/launching.md).

- **Attempt** (:func:`join_attempt`). torchrun (c10d rendezvous) hands every attempt of a job the same
  TCPStore (its node-0 agent's), whose keys outlive the attempt, and ``TORCHELASTIC_RESTART_COUNT``
  differs between nodes (a node whose own workers did not fail restarts with an unchanged count). So the
  count cannot key an attempt. Instead global rank 0 publishes a fresh random token; every other rank
  acknowledges the token it reads with a nonce of its own, and rank 0 echoes each nonce under that rank's
  key. A rank accepts a token only when its own nonce comes back, so a token left by a dead attempt is
  never accepted. Every key of the attempt (the process group's included) lives under ``loongtrain/TOKEN``.
- **Start decision** (:func:`agree_on_start`). Rank 0 alone runs the preflight and broadcasts (through the
  store) one decision to every rank: run (fresh, or resume one checkpoint) / the run is complete / a user
  error (every rank exits 2). The attempt is a restart when the job already ran an attempt
  (the store's attempt count, or any rank's restart count, above zero) and that job's first attempt
  passed the checks: it wrote ``OUT_DIR/torchrun_run_id`` (rank 0 only, atomically) with the run id and
  the job's id.
- **Agent watch**. A worker whose torchrun agent died (its parent changed) exits at once, so a killed
  agent takes its node's workers with it, as a lost machine does, instead of leaving orphans.
- **Lost nodes** (:func:`lost_nodes_named`). When training fails on a rank, the first failing rank of each
  node counts its node in; after a short window, nodes that no rank answered for are named in one line,
  which every failing rank of that node reports.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist

from loongtrain._files import OutputLock
from loongtrain.launch.config import TrainConfig
from loongtrain.launch.preflight import RunComplete, check_corpus, check_out_dir, data_identity, preflight
from loongtrain.train.checkpoint import RUN_OUTPUT
from loongtrain.train.config import Run

log = logging.getLogger("loongtrain.train")

RUN_ID_FILE = "torchrun_run_id"
ROOT = "loongtrain"
ANSWER_WINDOW_S = 3.0  # how long a failing node waits for the other nodes' ranks to answer


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def restart_count() -> int:
    """This node's ``TORCHELASTIC_RESTART_COUNT`` (0 outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


@dataclasses.dataclass(frozen=True)
class Attempt:
    """One attempt of a torchrun job, the same on every rank (``nodes``: published by rank 0)."""

    token: str
    number: int  # 1 for the job's first attempt (counted in the job's store)
    job: str  # the job's id: the same for all its attempts
    client: dist.Store
    store: dist.Store  # the attempt's own keys: PrefixStore("loongtrain/TOKEN")
    restarts: int = 0  # the largest TORCHELASTIC_RESTART_COUNT of any rank (rank 0 only)
    nodes: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)  # node -> host, ranks


_ATTEMPT: Attempt | None = None


def _key(*parts: object) -> str:
    return "/".join([ROOT, *map(str, parts)])


def _connect(timeout: datetime.timedelta) -> dist.TCPStore:
    """A client of the agent's store (or, without one, the store rank 0 hosts at MASTER_ADDR:MASTER_PORT)."""
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    host = not agent_store and int(os.environ["RANK"]) == 0
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=host,
                         timeout=timeout, wait_for_workers=False)


def join_attempt(timeout_s: float) -> Attempt:
    """This process's attempt (joined once: every rank of the attempt gets the same token)."""
    global _ATTEMPT
    if _ATTEMPT is None:
        timeout = datetime.timedelta(seconds=timeout_s)
        client = _connect(timeout)
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        _ATTEMPT = _lead(client, world, timeout_s) if rank == 0 else _follow(client, rank, timeout_s)
    return _ATTEMPT


def _me(nonce: str) -> str:
    return json.dumps({"nonce": nonce, "node": int(os.environ.get("GROUP_RANK", "0")),
                       "host": socket.gethostname(), "restarts": restart_count()})


def _lead(client: dist.Store, world: int, timeout_s: float) -> Attempt:
    """Rank 0: publish a new token, collect every rank's acknowledgement, echo their nonces."""
    number = client.add(_key("attempts"), 1)
    fresh = secrets.token_hex(8)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        job = client.compare_set(_key("job"), "", fresh).decode()  # set by the job's first attempt
    else:  # a new store every attempt: the run id is all the attempts share
        job = os.environ.get("TORCHELASTIC_RUN_ID", "")
    token = f"{number}.{fresh}"
    client.set(_key("attempt"), token)
    acks = [_key("ack", token, r) for r in range(1, world)]
    if acks:
        try:
            client.wait(acks, datetime.timedelta(seconds=timeout_s))
        except dist.DistStoreError:
            missing = [r for r, k in zip(range(1, world), acks) if not client.check([k])]
            raise RuntimeError(f"ranks {_ranges(missing)} of {world} did not join this torchrun attempt within "
                               f"--timeout={timeout_s:g} s") from None
    ranks = [json.loads(_me(""))] + [json.loads(v) for v in (client.multi_get(acks) if acks else [])]
    nodes: dict[int, dict[str, Any]] = {}
    for r, who in enumerate(ranks):
        nodes.setdefault(who["node"], {"host": who["host"], "ranks": []})["ranks"].append(r)
    store = dist.PrefixStore(_key(token), client)
    store.multi_set([f"answers/{g}" for g in nodes], ["0"] * len(nodes))  # see lost_nodes_named
    store.set("nodes", json.dumps(nodes))
    if acks:
        client.multi_set([_key("go", token, r) for r in range(1, world)], [w["nonce"] for w in ranks[1:]])
    return Attempt(token, number, job, client, store, max(w["restarts"] for w in ranks), nodes)


def _follow(client: dist.Store, rank: int, timeout_s: float) -> Attempt:
    """A rank > 0: acknowledge the published token until rank 0 echoes this process's nonce for it."""
    nonce, token, delay = secrets.token_hex(8), "", 0.02
    deadline = time.monotonic() + timeout_s
    while True:
        current = client.get(_key("attempt")).decode()  # waits for the first attempt's rank 0
        if current != token:
            token = current
            client.set(_key("ack", token, rank), _me(nonce))
        go = _key("go", token, rank)
        if client.check([go]) and client.get(go).decode() == nonce:
            break
        if time.monotonic() > deadline:  # (a go key of a dead attempt holds another nonce)
            raise RuntimeError(f"rank {rank}: rank 0 of this torchrun attempt did not answer within "
                               f"--timeout={timeout_s:g} s")
        time.sleep(delay)
        delay = min(2 * delay, 0.5)
    store = dist.PrefixStore(_key(token), client)
    nodes = {int(g): v for g, v in json.loads(store.get("nodes")).items()}
    return Attempt(token, int(token.split(".")[0]), "", client, store, 0, nodes)


def process_group_store(timeout: datetime.timedelta) -> dist.Store:
    """The store for ``init_process_group`` under torchrun: the attempt's keys only (never a dead
    attempt's gloo addresses)."""
    return dist.PrefixStore("pg", join_attempt(timeout.total_seconds()).store)


def _ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``'0-2, 5'``."""
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ", ".join(out)


# -- the start decision ------------------------------------------------------------------------------


def _marker_text(job: str) -> str:
    return f"{os.environ.get('TORCHELASTIC_RUN_ID', '')} {job}".strip() + "\n"


def is_restart(cfg: TrainConfig, attempt: Attempt) -> bool:
    """A later attempt of a job whose first attempt passed the checks (rank 0's view)."""
    if attempt.number <= 1 and attempt.restarts == 0:
        return False
    marker = Path(cfg.output.out_dir, RUN_ID_FILE)
    return marker.is_file() and marker.read_text() == _marker_text(attempt.job)


def write_marker(cfg: TrainConfig, attempt: Attempt) -> None:
    """Record that this job owns ``--out-dir`` (rank 0, atomically: temp file + os.replace)."""
    out = Path(cfg.output.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".{RUN_ID_FILE}.{os.getpid()}.tmp"
    tmp.write_text(_marker_text(attempt.job))
    os.replace(tmp, out / RUN_ID_FILE)


def decide(run: Run, world: int, attempt: Attempt) -> dict[str, Any]:
    """Rank 0's decision for the attempt: ``{"kind": "run", "resume": ..., "overwrite": ..., "init_from": ...,
    "data_identity": ...}``,
    ``{"kind": "complete", "text": ...}`` or ``{"kind": "error", "text": ...}`` (a user error)."""
    cfg = run.cfg
    restarted = is_restart(cfg, attempt)
    try:
        resolved = preflight(cfg, world, run.tokenizer, restarted=restarted)
        _HELD.append(OutputLock(RUN_OUTPUT, cfg.output.out_dir).__enter__())  # rank 0 holds it until it exits
    except RunComplete as exc:
        return {"kind": "complete", "text": str(exc)}
    except ValueError as exc:
        return {"kind": "error", "text": str(exc)}
    write_marker(cfg, attempt)
    if restarted:
        log.info("torchrun attempt %d (restart counts up to %d): resuming from %s", attempt.number,
                 attempt.restarts, resolved.output.resume or "scratch (no checkpoint yet)")
    return {"kind": "run", "resume": resolved.output.resume, "overwrite": resolved.output.overwrite,
            "init_from": resolved.model.init_from, "data_identity": data_identity(resolved, run.tokenizer)}


#: the ``--out-dir`` lock rank 0 took for the attempt (released by the kernel when the rank exits)
_HELD: list[OutputLock] = []


def agree_on_start(run: Run, world: int) -> Run | None:
    """Under torchrun, on every rank, with ``run`` prepared (options validated): the file checks that
    need no peer (a user error exits 2 here), then join the attempt and act on rank 0's one decision.
    Returns ``run`` with the checkpoint to resume resolved, or None when a restarted job is already
    complete; raises ValueError (the same on every rank) for a user error."""
    check_out_dir(run.cfg)
    check_corpus(run.cfg, run.tokenizer)
    attempt = join_attempt(run.cfg.runtime.timeout)
    watch_agent(int(os.environ["RANK"]))
    if int(os.environ["RANK"]) == 0:
        decision = decide(run, world, attempt)
        attempt.store.set("start", json.dumps(decision))
    else:
        decision = json.loads(attempt.store.get("start"))
    if decision["kind"] == "error":
        raise ValueError(decision["text"])
    if decision["kind"] == "complete":
        log.info("torchrun attempt %d: the run is complete (%s)", attempt.number, decision["text"])
        return None
    cfg = run.cfg.replace(resume=decision["resume"], overwrite=decision["overwrite"],
                              init_from=decision["init_from"])
    return dataclasses.replace(run, cfg=cfg, resume=cfg.output.resume, data_identity=decision.get("data_identity"))


# -- liveness ----------------------------------------------------------------------------------------


_AGENT_PID: int | None = None


def agent_alive() -> bool:
    """False once the torchrun agent this worker started under is gone (True when not watched)."""
    return _AGENT_PID is None or os.getppid() == _AGENT_PID


def watch_agent(rank: int, period_s: float = 0.5) -> None:
    """Exit this worker (code 1) as soon as its torchrun agent (the parent process) is gone."""
    global _AGENT_PID
    parent = _AGENT_PID = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(period_s)
        log.error("rank %d: the torchrun agent of this node (pid %d) died; stopping this worker", rank, parent)
        logging.shutdown()
        os._exit(1)

    threading.Thread(target=watch, name="loongtrain-agent-watch", daemon=True).start()


def missing_nodes(attempt: Attempt, window_s: float = ANSWER_WINDOW_S) -> str | None:
    """After a failure on this rank: one line naming the nodes none of whose ranks answered within
    ``window_s`` (None when every node answered). The first failing rank of a node counts it in and
    judges; the node's other failing ranks take its verdict."""
    node = int(os.environ.get("GROUP_RANK", "0"))
    if not agent_alive():  # this node is the lost one: it must not answer for itself
        return None
    try:
        if attempt.store.add(f"answers/{node}", 1) != 1:
            attempt.store.wait([f"verdict/{node}"], datetime.timedelta(seconds=window_s + 10))
            return attempt.store.get(f"verdict/{node}").decode() or None
        keys = [f"answers/{g}" for g in attempt.nodes]
        deadline = time.monotonic() + window_s
        while True:
            counts = [int(v) for v in attempt.store.multi_get(keys)]
            if all(counts) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        lost = [g for g, n in zip(attempt.nodes, counts) if n == 0]
        names = "; ".join(f"node {g} (host {attempt.nodes[g]['host']}, ranks {_ranges(attempt.nodes[g]['ranks'])})"
                          for g in lost)
        line = (f"lost {names}: none of its ranks answered within {window_s:g} s of this failure (its agent or "
                f"machine died, or its agent stopped its workers; that node's log says which)") if lost else ""
        attempt.store.set(f"verdict/{node}", line)
        return line or None
    except dist.DistError:
        zero = attempt.nodes.get(0, {"host": os.environ.get("MASTER_ADDR", "?"), "ranks": []})
        return (f"the job's store at {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} does not "
                f"answer: node 0 (host {zero['host']}, ranks {_ranges(zero['ranks'])}), whose torchrun agent "
                f"serves it, is lost")


@contextlib.contextmanager
def lost_nodes_named() -> Iterator[None]:
    """Around a torchrun rank's training: a failure caused by a lost node is re-raised as a
    RuntimeError whose message names that node (the original error is its cause)."""
    try:
        yield
    except Exception as exc:
        if _ATTEMPT is None or len(_ATTEMPT.nodes) < 2:
            raise
        line = missing_nodes(_ATTEMPT)
        if line is None:
            raise
        raise RuntimeError(f"{line}; the failure here: {str(exc).splitlines()[0] if str(exc) else type(exc)}") \
            from exc
