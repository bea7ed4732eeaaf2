"""Hugging Face models sharded at world 4 (every family, and Mistral's short sliding window through the ring) equal the stock unsharded model; importing loongtrain needs no transformers."""

from __future__ import annotations

import json
import subprocess
import sys
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import loongtrain
from loongtrain.hf import (
    apply_to_hf,
    export_hf,
    hf_config_from_model_config,
    hf_to_native_state_dict,
    load_hf_model,
    model_config_from_hf,
    supported_architectures,
)
from loongtrain.loss.sharded import sharded_cross_entropy
from loongtrain.model import ModelConfig, Transformer
from tests.helpers.dist_utils import run_distributed
from tests.helpers.hf_models import COMMON, FAMILIES, SEQ, VOCAB, force_fp64, tiny_hf
from tests.helpers.hf_batches import BATCH, _batch


def _check_family(rank: int, world_size: int, family: str, layouts: list[tuple[int, int]],
                  overrides: dict | None = None) -> int:
    overrides = overrides or {}
    for hp, cp in layouts:
        mesh = loongtrain.init_mesh(hp=hp, cp=cp)
        inputs, labels, positions = _batch(100)
        ref = tiny_hf(family, **overrides)  # stock attention ("sdpa"), unsharded
        assert ref.config._attn_implementation == "sdpa"
        logits = ref(input_ids=inputs, position_ids=positions, use_cache=False).logits
        ref_loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)
        ref_loss.backward()
        model = apply_to_hf(tiny_hf(family, **overrides), mesh)
        local = [loongtrain.shard_sequence(t, mesh, dim=1) for t in (inputs, labels, positions)]
        logits = model(input_ids=local[0], position_ids=local[2]).logits
        assert logits.shape == (BATCH, SEQ // mesh.sp, VOCAB)
        loss, value = sharded_cross_entropy(logits, local[1], mesh)
        loss.backward()
        torch.testing.assert_close(value, ref_loss.detach(), rtol=0, atol=1e-10, msg=f"{family} loss {hp=} {cp=}")
        ref_params = dict(ref.named_parameters())
        for name, param in model.named_parameters():
            grad = param.grad.clone()
            dist.all_reduce(grad, group=mesh.sp_group)
            torch.testing.assert_close(
                grad, ref_params[name].grad, rtol=0, atol=1e-10, msg=f"{family} grad {name} {hp=} {cp=}"
            )
    return len(layouts)


@pytest.mark.distributed
@pytest.mark.parametrize("family", list(FAMILIES))
def test_sharded_hf_model_matches_stock_unsharded_world4(family):
    layouts = [(2, 2), (4, 1), (1, 4)]
    assert run_distributed(_check_family, 4, family, layouts) == [3] * 4


@pytest.mark.distributed
def test_mistral_short_sliding_window_through_the_ring_world4():
    # window 3 < S/cp: at cp=4 (chunks of 4 tokens) the ring's short pass; HF's window is i - w < j <= i
    layouts = [(1, 4), (2, 2), (4, 1)]
    assert run_distributed(_check_family, 4, "MistralForCausalLM", layouts, dict(sliding_window=3)) == [3] * 4


@pytest.mark.distributed  # a fresh interpreter
def test_import_needs_no_transformers():
    code = "import sys, loongtrain, loongtrain.hf; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
