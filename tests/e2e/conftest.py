"""Fixtures of the commands' bad-input tables (tests/helpers/bad_inputs.py), built once per pytest worker."""

from __future__ import annotations

import os

import pytest

from tests.helpers.bad_inputs import make_files, make_safety


@pytest.fixture(scope="session")
def files(tmp_path_factory) -> dict[str, str]:
    return make_files(tmp_path_factory.mktemp("bad_inputs"))


@pytest.fixture(scope="session")
def safety(files, tmp_path_factory):
    """Fixture files of the data-safety table, beside ``files``."""
    made, locks = make_safety(files, tmp_path_factory.mktemp("safety"))
    yield made
    for fd in locks:
        os.close(fd)


@pytest.fixture
def no_workers(monkeypatch):
    """Starting a worker, or training in this process, fails the test."""
    def started(*args, **kwargs):
        raise AssertionError("a worker was started")

    from loongtrain.launch import train_run as launch
    from loongtrain.parallel import workers

    for module, name in ((workers, "run_local"), (launch, "run_local"), (launch, "run_worker")):
        monkeypatch.setattr(module, name, started)


@pytest.fixture
def reached(monkeypatch):
    """Worker starters replaced: a worker started fails the test; reaching the start of train's or eval's
    workers (after every check) is recorded and returns."""
    from loongtrain.data import prepare as prep
    from loongtrain.launch import eval_run as eval_launch
    from loongtrain.launch import train_run as launch
    from loongtrain.parallel import workers

    def started(*args, **kwargs):
        raise AssertionError("a worker was started")

    seen: list[str] = []
    for module, name in ((workers, "run_local"), (launch, "run_local"), (launch, "run_worker"),
                         (prep, "_tokenize_shard")):
        monkeypatch.setattr(module, name, started)
    monkeypatch.setattr(prep.multiprocessing, "get_context", started)
    monkeypatch.setattr(launch, "_launch_local", lambda run, world: seen.append("train"))
    monkeypatch.setattr(eval_launch, "launch", lambda job: seen.append("eval") or [])
    return seen

