"""DeepSeek-V3 through 2D-Attention on 4 gloo ranks (docs/moe-and-gpt-oss.md#deepseek-v3-and-mla): MLA (query/key
head dim 24, value 12, the low-rank projections and the decoupled RoPE in HF's own module), group-limited sigmoid
routing with the score-correction bias, shared experts and a dense first layer, run by ``bind_moe`` and
``apply_2d_attention`` at hp2 x cp2, hp1 x cp4 and the double ring (hp1 x cp4, inner ring 2), with and without packed
documents: logits and every parameter's gradient equal HF's own unsharded model in float64 (1e-10; HF's float32
norms, rotary angles and router made dtype-preserving, tests/helpers/deepseek.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import loongtrain
from loongtrain.hf.moe import bind_moe
from loongtrain.loss.sharded import sharded_cross_entropy
from tests.helpers.deepseek import VOCAB, dtype_preserving, tiny_deepseek
from tests.helpers.dist_utils import run_distributed

pytestmark = pytest.mark.distributed

SEQ, BATCH, TOL = 32, 2, 1e-10
LAYOUTS = [dict(hp=2, cp=2), dict(hp=1, cp=4), dict(hp=1, cp=4, inner_ring=2)]
BOUNDS = [0, 5, 6, 19, SEQ]  # packed documents: lengths 5, 1, 13, 13


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    labels = tokens[:, 1:].clone()
    labels[0, 3:7] = -100
    return tokens[:, :-1], labels


def _positions(packed: bool) -> torch.Tensor:
    bounds = BOUNDS if packed else [0, SEQ]
    return torch.cat([torch.arange(b - a) for a, b in zip(bounds[:-1], bounds[1:])]).expand(BATCH, SEQ)


def _reference(inputs: torch.Tensor, labels: torch.Tensor, packed: bool):
    """HF's unsharded model, each document its own forward: logits, cross-entropy and gradients."""
    ref = dtype_preserving(tiny_deepseek())
    bounds = BOUNDS if packed else [0, SEQ]
    logits = torch.cat([ref(input_ids=inputs[:, a:b], position_ids=torch.arange(b - a).expand(BATCH, b - a),
                            use_cache=False).logits for a, b in zip(bounds[:-1], bounds[1:])], dim=1)
    ce = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)
    ce.backward()
    return ref, logits.detach(), ce.detach()


def _check(rank: int, world_size: int) -> int:
    checked = 0
    inputs, labels = _batch()
    for packed in (False, True):
        ref, ref_logits, ref_ce = _reference(inputs, labels, packed)
        for layout in LAYOUTS:
            mesh = loongtrain.init_mesh(**layout)
            model = dtype_preserving(tiny_deepseek())
            bind_moe(model)
            model = loongtrain.apply_2d_attention(model, mesh)
            extra = dict(cu_seqlens=[torch.tensor(BOUNDS)] * BATCH) if packed else {}
            local_ids, local_labels, positions = (loongtrain.shard_sequence(t, mesh, dim=1)
                                                  for t in (inputs, labels, _positions(packed)))
            logits = model(input_ids=local_ids, position_ids=positions, use_cache=False, **extra).logits
            what = f"{layout} {packed=}"
            torch.testing.assert_close(logits, loongtrain.shard_sequence(ref_logits, mesh, dim=1), rtol=0, atol=TOL,
                                       msg=lambda m: f"logits {what}: {m}")
            ce, ce_value = sharded_cross_entropy(logits, local_labels, mesh)
            torch.testing.assert_close(ce_value, ref_ce, rtol=0, atol=TOL, msg=f"ce {what}")
            ce.backward()
            ref_params = dict(ref.named_parameters())
            for name, param in model.named_parameters():
                grad = param.grad.clone()
                dist.all_reduce(grad, group=mesh.sp_group)
                assert ref_params[name].grad.abs().max() > 0, name  # every weight takes part
                torch.testing.assert_close(grad, ref_params[name].grad, rtol=0, atol=TOL, msg=f"grad {name} {what}")
            checked += 1
    return checked


def test_sharded_deepseek_v3_equals_hf_unsharded_world4():
    assert run_distributed(_check, 4) == [2 * len(LAYOUTS)] * 4
