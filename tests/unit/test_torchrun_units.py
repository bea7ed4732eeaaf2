"""The torchrun attempt handshake, start decision, marker and lost-node line, in one process (threads on
an in-process TCPStore; the two-agent runs are in tests/e2e/test_nodes.py)."""

from __future__ import annotations

import dataclasses
import datetime
import json
import threading
from pathlib import Path

import pytest
import torch.distributed as dist

from loongtrain.launch import torchrun
from loongtrain.launch.config import TrainConfig
from loongtrain.launch.train_run import prepare_run
from loongtrain.parallel.failures import _parse, kill_point


@pytest.fixture
def store(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    monkeypatch.setenv("GROUP_RANK", "0")
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=20))
    yield server


def _client(server) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=20))


def _attempt(server, world: int, lead_after_s: float = 0.0) -> list[torchrun.Attempt]:
    """Ranks 1.. start first; rank 0 leads after ``lead_after_s`` (each rank in a thread, its own client)."""
    results: dict[int, torchrun.Attempt] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            if r == 0:
                threading.Event().wait(lead_after_s)
                results[r] = torchrun._lead(_client(server), world, 20.0)
            else:
                results[r] = torchrun._follow(_client(server), r, 20.0)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    return [results[r] for r in range(world)]


def test_every_rank_agrees_on_a_fresh_token_never_a_dead_attempts(store):
    first = _attempt(store, 4)
    assert len({a.token for a in first}) == 1 and first[0].number == 1
    # the dead attempt's keys stay in the store (torchrun's agent store outlives attempts); the next
    # attempt's ranks start before its rank 0 and first read the dead token, whose go keys hold the dead
    # processes' nonces: they must wait for the new token
    second = _attempt(store, 4, lead_after_s=0.5)
    tokens = {a.token for a in second}
    assert len(tokens) == 1 and tokens != {first[0].token}, tokens
    assert [a.number for a in second] == [2, 2, 2, 2]
    assert second[0].job == first[0].job != ""  # the job's id outlives attempts
    assert second[1].nodes == {0: {"host": second[0].nodes[0]["host"], "ranks": [0, 1, 2, 3]}}


def test_a_missing_rank_is_named_when_rank_0_times_out(store):
    with pytest.raises(RuntimeError, match=r"ranks 1-2 of 3 did not join"):
        torchrun._lead(_client(store), 3, 0.3)


def _cfg(tmp_path: Path, **kw) -> TrainConfig:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 50)
    return TrainConfig.from_dict(dict(corpus=str(corpus), out_dir=str(tmp_path / "run"), seq_len=32, steps=4, **kw))


def test_restart_needs_a_later_attempt_and_this_jobs_marker(tmp_path, store):
    cfg = _cfg(tmp_path)
    first = _attempt(store, 1)[0]
    assert not torchrun.is_restart(cfg, first)
    torchrun.write_marker(cfg, first)
    assert [p.name for p in Path(cfg.output.out_dir).iterdir()] == [torchrun.RUN_ID_FILE]  # no temp file left
    assert not torchrun.is_restart(cfg, first)  # the first attempt is never a restart
    later = dataclasses.replace(first, number=2)
    assert torchrun.is_restart(cfg, later)
    assert torchrun.is_restart(cfg, dataclasses.replace(first, restarts=1))  # a node's count, fresh store
    assert not torchrun.is_restart(cfg, dataclasses.replace(later, job="another-job"))  # an older job's marker


def test_rank_0_decides_run_or_user_error(tmp_path, store):
    cfg = _cfg(tmp_path)
    run = prepare_run(cfg, 4)
    attempt = _attempt(store, 1)[0]
    decision = torchrun.decide(run, 4, attempt)
    identity = decision.pop("data_identity")
    assert decision == {"kind": "run", "resume": "", "overwrite": False, "init_from": ""}
    assert identity["tokenizer"] == "byte" and identity["corpus"][0]["corpus"] == cfg.data.corpus
    assert (Path(cfg.output.out_dir) / torchrun.RUN_ID_FILE).is_file()
    assert (Path(cfg.output.out_dir) / ".loongtrain.lock").is_file()  # rank 0 holds --out-dir for the attempt
    torchrun._HELD.pop().__exit__(None, None, None)
    blocked = tmp_path / "a_file"
    blocked.write_text("")
    decision = torchrun.decide(dataclasses.replace(run, cfg=cfg.replace(out_dir=str(blocked))), 4,
                               attempt)
    assert decision["kind"] == "error" and "is a file" in decision["text"]
    json.dumps(decision)  # it travels through the store


def test_the_node_without_an_answer_is_named(store):
    nodes = {0: {"host": "h0", "ranks": [0, 1]}, 1: {"host": "h1", "ranks": [2, 3]}, 2: {"host": "h2", "ranks": [4, 5]}}
    prefix = dist.PrefixStore("t", _client(store))
    prefix.multi_set([f"answers/{g}" for g in nodes], ["0"] * 3)
    attempt = torchrun.Attempt("1.x", 1, "j", store, prefix, 0, nodes)
    prefix.add("answers/2", 1)  # node 2's ranks failed too, and answered
    line = torchrun.missing_nodes(attempt, window_s=0.2)
    assert line is not None and line.startswith("lost node 1 (host h1, ranks 2-3):"), line
    assert torchrun.missing_nodes(attempt, window_s=0.2) == line  # node 0's next rank: the same verdict
    prefix.add("answers/1", 1)  # a late answer does not change the verdict
    assert torchrun.missing_nodes(attempt, window_s=0.2) == line


def test_every_node_answered_names_none(store):
    nodes = {0: {"host": "h0", "ranks": [0]}, 1: {"host": "h1", "ranks": [1]}}
    prefix = dist.PrefixStore("u", _client(store))
    prefix.multi_set(["answers/0", "answers/1"], ["0", "1"])
    attempt = torchrun.Attempt("1.y", 1, "j", store, prefix, 0, nodes)
    assert torchrun.missing_nodes(attempt, window_s=5.0) is None
    assert torchrun.missing_nodes(attempt, window_s=5.0) is None


def test_ranges():
    assert torchrun._ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"


def test_kill_hook_parses_its_value_and_fires_only_in_a_run_from_step_0(monkeypatch):
    assert _parse("3:12") == (3, 12, False) and _parse("3:12:agent") == (3, 12, True)
    for bad in ("3", "a:1", "3:12:node", "1:2:3:4"):
        with pytest.raises(ValueError, match=f"LOONGTRAIN_KILL_AT={bad!r}"):
            _parse(bad)
    monkeypatch.setenv("LOONGTRAIN_KILL_AT", "0:2")
    kill_point(2, start_step=1)  # a resumed run: no kill (this test process lives on)
    kill_point(3, start_step=0)
