"""Suite-wide fixtures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.cuda_emulation import install as install_cuda_emulation
from tests.helpers.fixtures import tiny_model, write_code_corpus, write_line_corpus


@pytest.fixture(autouse=True)
def one_thread():
    """Tests use small shapes: one intra-op thread is fastest and steady on a busy 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


#: what the local ranks of the distributed and end-to-end tests import: the fork server every rank of a pytest
#: worker forks from imports them once, so a rank starts in a fraction of a second instead of importing the
#: trainer and transformers again (about 2 s a rank on a busy 2-core machine)
RANK_PRELOAD = ("loongtrain.train.trainer", "loongtrain.launch.train_run", "loongtrain.hf", "transformers", "peft",
                "tests.helpers.attention_cases", "tests.helpers.training", "tests.helpers.zero_cases")


@pytest.fixture(scope="session", autouse=True)
def rank_fork_server():
    """Start this pytest worker's fork server with :data:`RANK_PRELOAD` before any test starts ranks."""
    import multiprocessing
    import multiprocessing.forkserver

    from loongtrain.parallel import workers

    multiprocessing.get_context("forkserver").set_forkserver_preload([*workers._PRELOAD, *RANK_PRELOAD])
    multiprocessing.forkserver.ensure_running()
    yield


@pytest.fixture
def tiny_model_config():
    """The tests' tiny decoder (:func:`tests.helpers.fixtures.tiny_model`)."""
    return tiny_model()


@pytest.fixture(scope="module")
def code_corpus(tmp_path_factory) -> str:
    """Path of a small Python-like text corpus, one per test module."""
    return write_code_corpus(tmp_path_factory.mktemp("code_corpus") / "corpus.txt")


@pytest.fixture(scope="module")
def line_corpus(tmp_path_factory) -> str:
    """Path of a small English-like text corpus, one per test module."""
    return write_line_corpus(tmp_path_factory.mktemp("line_corpus") / "corpus.txt")


@pytest.fixture
def gpu(monkeypatch):
    """Pretend to be a CUDA build on a device of capability ``sm`` with flash attention and cuDNN 9:
    ``gpu(sm, cudnn=version or None) -> torch.device("cuda")`` (kernel selection tests; no tensors)."""

    def install(sm: tuple[int, int], cudnn: int | None = 90100) -> torch.device:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: sm)
        monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
        monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: cudnn is not None)
        monkeypatch.setattr(torch.backends.cudnn, "version", lambda: cudnn)
        monkeypatch.setattr(torch.version, "hip", None)
        return torch.device("cuda")

    return install


@pytest.fixture
def emulate(monkeypatch):
    """Install the emulated CUDA ops under the kernel wrappers (tests/helpers/cuda_emulation.py); returns a
    function taking EmulatedAten's options."""
    return lambda **options: install_cuda_emulation(monkeypatch, **options)


#: each test's measured seconds (setup, call and teardown), written by ``pytest --store-durations``
DURATIONS = Path(__file__).parent / "data" / "durations.json"
#: a test measured at this many seconds or more is marked ``slow`` (``pytest -m "not slow"`` skips them)
SLOW_S = 3.0


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--store-durations", action="store_true",
                     help="write every test's measured seconds to tests/data/durations.json")


def _measured() -> dict[str, float]:
    return json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests measured slow, and order the files slowest first, so that the workers of
    ``--dist loadfile`` end together instead of one waiting for the other's last long file."""
    seconds = _measured()
    per_file: dict[str, float] = {}
    for item in items:
        took = seconds.get(item.nodeid, 0.0)
        per_file[item.location[0]] = per_file.get(item.location[0], 0.0) + took
        if took >= SLOW_S:
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: -per_file[item.location[0]])  # stable: a file's tests keep their order


class _DurationStore:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] = round(self.seconds.get(report.nodeid, 0.0) + report.duration, 3)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if not hasattr(session.config, "workerinput"):  # the controller (or a run without xdist) writes
            DURATIONS.write_text(json.dumps(dict(sorted(self.seconds.items())), indent=0) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--store-durations") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_DurationStore(), "loongtrain-durations")
