"""The host work of a step (loongtrain/train/optim.py, loongtrain/parallel/step_memo.py, attn/ring_step.py;
docs/kernels.md#host-work): AdamW's foreach (and CUDA's fused) step and the clip norm in a few kernels, exact to
the single-tensor step and per-gradient norms (fp64, 1e-12); the document plan of a step computed once and
reused by every layer, so the host's Python calls per layer do not grow with the layers or the documents
(counted, not timed)."""

from __future__ import annotations

import collections
import sys

import pytest
import torch

from loongtrain.attn import ring
from loongtrain.attn.cuda_kernels import CUDA_FLASH
from loongtrain.launch.config import TrainConfig, run_of
from loongtrain.model.config import ModelConfig
from loongtrain.parallel.config import ParallelConfig
from loongtrain.parallel.mesh import single_process_mesh
from loongtrain.parallel.step_memo import LastCall, argument_key
from loongtrain.train.optim import adamw_implementation, build_optimizer, clip_grad_norm
from loongtrain.train.trainer import Trainer
from tests.helpers.cuda_emulation import install

TOL = dict(rtol=1e-12, atol=1e-12)


def params(dtype=torch.float64) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s, generator=g, dtype=dtype)) for s in ((16, 8), (8,), (32, 16), (3,))]


def steps(ps: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, clip: float = 0.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    norms = []
    for step in range(4):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype) * (step + 1)
        norms.append(clip_grad_norm(ps, clip) if clip else torch.zeros(()))
        optimizer.step()
    return norms


def adamw(ps, **implementation) -> torch.optim.Optimizer:
    return torch.optim.AdamW([{"params": ps[::2], "weight_decay": 0.1}, {"params": ps[1::2], "weight_decay": 0.0}],
                             lr=1e-2, betas=(0.9, 0.95), eps=1e-8, **implementation)


@pytest.mark.parametrize("implementation", [{"foreach": True}, {"fused": True}])
def test_foreach_and_fused_adamw_equal_the_single_tensor_step(implementation):
    single, fast = params(), params()
    steps(single, adamw(single, foreach=False))
    steps(fast, adamw(fast, **implementation))
    for a, b in zip(single, fast, strict=True):
        torch.testing.assert_close(b, a, **TOL)
    if "foreach" in implementation:
        assert all(torch.equal(a, b) for a, b in zip(single, fast))  # foreach: the same arithmetic, bit for bit


def test_the_trainers_adamw_is_foreach_on_cpu_fused_on_cuda_single_tensor_when_offloaded():
    assert adamw_implementation(torch.device("cpu"), False) == {"foreach": True}
    assert adamw_implementation(torch.device("cuda"), False) == {"fused": True}
    assert adamw_implementation(torch.device("cuda"), True) == {"foreach": False}
    net = torch.nn.Linear(4, 4)
    optimizer, _ = build_optimizer(net, TrainConfig.from_dict(dict(steps=2, warmup=0)).optim)
    assert optimizer.defaults["foreach"] is True


def test_the_clip_norm_equals_per_gradient_fp64_norms():
    ps = params(torch.float32)
    grads = [torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) for i, p in enumerate(ps)]
    for p, g in zip(ps, grads):
        p.grad = g.clone()
    want = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads]))
    total = clip_grad_norm(ps, 0.5)
    assert total.dtype == torch.float64
    torch.testing.assert_close(total, want, **TOL)
    coef = (0.5 / (want + 1e-6)).clamp(max=1.0).float()
    for p, g in zip(ps, grads):
        assert torch.equal(p.grad, g * coef)


# ---------------------------------------------------------------- the document plan, once per step


def test_last_call_remembers_by_identity_and_version():
    memo, calls = LastCall(), []
    compute = lambda x: calls.append(1) or int(x.sum())  # noqa: E731
    t = torch.arange(4)
    assert memo(compute, t) == memo(compute, t) == 6 and len(calls) == 1
    t.add_(1)  # in place: a new version
    assert memo(compute, t) == 10 and len(calls) == 2
    assert argument_key([[0, 3], [0, 3]]) == argument_key([[0, 3], [0, 3]]) != argument_key([[0, 2], [0, 3]])


PLANNING = ("attn/masking.py:visible_pieces", "attn/ring_step.py:plan_step", "attn/ring_step.py:_varlen_call",
            "model/local_attention.py:normalize_cu_seqlens", "attn/ops.py:_read_mask", "attn/api.py:_mask_tensors",
            "attn/masking.py:member_runs")


def calls_of_one_step(layers: int, documents: int, seq: int = 96) -> collections.Counter:
    """Every loongtrain Python function call of one training step (after a first one), by ``file:function``."""
    model = ModelConfig(vocab_size=64, dim=32, num_layers=layers, num_heads=4, num_kv_heads=2, ffn_dim=64)
    cfg = TrainConfig.from_dict(dict(seq_len=seq, steps=10, warmup=1, dtype="fp64", doc_mask="on",
                                     parallel=ParallelConfig(),
                      memory_report=False))
    trainer = Trainer(run_of(cfg, model), single_process_mesh(), torch.device("cpu"))
    starts = torch.zeros(1, seq, dtype=torch.bool)
    starts[0, torch.linspace(0, seq - 1, documents).long()] = True
    tokens = torch.randint(0, 64, (1, seq + 1), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:], "position_ids": torch.arange(seq)[None],
             "doc_starts": starts}
    trainer.step([batch])
    counts: collections.Counter = collections.Counter()

    def profile(frame, event, arg):
        if event == "call" and "/loongtrain/" in frame.f_code.co_filename:
            counts[f"{frame.f_code.co_filename.split('/loongtrain/')[-1]}:{frame.f_code.co_name}"] += 1

    sys.setprofile(profile)
    try:
        trainer.step([batch])
    finally:
        sys.setprofile(None)
    return counts


def test_the_host_work_per_layer_is_constant_in_layers_and_documents(monkeypatch):
    """Packed documents through a varlen kernel (flash's, emulated on CPU): the planning runs once per step
    whatever the layers, and a layer's own Python calls are the same for 4 and for 24 documents."""
    install(monkeypatch, allow_fp64=True)
    monkeypatch.setattr(ring, "kernel_for", lambda q, k, v: CUDA_FLASH)
    runs = {(layers, docs): calls_of_one_step(layers, docs) for layers in (2, 4) for docs in (4, 24)}
    for docs in (4, 24):
        planning = [sum(runs[layers, docs][name] for name in PLANNING) for layers in (2, 4)]
        assert planning[0] == planning[1] > 0, planning  # once per step, not once per layer
    per_layer = {docs: (runs[4, docs] - runs[2, docs], runs[2, docs] - runs[4, docs]) for docs in (4, 24)}
    assert not per_layer[4][1] and not per_layer[24][1]  # more layers never fewer calls
    assert per_layer[4][0] == per_layer[24][0], (per_layer[4][0] - per_layer[24][0], per_layer[24][0] - per_layer[4][0])
