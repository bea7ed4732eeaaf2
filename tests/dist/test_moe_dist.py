"""MoE models through 2D-Attention on 4 gloo ranks (docs/moe-and-gpt-oss.md#mixture-of-experts): at hp2 x cp2 and
hp1 x cp4, with and without packed documents, the logits, the load-balancing loss and the gradients of the total loss
(cross-entropy + coefficient x aux) of ``apply_2d_attention(bind_moe(model), mesh)`` equal HF's own unsharded eager
model in float64 (1e-10)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import loongtrain
from loongtrain.hf.moe import bind_moe, moe_layout
from loongtrain.loss.router import load_balancing_loss
from loongtrain.loss.sharded import sharded_cross_entropy
from tests.helpers.dist_utils import run_distributed
from tests.helpers.moe import MOE_FAMILIES, VOCAB, reference_aux_loss, tiny_moe

pytestmark = pytest.mark.distributed

SEQ, BATCH, TOL = 32, 2, 1e-10
LAYOUTS = [(2, 2), (1, 4)]
BOUNDS = [0, 5, 6, 19, SEQ]  # packed documents: lengths 5, 1, 13, 13


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    labels = tokens[:, 1:].clone()
    labels[0, 3:7] = -100
    return tokens[:, :-1], labels


def _reference(family: str, inputs: torch.Tensor, labels: torch.Tensor, packed: bool):
    """HF's unsharded eager model: logits, the total loss in float64 from its logits and router logits, grads."""
    ref = tiny_moe(family)
    bounds = BOUNDS if packed else [0, SEQ]
    outs = [ref(input_ids=inputs[:, a:b], position_ids=torch.arange(b - a).expand(BATCH, b - a), use_cache=False,
                output_router_logits=True) for a, b in zip(bounds[:-1], bounds[1:])]
    logits = torch.cat([o.logits for o in outs], dim=1)
    router = tuple(torch.cat([o.router_logits[i] for o in outs]) for i in range(len(outs[0].router_logits)))
    layout = moe_layout(ref.config)
    aux = reference_aux_loss(router, layout.num_experts, layout.top_k)
    ce = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)
    (ce + layout.aux_loss_coef * aux).backward()
    return ref, logits.detach(), aux.detach(), ce.detach()


def _check(rank: int, world_size: int, family: str) -> int:
    checked = 0
    inputs, labels = _batch()
    for packed in (False, True):
        ref, ref_logits, ref_aux, ref_ce = _reference(family, inputs, labels, packed)
        for hp, cp in LAYOUTS:
            mesh = loongtrain.init_mesh(hp=hp, cp=cp)
            model = tiny_moe(family)
            stats = bind_moe(model)
            model = loongtrain.apply_2d_attention(model, mesh)
            if packed:
                cu_seqlens = [torch.tensor(BOUNDS)] * BATCH
                positions = loongtrain.shard_sequence(
                    torch.cat([torch.arange(b - a) for a, b in zip(BOUNDS[:-1], BOUNDS[1:])]).expand(BATCH, SEQ),
                    mesh, dim=1)
                extra = dict(cu_seqlens=cu_seqlens)
            else:
                positions, extra = loongtrain.shard_sequence(torch.arange(SEQ).expand(BATCH, SEQ), mesh, dim=1), {}
            local_ids, local_labels = (loongtrain.shard_sequence(t, mesh, dim=1) for t in (inputs, labels))
            stats.open()
            logits = model(input_ids=local_ids, position_ids=positions, use_cache=False, output_router_logits=False,
                           **extra).logits
            stats.close()
            what = f"{family} {hp=} {cp=} {packed=}"
            torch.testing.assert_close(logits, loongtrain.shard_sequence(ref_logits, mesh, dim=1), rtol=0, atol=TOL,
                                       msg=lambda m: f"logits {what}: {m}")
            layout = moe_layout(model.config)
            aux = load_balancing_loss(stats, layout.num_experts, mesh)
            torch.testing.assert_close(aux.detach(), ref_aux, rtol=0, atol=TOL, msg=f"aux {what}")
            ce, ce_value = sharded_cross_entropy(logits, local_labels, mesh)
            torch.testing.assert_close(ce_value, ref_ce, rtol=0, atol=TOL, msg=f"ce {what}")
            (ce + layout.aux_loss_coef * aux).backward()
            ref_params = dict(ref.named_parameters())
            for name, param in model.named_parameters():
                grad = param.grad.clone()
                dist.all_reduce(grad, group=mesh.sp_group)
                torch.testing.assert_close(grad, ref_params[name].grad, rtol=0, atol=TOL, msg=f"grad {name} {what}")
            checked += 1
    return checked


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_sharded_moe_equals_hf_unsharded_eager_world4(family):
    assert run_distributed(_check, 4, family) == [4] * 4
