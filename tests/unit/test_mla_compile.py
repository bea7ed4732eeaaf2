"""Compiled blocks with MLA (docs/compile.md, docs/attention.md#mla): loongtrain's decoder with latent attention
(values of another head dim than queries and keys) trains like eager (fp64, 1e-10) under ``--compile on`` and
selective recompute, with a document mix that changes every step, without graph breaks (traced under
``error_on_graph_break``). Compiles with inductor, through the test's own graph counter."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch._dynamo

from loongtrain.parallel.config import ParallelConfig
from loongtrain.parallel.mesh import single_process_mesh
from loongtrain.parallelize import compile as compile_step
from tests.helpers.compiled_graphs import GraphCounter, no_graph_breaks
from tests.helpers.deepseek import native_mla_config
from tests.unit.test_sinks_compile import _batch

SEQ = 32


@pytest.fixture(autouse=True)
def inductor(monkeypatch):
    """The blocks compile with inductor through this test's own counter: its graphs, nobody else's."""
    assert compile_step.BACKEND == "inductor"
    counter = GraphCounter("inductor")
    monkeypatch.setattr(compile_step, "BACKEND", counter)
    torch._dynamo.reset()
    yield counter
    torch._dynamo.reset()


def _trainer(compile: str):
    from loongtrain.launch.config import TrainConfig, run_of
    from loongtrain.train.trainer import Trainer

    model = dataclasses.replace(native_mla_config(), num_layers=2, num_experts=0, top_k=0, moe_ffn_dim=0,
                                moe_layers=(), shared_ffn_dim=0)
    cfg = TrainConfig.from_dict(dict(seq_len=SEQ, steps=4, warmup=1, dtype="fp64",
                                     parallel=ParallelConfig(recompute="selective"), doc_mask="on", compile=compile))
    return Trainer(run_of(cfg, model), single_process_mesh(), torch.device("cpu"))


def test_compiled_latent_attention_trains_like_eager(inductor):
    eager, compiled = _trainer("off"), _trainer("on")
    for step in range(4):
        with no_graph_breaks():
            a, b = eager.step([_batch(step)]), compiled.step([_batch(step)])
        assert abs(a["loss"] - b["loss"]) < 1e-10 and abs(a["grad_norm"] - b["grad_norm"]) < 1e-10, (step, a, b)
    for (name, p), q in zip(eager.model.named_parameters(), compiled.model.parameters()):
        assert (p - q).abs().max().item() < 1e-10, name
    assert any(name.endswith("attention.wkv_b.weight") for name, _ in eager.model.named_parameters())
    assert inductor.count >= 1, inductor.count  # the blocks compiled (a graph break would have raised above)
