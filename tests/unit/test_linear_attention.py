"""Linear attention on one process (docs/linear-attention.md): the chunked gated delta rule against transformers'
own chunked and recurrent torch code (dtype-preserving), for a gate per head and per channel, with initial states
and documents; the runs, halos and composition order of the context ranks; the checks of the inputs; Qwen3.5 and
Kimi-Linear's KDA at world 1; the ``fla`` kernels' wrapper and choice through a CPU emulation."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

import loongtrain
from loongtrain.attn.linear import kernels
from loongtrain.attn.linear.layout import RunLayout, document_masks, exchange_bytes, local_positions
from loongtrain.model.delta_rule import delta_rule, l2_normalize
from tests.helpers.fla_emulation import FAULTS, EmulatedFla, emulated_fla
from tests.helpers.linear_models import (
    check_linear_layer,
    check_qwen3_5,
    delta_rule_inputs,
    dtype_preserving,
    hf_delta_rule,
)

pytest.importorskip("transformers")

Tensor = torch.Tensor


def _problem(per_channel: bool, n: int = 2, t: int = 23, heads: int = 3, dk: int = 5, dv: int = 4, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k = l2_normalize(rand(n, t, heads, dk)), l2_normalize(rand(n, t, heads, dk))
    g = -torch.rand(n, t, heads, *((dk,) if per_channel else ()), generator=gen, dtype=torch.float64)
    beta = torch.rand(n, t, heads, generator=gen, dtype=torch.float64)
    return [x.requires_grad_() for x in (q, k, rand(n, t, heads, dv), g, beta, rand(n, heads, dk, dv))]


def _hf_recurrence(per_channel: bool):
    from transformers.models.kimi_linear import modeling_kimi_linear as kimi
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    if per_channel:
        return dtype_preserving(kimi.recurrent_kimi_delta_attention)
    return dtype_preserving(qwen.torch_recurrent_gated_delta_rule)


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("chunk_size", [4, 64])
def test_delta_rule_equals_transformers_recurrence(per_channel, chunk_size):
    q, k, v, g, beta, state = _problem(per_channel)
    out, final = delta_rule(q, k, v, g, beta, scale=5 ** -0.5, initial_state=state, chunk_size=chunk_size)
    want, want_final = _hf_recurrence(per_channel)(q, k, v, g=g, beta=beta, initial_state=state,
                                                   output_final_state=True)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(final, want_final, rtol=0, atol=1e-12)
    weight = torch.randn_like(out)
    mine = torch.autograd.grad((out * weight).sum() + final.sum(), [q, k, v, g, beta, state])
    theirs = torch.autograd.grad((want * weight).sum() + want_final.sum(), [q, k, v, g, beta, state])
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-11)


def test_delta_rule_equals_transformers_chunked_kernel():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    q, k, v, g, beta, state = _problem(False, t=70)
    want, want_final = dtype_preserving(qwen.torch_chunk_gated_delta_rule)(
        q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True)
    out, final = delta_rule(q, k, v, g, beta, scale=5 ** -0.5, initial_state=state)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(final, want_final, rtol=0, atol=1e-12)


@pytest.mark.parametrize("per_channel", [False, True])
def test_document_starts_reset_the_state(per_channel):
    q, k, v, g, beta, state = _problem(per_channel, n=1, t=20)
    starts = torch.zeros(1, 20, dtype=torch.bool)
    starts[0, [6, 7, 15]] = True
    out, final = delta_rule(q, k, v, g, beta, scale=0.5, starts=starts, initial_state=state, chunk_size=8)
    pieces, carry = [], state
    for s, e in ((0, 6), (6, 7), (7, 15), (15, 20)):
        piece, carry = delta_rule(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], scale=0.5,
                                  initial_state=carry if s == 0 else None)
        pieces.append(piece)
    torch.testing.assert_close(out, torch.cat(pieces, 1), rtol=0, atol=1e-13)
    torch.testing.assert_close(final, carry, rtol=0, atol=1e-13)


def test_runs_of_zigzag_and_balanced_orders():
    layout = RunLayout(32, 4)  # zigzag: chunks (0, 7) (1, 6) (2, 5) (3, 4) of 4 tokens
    assert [layout.runs(c) for c in range(4)] == [((0, 4), (28, 4)), ((4, 4), (24, 4)), ((8, 4), (20, 4)),
                                                  ((12, 8),)]
    assert layout.slots == 2 and layout.any_state and not RunLayout(32, 1).any_state
    assert layout.sequence == ((0, 0), (1, 0), (2, 0), (3, 0), (2, 1), (1, 1), (0, 1))
    assert local_positions(layout, 1).tolist() == [4, 5, 6, 7, 24, 25, 26, 27]
    # halos: rank 1's run at 24 takes 21..23 from rank 2's second run (its tail is 21..23)
    width = 3
    tail = lambda c, s, i: (c * layout.slots + s) * width + i  # noqa: E731
    assert layout.halo_index(1, 4).tolist() == [[tail(0, 0, 0), tail(0, 0, 1), tail(0, 0, 2)],
                                                [tail(2, 1, 0), tail(2, 1, 1), tail(2, 1, 2)]]
    assert layout.halo_index(0, 4)[0].tolist() == [4 * 2 * 3] * 3  # before the sequence: the zero row
    short = RunLayout(16, 4)  # chunks of 2 tokens: a halo of 3 spans two runs
    assert short.halo_index(1, 4)[0].tolist() == [short.cp * 2 * 3] + [tail(0, 0, 1), tail(0, 0, 2)]
    # rank 0's run at 14 (chunk 7): 11 from chunk 5 (rank 2), 12..13 from chunk 6 (rank 1)
    assert short.halo_index(0, 4)[1].tolist() == [tail(2, 1, 2), tail(1, 1, 1), tail(1, 1, 2)]
    balanced = RunLayout(16, 2, (0, 1, 4, 7, 2, 3, 5, 6))
    assert balanced.runs(0) == ((0, 4), (8, 2), (14, 2)) and balanced.slots == 3


def test_document_masks():
    positions = torch.tensor([0, 1, 2, 3, 12, 13, 14, 15])
    starts, visible = document_masks(((0, 2, 13, 16),), 1, positions, 3)
    assert starts[0].tolist() == [True, False, True, False, False, True, False, False]
    assert visible[0].tolist() == [[True, False, False], [True, True, False], [True, False, False],
                                   [True, True, False], [True, True, True], [True, False, False],
                                   [True, True, False], [True, True, True]]
    none, visible = document_masks(None, 2, positions[4:], 3)
    assert none is None and bool(visible.all())


def test_exchange_formula_does_not_depend_on_the_length():
    sizes = dict(batch=1, key_heads=16, value_heads=48, key_dim=128, value_dim=128, taps=4, hp=8,
                 dtype=torch.bfloat16)
    short, long = (exchange_bytes(RunLayout(s, 8), **sizes) for s in (2 ** 16, 2 ** 20))
    assert short == long and short["state"] == 2 * 6 * 128 * 256 * 4 * 7  # slots, heads, Dk x (Dv+Dk), fp32, peers
    assert exchange_bytes(RunLayout(1024, 1), **sizes) == {}


@pytest.mark.parametrize("change, message", [
    (lambda t: {**t, "v": t["v"][:, :, :3]}, "value heads must be a multiple"),
    (lambda t: {**t, "g": t["g"][..., :2]}, "g must be"),
    (lambda t: {**t, "beta": t["beta"][..., None]}, "beta must be"),
    (lambda t: {**t, "conv_weight": t["conv_weight"][:5]}, "conv_weight must be"),
    (lambda t: {**t, "k": t["k"].float()}, "of one dtype"),
])
def test_bad_inputs_name_the_problem(change, message):
    q, k, v, g, beta, weight = delta_rule_inputs(False, 16)
    args = change(dict(q=q, k=k, v=v, g=g, beta=beta, conv_weight=weight))
    with pytest.raises(ValueError, match=message):
        loongtrain.linear_attention(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("g"), args.pop("beta"),
                                    None, **args)


def test_per_channel_gate_needs_equal_head_counts():
    q, k, v, g, beta, weight = delta_rule_inputs(False, 16)
    with pytest.raises(ValueError, match="gate per channel"):
        loongtrain.linear_attention(q, k, v, g[..., None].expand(-1, -1, -1, 3), beta, None, conv_weight=weight)


@pytest.mark.parametrize("per_channel", [False, True])
def test_world_one_equals_transformers(per_channel):
    inputs = delta_rule_inputs(per_channel, 24)
    docs = [torch.tensor([0, 5, 13, 24]), torch.tensor([0, 24])]
    for cu in (None, docs):
        out = loongtrain.linear_attention(*inputs[:5], None, conv_weight=inputs[5], cu_seqlens=cu)
        torch.testing.assert_close(out, hf_delta_rule(*inputs, cu), rtol=0, atol=1e-12)


def test_qwen3_5_and_the_kda_and_qwen3_next_layers_at_world_one():
    assert len(check_qwen3_5(0, 1, [dict(hp=1, cp=1)], 1e-10)) == 2
    assert len(check_linear_layer(0, 1, "kda", [dict(hp=1, cp=1)], 1e-10)) == 2
    assert len(check_linear_layer(0, 1, "qwen3_next", [dict(hp=1, cp=1)], 1e-10)) == 2


# ------------------------------------------------------------------ the fla kernels, emulated


@pytest.mark.parametrize("per_channel", [False, True])
def test_fla_wrapper_equals_the_torch_kernel(per_channel):
    # fp64 emulation: the wrapper's pieces, initial states and final states exactly
    q, k, v, g, beta, state = _problem(per_channel, n=3, t=20)
    starts = torch.zeros(3, 20, dtype=torch.bool)
    starts[0, 9] = starts[1, 0] = starts[2, 4] = starts[2, 5] = True
    emulation = EmulatedFla(allow_fp64=True)
    with emulated_fla(emulation):
        got = kernels.fla_kernel(q, k, v, g, beta, starts, state, 0.5)
    want = kernels.torch_kernel(q, k, v, g, beta, starts, state, 0.5)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert emulation.calls == [("chunk_kda" if per_channel else "chunk_gated_delta_rule", 3 + 1 + 2 + 1)]


def test_fla_is_an_option_only_on_cuda_in_half_precision_when_installed():
    cuda = torch.device("cuda")
    assert kernels.kernel_options(cuda, torch.bfloat16, False) == ["torch"]  # not installed here
    with emulated_fla(EmulatedFla()):
        assert kernels.kernel_options(cuda, torch.bfloat16, False) == ["fla", "torch"]
        assert kernels.kernel_options(cuda, torch.bfloat16, True) == ["fla", "torch"]
        assert kernels.kernel_options(cuda, torch.float32, False) == ["torch"]
        assert kernels.kernel_options(torch.device("cpu"), torch.bfloat16, False) == ["torch"]


@pytest.mark.parametrize("fault", [None, *FAULTS])
def test_fla_is_checked_before_use(monkeypatch, fault):
    kernels.clear_linear_choices()
    monkeypatch.setattr(kernels, "kernel_options", lambda device, dtype, per_channel: ["fla", "torch"])
    try:
        with emulated_fla(EmulatedFla(fault=fault)) as emulation:
            choice = kernels.choose_kernel(torch.device("cpu"), torch.bfloat16, False)
            assert emulation.calls  # the check ran it
            assert choice == ("fla" if fault is None else "torch"), kernels._REFUSED
            assert (fault is None) == (not kernels._REFUSED)
            # the sharded layer runs on what was chosen (bf16 within bf16's precision of the torch kernel)
            inputs = [t.to(torch.bfloat16) if t.dtype == torch.float64 and i < 3 else t.float()
                      for i, t in enumerate(delta_rule_inputs(False, 32))]
            before = len(emulation.calls)
            out = loongtrain.linear_attention(*inputs[:5], None, conv_weight=inputs[5].to(torch.bfloat16))
            assert (len(emulation.calls) > before) == (fault is None)
            assert out.dtype == torch.bfloat16 and bool(out.isfinite().all())
    finally:
        kernels.clear_linear_choices()


# ------------------------------------------------------------------ the shape the planner sees


def test_qwen3_5_27b_shape_counts_transformers_parameters():
    import transformers

    from loongtrain.hf.convert import shape_config_from_hf
    from loongtrain.hf.load import read_hf_config
    from loongtrain.model.config import flops_per_token, linear_flops_per_token, num_params

    directory = Path(__file__).resolve().parents[2] / "benchmarks/inputs/qwen3.5-27b"
    config = shape_config_from_hf(read_hf_config(directory))
    assert len(config.linear_layers) == 48 and config.layer_windows() == {None: 16} and config.attention_output_gate
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(directory))
    norms = 16 * 2 * config.head_dim  # the full layers' q/k norms, left out of the shape
    assert num_params(config) + norms == sum(p.numel() for p in model.parameters())
    # the linear layers' FLOPs do not grow with the length; the 16 softmax layers' do
    assert flops_per_token(config, 2 ** 20) - flops_per_token(config, 2 ** 10) == pytest.approx(
        12 * 16 * config.num_heads * config.head_dim * (2 ** 19 - 2 ** 9))
    assert linear_flops_per_token(config) > 0


def test_the_native_decoder_refuses_a_hybrid_shape():
    from loongtrain.model.config import ModelConfig
    from loongtrain.model.llama import Transformer

    shape = dict(vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=48,
                 layer_types=("linear_attention", "full_attention"))
    with pytest.raises(ValueError, match="linear_num_key_heads=0 must be a positive integer"):
        ModelConfig(**shape)
    config = ModelConfig(**shape, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                         linear_value_head_dim=8, linear_conv_kernel_dim=4)
    with pytest.raises(ValueError, match="train its Hugging Face model"):
        Transformer(config)


def _kept_per_token(dtype: torch.dtype, monkeypatch) -> float:
    """Bytes per token autograd keeps for a bound Qwen3.5 linear layer outside its kernel (two lengths' difference;
    storages counted once, the kernel's own saves and the parameters left out)."""
    from loongtrain.hf.linear import bind_linear_attention
    from tests.helpers.linear_models import tiny_qwen3_5

    layer = tiny_qwen3_5().to(dtype).model.layers[0].linear_attn
    bind_linear_attention(layer, loongtrain.single_process_mesh())
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}

    def kept(seq: int) -> int:
        seen: dict[int, int] = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        x = torch.randn(1, seq, 32, dtype=dtype, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            layer(x)
        return sum(n for ptr, n in seen.items() if ptr not in params)

    original = kernels.torch_kernel  # the kernel's own saves: not counted (fla's are kernel_bytes)
    monkeypatch.setattr(kernels, "torch_kernel", lambda *args: _no_saves(original, *args))
    return (kept(128) - kept(64)) / 64


def _no_saves(fn, *args):
    """``fn(*args)`` under hooks of its own (the innermost hooks see the saves: the counting ones do not)."""
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        return fn(*args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wrapper_memory_is_what_autograd_keeps(dtype, monkeypatch):
    from loongtrain.attn.linear.memory import wrapper_bytes
    from loongtrain.hf.convert import shape_config_from_hf
    from tests.helpers.linear_models import tiny_qwen3_5

    config = shape_config_from_hf(tiny_qwen3_5().config)
    assert _kept_per_token(dtype, monkeypatch) == wrapper_bytes(config, 1, torch.finfo(dtype).bits // 8)


def _qwen3_5_27b():
    from loongtrain.hf.convert import shape_config_from_hf
    from loongtrain.hf.load import read_hf_config

    return shape_config_from_hf(read_hf_config(Path(__file__).resolve().parents[2] / "benchmarks/inputs/qwen3.5-27b"))


def test_the_planner_counts_the_linear_layers_time():
    from loongtrain.parallel.layout import Layout
    from loongtrain.plan.cluster import load_cluster
    from loongtrain.plan.linear_cost import linear_time

    model, h200 = _qwen3_5_27b(), load_cluster("h200")
    times = {seq: linear_time(model, Layout(world_size=8, hp=2, cp=4), h200, batch=1, seq_len=seq, dtype_bytes=2)
             for seq in (1 << 16, 1 << 20)}
    short, long = times[1 << 16], times[1 << 20]
    assert long.exchange_fwd == short.exchange_fwd > 0  # the pairs and halos: no growth with the length
    assert long.compute_fwd == pytest.approx(16 * short.compute_fwd) and long.a2a_fwd > 8 * short.a2a_fwd
    single = linear_time(model, Layout(world_size=8, hp=8, cp=1), h200, batch=1, seq_len=1 << 16, dtype_bytes=2)
    assert single.exchange_fwd == 0 and single.compute_fwd < short.compute_fwd  # no transition columns at cp = 1


def test_the_memory_term_replaces_the_linear_layers_attention():
    from loongtrain.attn.linear.memory import layer_bytes, softmax_bytes
    from loongtrain.parallel.config import ParallelConfig
    from loongtrain.plan.memory_model import memory_per_rank

    model = _qwen3_5_27b()
    dense = replace(model, layer_types=None)  # the same shape with every layer softmax attention
    config = ParallelConfig(hp=2, cp=4, zero="full", recompute="none")
    seq, tokens = 1 << 16, (1 << 16) / 8
    got, base = (memory_per_rank(m, config.layout(8), config, seq_len=seq, batch=1, dtype_bytes=2, zero_size=8)
                 for m in (model, dense))
    per_token = layer_bytes(model, tokens=tokens, batch=1, hp=2, cp=4, b=2) - softmax_bytes(model, 2, 2, False)
    extra_params = (got["states"] - base["states"])  # the linear layers' parameters differ from attention's
    assert got["activations"] - base["activations"] == pytest.approx(48 * tokens * per_token, rel=1e-9)
    assert extra_params != 0


def test_plan_keeps_hp_within_the_linear_heads():
    from loongtrain.plan.search import head_ok

    model = _qwen3_5_27b()
    assert head_ok(model, 8) and head_ok(model, 4) and not head_ok(model, 16)  # 24 attention heads
    assert not head_ok(replace(model, linear_num_value_heads=36, linear_num_key_heads=12), 8)  # 36 % 8


def test_a_hybrid_is_planned_not_simulated():
    from loongtrain.model.config import with_depth

    with pytest.raises(ValueError, match="a hybrid is planned, not simulated"):
        with_depth(_qwen3_5_27b(), 3)
