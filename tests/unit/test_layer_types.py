"""Per-layer windows from ``layer_types`` (docs/attention.md#attention-sinks): a full layer is never windowed and a
sliding layer never full, in loongtrain's decoder and through HF's attention interface; the config's checks; the
unsharded local attention with sinks equals the eager formula."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import loongtrain
from loongtrain.model.config import ModelConfig, num_params
from loongtrain.model.llama import Transformer
from loongtrain.model.local_attention import local_attention
from tests.helpers.gpt_oss import hf_gpt_oss, native_config
from tests.helpers.sinks import sinks_reference


class _Recorder:
    """An attention_fn that logs each call's window and whether sinks came, then runs the wrapped one."""

    def __init__(self, inner, log: list, layer: int) -> None:
        self.inner, self.log, self.layer = inner, log, layer

    def __call__(self, q, k, v, **kwargs):
        self.log.append((self.layer, kwargs.get("sliding_window"), kwargs.get("sinks") is not None))
        return self.inner(q, k, v, **kwargs)


def test_native_layers_take_their_window():
    model = loongtrain.apply_2d_attention(Transformer(native_config(window=5), seed=0).double(),
                                          loongtrain.single_process_mesh())
    log: list = []
    for i, layer in enumerate(model.layers):
        layer.attention.attention_fn = _Recorder(layer.attention.attention_fn, log, i)
    model(torch.randint(0, 64, (1, 16)))
    assert log == [(0, 5, True), (1, None, True), (2, 5, True), (3, None, True)]


def test_hf_gpt_oss_layers_take_their_window():
    model = loongtrain.apply_2d_attention(hf_gpt_oss(window=5), loongtrain.single_process_mesh())
    log: list = []
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.attention_fn = _Recorder(layer.self_attn.attention_fn, log, i)
    model(input_ids=torch.randint(0, 64, (1, 16)), position_ids=torch.arange(16)[None])
    assert model.config.layer_types == ["sliding_attention", "full_attention"] * 2
    assert log == [(0, 5, True), (1, None, True), (2, 5, True), (3, None, True)]


def test_windowed_layer_differs_from_full():
    # the window and the layer types change the result: a model whose layers are all full gives other logits
    config = native_config(window=3)
    ids = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(0))
    mixed = Transformer(config, seed=1).double()(ids)
    full = Transformer(dataclasses.replace(config, layer_types=("full_attention",) * 4), seed=1).double()(ids)
    sliding = Transformer(dataclasses.replace(config, layer_types=("sliding_attention",) * 4), seed=1).double()(ids)
    assert (mixed - full).abs().max() > 1e-4 and (mixed - sliding).abs().max() > 1e-4


def test_config_layer_windows_and_params():
    config = native_config(window=7)
    assert [config.layer_window(i) for i in range(4)] == [7, None, 7, None]
    assert config.uniform_window is None
    assert dataclasses.replace(config, layer_types=None).uniform_window == 7
    model = Transformer(config, seed=0)
    assert num_params(config) == sum(p.numel() for p in model.parameters())
    assert ModelConfig(**{**dataclasses.asdict(config), "layer_types": list(config.layer_types)}) == config


@pytest.mark.parametrize("change, message", [
    (dict(layer_types=("sliding_attention",) * 3), r"layer_types has 3 entries for num_layers=4"),
    (dict(layer_types=("sliding_attention", "full", "full_attention", "full_attention")),
     r"layer_types\[1\]='full' is not one of \['sliding_attention', 'full_attention', 'linear_attention'\]"),
    (dict(sliding_window=None), r"layer_types\[0\]='sliding_attention' needs a sliding_window"),
    (dict(layer_types="full_attention"), r"layer_types='full_attention' must be a list"),
    (dict(sliding_window=-4), r"sliding_window=-4 must be None \(no window\) or a positive integer"),
])
def test_bad_layer_types_raise_one_line(change, message):
    with pytest.raises(ValueError, match=message) as info:
        dataclasses.replace(native_config(), **change)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("documents", [False, True])
def test_local_attention_with_sinks_is_the_eager_formula(window, documents):
    from loongtrain.attn.masking import AttnMask, dense_mask

    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 12, 4, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 12, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    sinks = torch.randn(4, generator=g, dtype=torch.float64)
    cu = (0, 5, 12) if documents else None
    got = local_attention(q, k, v, cu_seqlens=list(cu) if cu else None, sliding_window=window, sinks=sinks)
    visible = dense_mask(12, AttnMask(True, window, (cu,) if cu else None))[None]
    assert (got - sinks_reference(q, k, v, sinks, visible)).abs().max() < 1e-12


def test_plans_count_each_layer_with_its_window():
    # half the layers windowed: the FLOPs halfway between all full and all windowed, the step time between them
    from loongtrain.model.config import flops_per_token
    from loongtrain.parallel.config import ParallelConfig
    from loongtrain.parallel.documents import Documents
    from loongtrain.plan.attention_cost import AttnShape
    from loongtrain.plan.cluster import load_cluster
    from loongtrain.plan.cost import document_flops, step_cost

    mixed = native_config(window=64)
    full = dataclasses.replace(mixed, layer_types=None, sliding_window=None)
    windowed = dataclasses.replace(mixed, layer_types=None)
    flops = [flops_per_token(m, 4096) for m in (mixed, full, windowed)]
    assert flops[1] > flops[2] and abs(flops[0] - (flops[1] + flops[2]) / 2) < 1e-6 * flops[0]
    cost = [step_cost(m, ParallelConfig(hp=1, cp=4), load_cluster("h100"), nodes=1, seq_len=4096, world=4)
            for m in (mixed, full, windowed)]
    assert cost[1].step_time > cost[0].step_time > cost[2].step_time
    docs, shape = Documents(((0, 1000, 4096),)), AttnShape(1, 4096, 4, 2, 8)
    work = [document_flops(m, shape, docs) for m in (mixed, full, windowed)]
    assert work[1] > work[2] and abs(work[0] - (work[1] + work[2]) / 2) < 1e-6 * work[0]


def test_export_maps_attention_biases_and_refuses_what_llama_lacks(tmp_path):
    from transformers import AutoModelForCausalLM

    from loongtrain.hf.convert import export_hf, model_config_from_hf

    config = dataclasses.replace(native_config(), attention_sinks=False, layer_types=None, sliding_window=None)
    model = Transformer(config, seed=4).double()
    export_hf(model, None, tmp_path / "out")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float64, attn_implementation="sdpa")
    assert hf.config.attention_bias and model_config_from_hf(hf.config).attention_bias
    ids = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(0))
    assert (hf(input_ids=ids).logits - model(ids)).abs().max() < 1e-5  # HF's norms and RoPE round through fp32
    for change, message in ((dict(attention_sinks=True), "attention_sinks=True has no LlamaForCausalLM"),
                            (dict(sliding_window=4, layer_types=native_config().layer_types), "sliding layers")):
        with pytest.raises(ValueError, match=message):
            export_hf(Transformer(dataclasses.replace(config, **change), seed=0), None, tmp_path / "bad")
