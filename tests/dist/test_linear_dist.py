"""Linear attention through the 2D mesh on 4 gloo ranks (docs/linear-attention.md): at hp2 x cp2, hp1 x cp4 and the
double ring (hp1 x cp4, inner ring 2), with and without packed documents, in fp64 within 1e-10 of transformers'
own unsharded code made dtype-preserving: ``loongtrain.linear_attention`` for both gate forms (also balanced chunk
orders, chunks shorter than the convolution's halo, key heads replicated over hp4); a tiny Qwen3.5 through
``apply_2d_attention`` (logits and every gradient); Kimi-Linear's KDA layer and Qwen3-Next's Gated DeltaNet layer. The bytes a linear layer exchanges
over the context ranks are the same at two sequence lengths, and equal the layout's formula."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import loongtrain
from loongtrain.attn.linear.layout import RunLayout, exchange_bytes
from loongtrain.parallel.comm import CommCounter
from tests.helpers.dist_utils import run_distributed
from tests.helpers.gpt_oss import documents
from tests.helpers.linear_models import check_linear_layer, check_qwen3_5, delta_rule_inputs, hf_delta_rule

pytestmark = pytest.mark.distributed

CONFIGS = [dict(hp=2, cp=2), dict(hp=1, cp=4), dict(hp=1, cp=4, inner_ring=2)]
# (mesh, gate per channel, sequence length, balanced chunk order)
CASES = [(dict(hp=2, cp=2), False, 32, False), (dict(hp=1, cp=4, inner_ring=2), True, 32, False),
         (dict(hp=1, cp=4), False, 16, False),  # chunks of 2 tokens: halos of 3 span several chunks
         (dict(hp=4, cp=1), False, 16, False),  # 2 key heads replicated over 4 head ranks
         (dict(hp=2, cp=2), True, 64, True), (dict(hp=1, cp=4), False, 64, True)]


def _check_api(rank: int, world_size: int, tol: float) -> int:
    for cfg, per_channel, seq, balanced in CASES:
        mesh = loongtrain.init_mesh(**cfg)
        for docs in (None, documents(seq)):
            inputs = [t.requires_grad_() for t in delta_rule_inputs(per_channel, seq)]
            want = hf_delta_rule(*inputs, docs)
            weight = torch.randn(want.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
            want_grads = torch.autograd.grad((want * weight).sum(), inputs)
            order = loongtrain.balanced_chunk_order(docs, seq, mesh.cp, mesh.hp) if balanced and docs else None
            local = [loongtrain.shard_sequence(t.detach(), mesh, 1, order).requires_grad_() for t in inputs[:5]]
            conv = inputs[5].detach().clone().requires_grad_()
            out = loongtrain.linear_attention(*local, mesh, conv_weight=conv, cu_seqlens=docs, chunk_order=order)
            torch.testing.assert_close(out, loongtrain.shard_sequence(want, mesh, 1, order), rtol=0, atol=tol)
            grads = torch.autograd.grad((out * loongtrain.shard_sequence(weight, mesh, 1, order)).sum(), [*local, conv])
            for name, mine, theirs in zip("q k v g beta".split(), grads, want_grads):
                torch.testing.assert_close(mine, loongtrain.shard_sequence(theirs, mesh, 1, order), rtol=0, atol=tol,
                                           msg=f"d{name} {cfg} {per_channel=} {seq=} {docs is not None=}")
            conv_grad = grads[5].clone()
            if mesh.sp_group is not None:
                dist.all_reduce(conv_grad, group=mesh.sp_group)
            torch.testing.assert_close(conv_grad, want_grads[5], rtol=0, atol=tol)
    return len(CASES)


def test_linear_attention_both_gates_exact():
    assert run_distributed(_check_api, 4, 1e-10) == [len(CASES)] * 4


def test_qwen3_5_through_apply_2d_attention_exact():
    results = run_distributed(check_qwen3_5, 4, CONFIGS, 1e-10)
    assert all(len(r) == 2 * len(CONFIGS) for r in results)


@pytest.mark.parametrize("kind, configs", [("kda", CONFIGS), ("qwen3_next", CONFIGS[:1])])
def test_kimi_linear_kda_and_qwen3_next_layers_exact(kind, configs):
    results = run_distributed(check_linear_layer, 4, kind, configs, 1e-10)
    assert all(len(r) == 2 * len(configs) for r in results)


def _count(rank: int, world_size: int, cfg: dict, seqs: tuple[int, ...]) -> list[dict]:
    mesh = loongtrain.init_mesh(**cfg)
    counted = []
    for seq in seqs:
        inputs = delta_rule_inputs(False, seq)
        local = [loongtrain.shard_sequence(t, mesh, 1).requires_grad_() for t in inputs[:5]]
        with CommCounter() as counter:
            out = loongtrain.linear_attention(*local, mesh, conv_weight=inputs[5])
            out.sum().backward()
        counted.append(dict(counter.bytes))
    return counted


@pytest.mark.parametrize("cfg", [dict(hp=1, cp=4), dict(hp=2, cp=2)])
def test_exchanged_bytes_do_not_grow_with_the_sequence(cfg):
    seqs = (32, 256)
    for counted in run_distributed(_count, 4, cfg, seqs):
        short, long = counted
        context = ("halo", "state", "dhalo", "dstate")
        assert all(short[k] > 0 for k in context), short
        assert {k: short[k] for k in context} == {k: long[k] for k in context}  # no growth with the length
        inputs = delta_rule_inputs(False, seqs[0])
        formula = exchange_bytes(RunLayout(seqs[0], cfg["cp"]), batch=2, key_heads=2, value_heads=4, key_dim=3,
                                 value_dim=5, taps=4, hp=cfg["hp"], dtype=inputs[0].dtype)
        assert {k: short[k] for k in context} == formula
        if cfg["hp"] > 1:  # the head all-to-all carries the tokens: it grows with the length
            assert long["a2a"] == short["a2a"] * seqs[1] // seqs[0]


def _backward_bytes(rank: int, world_size: int, cfg: dict) -> dict[str, dict]:
    from torch.utils.checkpoint import checkpoint

    from loongtrain.parallelize.recompute import selective_context_fn

    mesh = loongtrain.init_mesh(**cfg)
    inputs = delta_rule_inputs(False, 32)
    counted = {}
    for mode in ("none", "selective", "full"):
        local = [loongtrain.shard_sequence(t, mesh, 1).requires_grad_() for t in inputs[:5]]

        def layer(*xs):
            return loongtrain.linear_attention(*xs, mesh, conv_weight=inputs[5])

        if mode == "none":
            out = layer(*local)
        else:
            extra = {"context_fn": selective_context_fn} if mode == "selective" else {}
            out = checkpoint(layer, *local, use_reentrant=False, **extra)
        with CommCounter() as counter:
            out.sum().backward()
        counted[mode] = dict(counter.bytes)
    return counted


def test_selective_recompute_sends_nothing_again():
    for counted in run_distributed(_backward_bytes, 4, dict(hp=2, cp=2)):
        assert counted["selective"] == counted["none"]  # only the gradients' traffic
        assert counted["full"]["state"] > 0 and "state" not in counted["none"]  # full recompute re-sends
