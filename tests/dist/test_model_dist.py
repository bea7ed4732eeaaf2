"""The native model sharded at world 4 (and with scaled RoPE) equals the single-process model, forward and gradients."""

from __future__ import annotations

import ast
import copy
import pickle
from pathlib import Path
import pytest
import torch
import torch.distributed as dist
from torch import nn
import loongtrain
from loongtrain.attn.apply import MeshAttention
from loongtrain.loss.sharded import IGNORE_INDEX, sharded_cross_entropy
from loongtrain.model import (
    PRESETS,
    ModelConfig,
    Transformer,
    apply_rope,
    flops_per_token,
    get_preset,
    local_attention,
    num_params,
    rope_cos_sin,
)
from tests.helpers.counting import count_ring_forward
from tests.helpers.dist_utils import run_distributed
from tests.helpers.model_batches import BATCH, SEQ, SMALL, _batch


def _reference(config: ModelConfig, data_seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = Transformer(config, seed=7).double()  # plain: local attention, no mesh
    inputs, labels, positions = _batch(data_seed, config.vocab_size)
    logits = model(inputs, positions)
    loss, value = sharded_cross_entropy(logits, labels, None)
    assert torch.equal(loss.detach(), value)
    loss.backward()
    return value, {n: p.grad for n, p in model.named_parameters()}


def _check_sharded(rank: int, world_size: int, cases: list[tuple]) -> int:
    """Each case ``(hp, cp, tie_embeddings values[, ModelConfig overrides])``: sharded equals plain."""
    checked = 0
    for hp, cp, tied, *overrides in cases:
        mesh = loongtrain.init_mesh(hp=hp, cp=cp)
        for tie in tied:
            config = ModelConfig(**SMALL, tie_embeddings=tie, **(overrides[0] if overrides else {}))
            data_seed = 1000 + mesh.dp_rank  # replicas train on different data
            ref_loss, ref_grads = _reference(config, data_seed)
            model = loongtrain.apply_2d_attention(Transformer(config, seed=7).double(), mesh)
            assert all(isinstance(layer.attention.attention_fn, MeshAttention) for layer in model.layers)
            inputs, labels, positions = (
                loongtrain.shard_sequence(t, mesh, dim=1) for t in _batch(data_seed, config.vocab_size)
            )
            logits = model(inputs, positions)
            assert logits.shape == (BATCH, SEQ // mesh.sp, config.vocab_size)
            loss, value = sharded_cross_entropy(logits, labels, mesh)
            loss.backward()
            torch.testing.assert_close(value, ref_loss, rtol=0, atol=1e-10, msg=f"loss {hp=} {cp=}")
            for name, param in model.named_parameters():
                grad = param.grad.clone()
                dist.all_reduce(grad, group=mesh.sp_group)
                torch.testing.assert_close(
                    grad, ref_grads[name], rtol=0, atol=1e-10, msg=f"grad {name} {hp=} {cp=} {tie=}"
                )
            checked += 1
    return checked


@pytest.mark.distributed
def test_sharded_model_matches_single_process_world4():
    # (hp, cp, tie_embeddings values); (4, 1) replicates KV heads (hp > Hkv); (2, 1) has dp=2 replicas
    cases = [(2, 2, [True, False]), (1, 4, [False]), (4, 1, [True]), (2, 1, [False])]
    counts = run_distributed(_check_sharded, 4, cases)
    assert counts == [5] * 4


@pytest.mark.distributed
def test_sharded_scaled_rope_matches_single_process_world4():
    # every RoPE scaling type; positions 100..131 lie past original_max_position_embeddings=16
    from tests.helpers.fixtures import SCALINGS

    cases = [(2, 2, [False], dict(rope_scaling=scaling)) for scaling in SCALINGS.values()]
    assert run_distributed(_check_sharded, 4, cases) == [len(cases)] * 4
