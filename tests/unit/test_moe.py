"""The MoE block (loongtrain/model/moe.py) bound into Hugging Face's MoE families (loongtrain/hf/moe.py): logits,
gradients and the router's load-balancing loss equal HF's own eager model (fp64); grouped GEMMs equal the loop."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from loongtrain.hf.moe import bind_moe, moe_layout, router_stats
from loongtrain.loss.router import load_balancing_loss
from loongtrain.model.moe import CLAMPED_SWIGLU, TOPK_SOFTMAX, ExpertWeights, MoESpec, RouterStats, moe_forward
from tests.helpers.moe import MOE_FAMILIES, VOCAB, hf_moe_config, reference_aux_loss, tiny_moe

SEQ, BATCH = 24, 2


def _inputs(seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_bound_model_equals_hf_eager_logits_grads_and_loss(family):
    inputs, _ = _inputs()
    targets = inputs[:, 1:]  # what HF's loss predicts of labels=inputs (it shifts them itself)
    ref = tiny_moe(family)
    out = ref(input_ids=inputs, labels=inputs, use_cache=False)
    layout = moe_layout(ref.config)
    # HF's out.loss is float32 (its cross-entropy upcasts to float32, its aux sums in float32): the reference
    # differentiated is the same loss of HF's own logits and router logits in float64
    ref_aux = reference_aux_loss(out.router_logits, layout.num_experts, layout.top_k)
    ref_ce = F.cross_entropy(out.logits[:, :-1].reshape(-1, VOCAB), targets.reshape(-1))
    ref_total = ref_ce + layout.aux_loss_coef * ref_aux
    ref_total.backward()
    model = copy.deepcopy(tiny_moe(family))
    stats = bind_moe(model)
    assert stats is not None and router_stats(model) is stats
    stats.open()
    logits = model(input_ids=inputs, use_cache=False, output_router_logits=False).logits
    stats.close()
    torch.testing.assert_close(logits, out.logits, rtol=0, atol=1e-10)
    aux = load_balancing_loss(stats, layout.num_experts, None)
    torch.testing.assert_close(aux, ref_aux, rtol=0, atol=1e-12)
    torch.testing.assert_close(aux, out.aux_loss.double(), rtol=1e-6, atol=0)  # HF sums in float32
    ce = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), targets.reshape(-1))
    total = ce + layout.aux_loss_coef * aux
    torch.testing.assert_close(total, ref_total, rtol=0, atol=1e-12)
    torch.testing.assert_close(total.float(), out.loss, rtol=1e-6, atol=0)
    total.backward()
    ref_params = dict(ref.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, ref_params[name].grad, rtol=0, atol=1e-10, msg=name)
    assert stats.rows == BATCH * SEQ * len(layout.layers)


def test_qwen3_moe_layout_follows_sparse_step_and_dense_layers():
    config = hf_moe_config("Qwen3MoeForCausalLM", num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    assert moe_layout(config).layers == (1, 5)
    assert moe_layout(hf_moe_config("MixtralForCausalLM")).layers == (0, 1)
    with pytest.raises(ValueError, match="num_experts_per_tok=9"):
        moe_layout(hf_moe_config("MixtralForCausalLM", num_experts_per_tok=9))


def test_recording_is_per_forward_and_closed_during_recompute():
    stats = RouterStats()
    logits, experts = torch.randn(5, 4), torch.randint(0, 4, (5, 2))
    stats.add(logits, experts)  # not open: nothing
    assert stats.counts is None
    stats.open()
    stats.add(logits, experts)
    stats.add(logits, experts)
    stats.close()
    stats.add(logits, experts)
    assert stats.rows == 10 and stats.counts.sum() == 20


def _random_weights(spec: MoESpec, dim: int, ffn: int, dtype: torch.dtype, bias: bool) -> ExpertWeights:
    gen = torch.Generator().manual_seed(11)
    e = spec.num_experts

    def rand(*shape):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * 0.3).to(dtype).requires_grad_()

    gate_up = rand(e, dim, 2 * ffn) if spec.transposed else rand(e, 2 * ffn, dim)
    down = rand(e, ffn, dim) if spec.transposed else rand(e, dim, ffn)
    return ExpertWeights(rand(e, dim), gate_up, down, rand(e) if bias else None, rand(e, 2 * ffn) if bias else None,
                         rand(e, dim) if bias else None)


SPECS = {
    "qwen3": (MoESpec(8, 2, normalize_top_k=False), False),
    "gpt_oss": (MoESpec(4, 2, routing=TOPK_SOFTMAX, activation=CLAMPED_SWIGLU, swiglu_limit=0.8, interleaved=True,
                        transposed=True), True),
}


@pytest.mark.parametrize("kind", list(SPECS))
def test_grouped_gemms_equal_the_loop(kind):
    # torch._grouped_mm runs on CPU in float32 (CUDA: bfloat16 on compute capability >= 9.0)
    spec, bias = SPECS[kind]
    results = []
    for grouped in (False, True):
        weights = _random_weights(spec, 16, 8, torch.float32, bias)
        x = torch.randn(3, 7, 16, generator=torch.Generator().manual_seed(2)).requires_grad_()
        y = moe_forward(x, weights, spec, grouped=grouped)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(4)))
        results.append([y, x.grad, *(w.grad for w in weights if w is not None)])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_gpt_oss_experts_equal_hf_gpt_oss_mlp():
    import transformers

    config = transformers.GptOssConfig(hidden_size=32, intermediate_size=24, num_local_experts=4,
                                       num_experts_per_tok=2, swiglu_limit=0.9, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=VOCAB)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        ref = transformers.models.gpt_oss.modeling_gpt_oss.GptOssMLP(config).double()
        with torch.no_grad():
            for param in ref.parameters():
                param.normal_(0.0, 0.4)
    block = copy.deepcopy(ref)
    x = torch.randn(2, 9, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, _ = ref(x_ref)

    class Holder(torch.nn.Module):  # bind_moe reads the model's config
        def __init__(self):
            super().__init__()
            self.mlp, self.config = block, config

    stats = bind_moe(Holder())
    stats.open()
    y, scores = block(x_ours)
    assert scores is None  # gpt-oss's decoder layer unpacks (hidden, router scores) and drops the scores
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-12)
    grad = torch.randn(y.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    y_ref.backward(grad)
    y.backward(grad)
    torch.testing.assert_close(x_ours.grad, x_ref.grad, rtol=0, atol=1e-12)
    ref_params = dict(ref.named_parameters())
    for name, param in block.named_parameters():
        torch.testing.assert_close(param.grad, ref_params[name].grad, rtol=0, atol=1e-12, msg=name)
    assert stats.rows == 18


def test_bad_specs_raise():
    with pytest.raises(ValueError, match="top_k=5 must be at most num_experts=4"):
        MoESpec(4, 5)
    with pytest.raises(ValueError, match="routing='sigmoid'"):
        MoESpec(4, 2, routing="sigmoid")
    with pytest.raises(ValueError, match="no layer"):
        load_balancing_loss(RouterStats(), 4, None)


@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_per_expert_weight_files_load_fused(family, tmp_path):
    from safetensors import safe_open

    from loongtrain.hf.build import hf_initial_weights
    from loongtrain.hf.load import check_hf_dir, load_hf_model
    from tests.helpers.moe import write_moe_dir

    directory = write_moe_dir(tmp_path / family, family)
    with safe_open(str(directory / "model.safetensors"), framework="pt") as handle:
        names = list(handle.keys())
    assert any(".experts.0." in name for name in names), names  # what save_pretrained writes: expert by expert
    check_hf_dir(directory)
    model = load_hf_model(directory)
    reference = tiny_moe(family, dtype=torch.float32)
    initial = hf_initial_weights(directory)
    for name, param in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], param, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(initial(name, param.shape), param, rtol=0, atol=0, msg=name)


# ---------------------------------------------------------------- the grouped path's gaps (docs/moe-and-gpt-oss.md)


def test_grouped_mm_supported_checks_the_expert_width_and_refuses_sm120(monkeypatch):
    """Only sm90 up to (not including) sm120, bf16, and both the model's and the experts' widths multiples of 8."""
    from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: PLC0415

    from loongtrain.model.moe import grouped_mm_supported  # noqa: PLC0415

    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    with FakeTensorMode():
        x = torch.empty(5, 2880, dtype=torch.bfloat16, device="cuda")
        assert grouped_mm_supported(x, 2880)
        assert not grouped_mm_supported(x, 2884)  # an expert width without 16-byte alignment
        assert not grouped_mm_supported(x.float(), 2880)
        for sm, ok in (((10, 0), True), ((8, 0), False), ((12, 0), False), ((12, 1), False)):
            capability[0] = sm
            assert grouped_mm_supported(x, 2880) is ok, sm


def test_the_expert_bias_is_added_without_gathering_it_per_row(monkeypatch):
    """gpt-oss's per-expert biases on the grouped path: equal to the gathered form forward and backward (fp64), a
    chunk of rows at a time; under fake tensors at 64K tokens x 4 experts, 2 x 2880 wide (bf16), its peak beyond the
    grouped GEMM's output is one chunk of the bias, not the 2.9 GB of a gathered copy."""
    from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: PLC0415
    from torch.distributed._tools.mem_tracker import MemTracker  # noqa: PLC0415

    from loongtrain.model import moe  # noqa: PLC0415

    monkeypatch.setattr(moe, "BIAS_CHUNK_ROWS", 5)
    g = torch.Generator().manual_seed(0)
    out, bias = (torch.randn(n, 6, generator=g, dtype=torch.float64) for n in (23, 4))
    experts = torch.sort(torch.randint(0, 4, (23,), generator=g)).values
    grad = torch.randn(23, 6, generator=g, dtype=torch.float64)
    leaves = [(out.clone().requires_grad_(), bias.clone().requires_grad_()) for _ in range(2)]
    want = leaves[0][0] * 1 + leaves[0][1][experts]
    got = moe._ExpertBias.apply(leaves[1][0] * 1, leaves[1][1], experts)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for a, b in zip(torch.autograd.grad(got, leaves[1], grad), torch.autograd.grad(want, leaves[0], grad)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)

    monkeypatch.setattr(moe, "BIAS_CHUNK_ROWS", 8192)
    rows, width = 65536 * 4, 2 * 2880
    with FakeTensorMode():
        out = torch.empty(rows, width, dtype=torch.bfloat16)
        bias, experts = torch.empty(32, width), torch.zeros(rows, dtype=torch.int64)
        tracker = MemTracker()
        with tracker:
            moe._ExpertBias.apply(out, bias, experts)
        peak = max(max(p.values()) for p in tracker.get_tracker_snapshot("peak").values())
    held = rows * width * 2 + 32 * width * 4 + rows * 8  # the GEMM's output, the bias, the expert of each row
    gathered = rows * width * 2  # what a gathered copy of the bias would add
    assert gathered > 2.8e9 and peak - held <= 8192 * width * 2 + 32 * width * 2, peak - held


@pytest.mark.parametrize("kind", ["gpt_oss"])
def test_compiled_grouped_experts_without_tokens_get_exactly_zero_gradients(kind):
    """The grouped path (bf16, torch._grouped_mm) compiled with inductor, two experts that no token picks: their
    weights' and biases' gradients are exactly zero, and the rest equal eager's."""
    spec, bias = SPECS[kind]
    results = []
    for compiled in (False, True):
        weights = _random_weights(spec, 16, 8, torch.bfloat16, bias)
        with torch.no_grad():
            weights.router[:2] = -100.0  # with positive inputs, experts 0 and 1 are never in the top k
            weights.router_bias[:2] = -100.0
        x = torch.randn(3, 7, 16, generator=torch.Generator().manual_seed(2)).abs().to(torch.bfloat16)
        x.requires_grad_()
        fn = lambda x, weights=weights: moe_forward(x, weights, spec, grouped=True)  # noqa: E731
        torch._dynamo.reset()
        y = (torch.compile(fn, backend="inductor") if compiled else fn)(x)
        y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16))
        results.append([y, x.grad, *(w.grad for w in weights if w is not None)])
        for grads in (weights.gate_up.grad, weights.down.grad, weights.gate_up_bias.grad, weights.down_bias.grad):
            assert grads[:2].abs().max() == 0 and grads[2:].abs().max() > 0
    for a, b in zip(*results):
        torch.testing.assert_close(a.float(), b.float(), rtol=0.05, atol=0.05)
