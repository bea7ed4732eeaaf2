"""Suite-wide fixtures."""

from __future__ import annotations

import pytest
import torch

from tests.fixtures import tiny_model, write_code_corpus, write_line_corpus


@pytest.fixture(autouse=True)
def one_thread():
    """Tests use small shapes: one intra-op thread is fastest and steady on a busy 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def tiny_model_config():
    """The tests' tiny decoder (:func:`tests.fixtures.tiny_model`)."""
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


#: the slowest test files (``pytest --durations=0`` on a quiet 2-core machine), slowest first: run first, so
#: the workers of ``--dist loadfile`` end together instead of one waiting for the other's last long file
LONGEST_FIRST = ("test_nodes.py", "test_simulate.py", "test_hf.py", "test_faults.py", "test_launch.py",
                 "test_documents.py", "test_compile.py", "test_compile_dist.py", "test_memory_model.py",
                 "test_hf_train.py", "test_gpu_check.py", "test_attention_dist.py", "test_benchmarks_smoke.py",
                 "test_documents_dist.py", "test_lora_dist.py", "test_bad_inputs.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
