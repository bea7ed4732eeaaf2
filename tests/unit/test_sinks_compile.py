"""Compiled blocks with attention sinks and per-layer windows (docs/compile.md, docs/attention.md#attention-sinks):
loongtrain's decoder with sinks, attention biases and alternating sliding/full layers trains like eager (fp64,
1e-10) under ``--compile on`` and selective recompute, with a document mix that changes every step, in at most
two graphs per layer kind and no graph break. Compiles with inductor, the real path."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from loongtrain.parallel.config import ParallelConfig
from loongtrain.parallel.mesh import single_process_mesh
from loongtrain.parallelize import compile as compile_step
from tests.helpers.compiled_graphs import GraphCounter, no_graph_breaks
from tests.helpers.gpt_oss import native_config

SEQ = 32


@pytest.fixture(autouse=True)
def inductor(monkeypatch):
    """--compile on's backend, inductor, through this test's own graph count."""
    assert compile_step.BACKEND == "inductor"
    counter = GraphCounter("inductor")
    monkeypatch.setattr(compile_step, "BACKEND", counter)
    torch._dynamo.reset()
    yield counter
    torch._dynamo.reset()


def _batch(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 64, (1, SEQ + 1), generator=gen)
    starts = torch.zeros(1, SEQ, dtype=torch.bool)
    starts[0, 0] = True
    starts[0, torch.randperm(SEQ - 1, generator=gen)[: step % 4].add(1)] = True
    return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:], "position_ids": torch.arange(SEQ)[None].clone(),
            "doc_starts": starts}


def _trainer(compile: str):
    from loongtrain.launch.config import TrainConfig, run_of
    from loongtrain.train.trainer import Trainer

    cfg = TrainConfig.from_dict(dict(seq_len=SEQ, steps=6, warmup=1, dtype="fp64",
                                     parallel=ParallelConfig(recompute="selective"),
                      doc_mask="on", compile=compile))
    return Trainer(run_of(cfg, native_config(window=5)), single_process_mesh(), torch.device("cpu"))


def test_compiled_sinks_and_layer_types_train_like_eager(inductor):
    eager, compiled = _trainer("off"), _trainer("on")
    for step in range(6):
        with no_graph_breaks():
            a, b = eager.step([_batch(step)]), compiled.step([_batch(step)])
        assert abs(a["loss"] - b["loss"]) < 1e-10 and abs(a["grad_norm"] - b["grad_norm"]) < 1e-10, (step, a, b)
    for (name, p), q in zip(eager.model.named_parameters(), compiled.model.parameters()):
        assert (p - q).abs().max().item() < 1e-10, name
    assert any(name.endswith("attention.sinks") for name, _ in eager.model.named_parameters())
    assert 1 <= inductor.count <= 4, inductor.count
