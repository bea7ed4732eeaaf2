"""Resume exactness with the real data pipeline (a small text corpus, byte tokenizer), 4 gloo ranks.

- Same layout: 6 uninterrupted steps vs 3 steps, stop, resume, 3 steps: losses of steps 4-6 are
  bit-identical (float32; same layout means the same arithmetic in the same order).
- Layout change: the checkpoint saved with (hp, cp) = (2, 1) resumed with (1, 2): losses of steps
  4-6 agree to rtol 1e-5 (float32; only the attention/reduction summation order differs).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loongtrain.parallel.config import ParallelConfig
from loongtrain.parallel.mesh import init_mesh
from loongtrain.launch.config import TrainConfig
from loongtrain.train.metrics import read_jsonl
from tests.helpers.dist_utils import run_distributed
from tests.helpers.fixtures import tiny_model, write_code_corpus
from tests.helpers.training import fit

pytestmark = pytest.mark.distributed

MODEL = tiny_model(vocab_size=256)


def _cfg(out_dir: Path, corpus: Path, hp: int, cp: int, **kw) -> TrainConfig:
    base = dict(
        corpus=str(corpus), seq_len=32, batch_size=2, grad_accum=2, steps=6, warmup=2, lr=1e-2,
        parallel=ParallelConfig(hp=hp, cp=cp), dtype="fp32", out_dir=str(out_dir), peak_tflops=1.0, tensorboard=False,
        plot=False, progress="off",
    )
    return TrainConfig.from_dict(dict(**{**base, **kw}))


def _losses(cfg: TrainConfig, hp: int, cp: int) -> list[float]:
    mesh = init_mesh(hp, cp)
    return [r["loss"] for r in fit(cfg, mesh, torch.device("cpu"), model_config=MODEL)]


def _worker(rank: int, world: int, tmp: str, corpus: str):
    tmp, corpus = Path(tmp), Path(corpus)
    full = _losses(_cfg(tmp / "full", corpus, 2, 1), 2, 1)
    first = _losses(_cfg(tmp / "split", corpus, 2, 1, stop_after=3), 2, 1)
    second = _losses(_cfg(tmp / "split", corpus, 2, 1, resume="latest"), 2, 1)
    ckpt3 = tmp / "split" / "checkpoints" / "step_00000003"
    moved = _losses(_cfg(tmp / "moved", corpus, 1, 2, resume=str(ckpt3)), 1, 2)
    return full, first, second, moved


def test_resume_exact_and_across_layouts(tmp_path):
    corpus = write_code_corpus(tmp_path / "corpus.txt", functions=300)
    results = run_distributed(_worker, 4, str(tmp_path), str(corpus))
    full, first, second, moved = results[0]
    assert all(r == results[0] for r in results), "ranks disagree on the logged losses"
    assert len(full) == 6 and len(first) == 3 and len(second) == 3 and len(moved) == 3
    assert full[-1] < full[0]
    assert first == full[:3]
    assert second == full[3:], "same-layout resume must be bit-identical"
    torch.testing.assert_close(torch.tensor(moved), torch.tensor(full[3:]), rtol=1e-5, atol=0)
    # the checkpoint directory: every step complete, 'latest' at the end, no partial writes left
    root = tmp_path / "split" / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_00000006"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000003", "step_00000006"]
    steps = [r["step"] for r in read_jsonl(tmp_path / "split" / "metrics.jsonl")]
    assert steps == [1, 2, 3, 4, 5, 6]
