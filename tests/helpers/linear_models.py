"""Tiny Hugging Face linear-attention hybrids (Qwen3.5, Qwen3-Next, Kimi-Linear) and transformers' own code made
dtype-preserving for fp64 comparisons (docs/linear-attention.md#tests).

transformers computes the delta-rule layers, their gates and its norms in fp32 whatever the input (``.float()``,
``.to(torch.float32)``). :func:`dtype_preserving` takes the source of one of its functions or methods, turns
those casts into fp64 and compiles it in the function's own module namespace: transformers' algorithm, only the
casts changed. :func:`fp64_reference` applies it to a model's norms (both the reference and the sharded copy use
them) and its linear-attention blocks and their torch fallbacks (the reference only: loongtrain replaces those).
"""

from __future__ import annotations

import inspect
import re
import textwrap
import types
from typing import Any

import torch
from torch import nn

Tensor = torch.Tensor

_CASTS = ((".float()", ".double()"), ("torch.float32", "torch.float64"), ("dtype=torch.float)", "dtype=torch.float64)"))
_FALLBACKS = ("torch_chunk_gated_delta_rule", "chunk_kimi_delta_attention", "causal_conv1d_fn", "l2norm")


def dtype_preserving(fn: Any, **replace: Any) -> Any:
    """``fn`` (a function, or a method's function) recompiled from its source with its fp32 casts made fp64, its
    decorators dropped, in a copy of its module's globals updated with ``replace`` (names -> objects)."""
    if isinstance(fn, nn.Module):  # a function the ``kernels`` package wraps in a module: the function it calls
        fn = inspect.getclosurevars(type(fn).forward).nonlocals["func"]
    fn = inspect.unwrap(fn)
    source = textwrap.dedent(inspect.getsource(fn))
    source = re.sub(r"^(@.*\n)+", "", source)  # decorators
    for old, new in _CASTS:
        source = source.replace(old, new)
    namespace = {**fn.__globals__, **replace}
    exec(compile(source, f"<fp64 {fn.__qualname__}>", "exec"), namespace)  # noqa: S102 - transformers' own code
    return namespace[fn.__name__]


def fp64_norms(model: nn.Module) -> nn.Module:
    """Every norm of ``model`` (RMSNorm, gated RMSNorm) computed in its input's dtype (fp64)."""
    for module in model.modules():
        if type(module).__name__.endswith(("RMSNorm", "RMSNormGated")):
            forward = dtype_preserving(type(module).forward)
            module.forward = types.MethodType(forward, module)
    return model


def fp64_reference(model: nn.Module) -> nn.Module:
    """:func:`fp64_norms`, and every linear-attention block's forward (with the torch fallbacks it calls) and
    gate in fp64: transformers' own unsharded computation, dtype-preserving."""
    fp64_norms(model)
    for module in model.modules():
        name = type(module).__name__
        if name.endswith(("GatedDeltaNet", "DeltaAttention")):
            scope = inspect.unwrap(type(module).forward).__globals__
            fallbacks = {f: dtype_preserving(scope[f]) for f in _FALLBACKS if f in scope}
            forward = dtype_preserving(type(module).forward, **fallbacks)
            module.forward = types.MethodType(forward, module)
        elif name.endswith("ForgetGate"):
            module.forward = types.MethodType(dtype_preserving(type(module).forward), module)
    return model


def perturb(model: nn.Module, seed: int) -> nn.Module:
    """1-D parameters moved off HF's ones/zeros initialisation so that they matter."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(0.1 * torch.randn(param.shape, generator=gen, dtype=param.dtype))
    return model


QWEN3_5 = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
               linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
               layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
               max_position_embeddings=256, tie_word_embeddings=False)


def tiny_qwen3_5(seed: int = 3, **overrides: Any) -> nn.Module:
    """A tiny random ``Qwen3_5ForCausalLM`` in fp64: linear and full layers alternating, 2 key heads and 4 value
    heads in the linear layers, GQA in the full ones (sdpa attention: HF's eager softmax runs in fp32)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(**{**QWEN3_5, **overrides}, attn_implementation="sdpa", use_cache=False)
    config.architectures = ["Qwen3_5ForCausalLM"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3_5ForCausalLM(config)
    return perturb(model, seed).double()


def check_qwen3_5(rank: int, world_size: int, configs: list[dict], tol: float) -> list[list[float]]:
    """A tiny Qwen3.5 through ``apply_2d_attention`` == transformers' own unsharded model (dtype-preserving),
    logits and every gradient, with and without packed documents, on each mesh of ``configs``."""
    import loongtrain
    from tests.helpers.gpt_oss import compare_sharded, hf_reference_forward, hf_sharded_forward

    results = []
    for cfg in configs:
        mesh = loongtrain.init_mesh(**cfg)
        for with_documents in (False, True):
            model = fp64_reference(tiny_qwen3_5())
            results.append(compare_sharded(model, hf_reference_forward, mesh, 32, with_documents, tol,
                                           sharded_forward=hf_sharded_forward))
    return results


KIMI = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=4, linear_num_heads=4,
            linear_head_dim=8, linear_conv_kernel_dim=4, num_hidden_layers=1, layer_types=["linear_attention"],
            pad_token_id=None, bos_token_id=None, eos_token_id=None)


def kimi_delta_attention(seed: int = 3) -> nn.Module:
    """transformers' ``KimiLinearDeltaAttention`` (KDA) alone, tiny, fp64, its gate initialised as Kimi-Linear's
    (A_log = log U(1, 16), dt_bias the inverse softplus of U(1e-3, 1e-1))."""
    from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

    config = KimiLinearConfig(**KIMI)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = KimiLinearDeltaAttention(config, layer_idx=0)
        gate = module.forget_gate
        with torch.no_grad():
            gate.A_log.copy_(torch.empty(gate.A_log.shape).uniform_(1.0, 16.0).log())
            dt = torch.empty(gate.dt_bias.shape).uniform_(1e-3, 1e-1)
            gate.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
    return perturb(module, seed).double()


QWEN3_NEXT = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                  linear_conv_kernel_dim=4, num_hidden_layers=1, layer_types=["linear_attention"])


def qwen3_next_delta_net(seed: int = 3) -> nn.Module:
    """transformers' ``Qwen3NextGatedDeltaNet`` alone (its fused, head-interleaved projections), tiny, fp64."""
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = Qwen3NextGatedDeltaNet(Qwen3NextConfig(**QWEN3_NEXT), layer_idx=0)
    return perturb(module, seed).double()


LAYERS = {"kda": kimi_delta_attention, "qwen3_next": qwen3_next_delta_net}


def check_linear_layer(rank: int, world_size: int, kind: str, configs: list[dict], tol: float) -> list[list[float]]:
    """A linear-attention block of transformers (``kind`` of :data:`LAYERS`) bound to loongtrain's core ==
    transformers' own block (dtype-preserving), each document alone: outputs, input gradients and every
    parameter's gradient."""
    import copy

    import torch.distributed as dist

    import loongtrain
    from loongtrain.hf.linear import bind_linear_attention
    from tests.helpers.gpt_oss import documents

    results = []
    for cfg in configs:
        mesh = loongtrain.init_mesh(**cfg)
        for with_documents in (False, True):
            reference = fp64_reference(LAYERS[kind]())
            sharded = copy.deepcopy(reference)
            assert bind_linear_attention(sharded, mesh) == 1
            gen = torch.Generator().manual_seed(7)
            seq = 32
            hidden = torch.randn(2, seq, 32, generator=gen, dtype=torch.float64, requires_grad=True)
            docs = documents(seq) if with_documents else None
            bounds = [d.tolist() for d in docs] if docs else [[0, seq]] * 2
            want = torch.cat([torch.cat([reference(hidden[b:b + 1, s:e]) for s, e in zip(row[:-1], row[1:])], 1)
                              for b, row in enumerate(bounds)])
            weight = torch.randn(want.shape, generator=gen, dtype=torch.float64)
            params = list(reference.parameters())
            want_grads = torch.autograd.grad((want * weight).sum(), [hidden, *params])
            local = loongtrain.shard_sequence(hidden.detach(), mesh, 1).requires_grad_()
            got = sharded(local, cu_seqlens=docs)
            got_grads = torch.autograd.grad((got * loongtrain.shard_sequence(weight, mesh, 1)).sum(),
                                            [local, *sharded.parameters()])
            errors = [(got - loongtrain.shard_sequence(want, mesh, 1)).abs().max().item(),
                      (got_grads[0] - loongtrain.shard_sequence(want_grads[0], mesh, 1)).abs().max().item()]
            for mine, theirs in zip(got_grads[1:], want_grads[1:]):
                mine = mine.clone()
                if mesh.sp_group is not None:
                    dist.all_reduce(mine, group=mesh.sp_group)
                errors.append((mine - theirs).abs().max().item())
                assert theirs.abs().max() > 0
            assert max(errors) < tol, errors
            results.append(errors)
    return results


def hf_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, conv_weight: Tensor,
                  docs: list[Tensor] | None) -> Tensor:
    """transformers' own unsharded delta rule (dtype-preserving): its causal convolution + SiLU over ``cat(q, k,
    v)``, then its token-by-token recurrence with q/k L2-normalised (Qwen3.5's for a gate per head, Kimi-Linear's
    for a gate per channel), each document of each row alone. Shapes as :func:`loongtrain.linear_attention`."""
    from transformers.models.kimi_linear import modeling_kimi_linear as kimi
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    conv = dtype_preserving(qwen.causal_conv1d_fn)
    per_channel = g.dim() == 4
    recurrence = (dtype_preserving(kimi.recurrent_kimi_delta_attention, l2norm=kimi.l2norm) if per_channel
                  else dtype_preserving(qwen.torch_recurrent_gated_delta_rule, l2norm=qwen.l2norm))
    batch, seq, key_heads, key_dim = q.shape
    value_heads, value_dim = v.shape[2:]
    rows = []
    for b in range(batch):
        bounds = docs[b].tolist() if docs is not None else [0, seq]
        pieces = []
        for s, e in zip(bounds[:-1], bounds[1:]):
            mixed = torch.cat([x[b:b + 1, s:e].flatten(2) for x in (q, k, v)], dim=-1).transpose(1, 2)
            mixed = conv(mixed, conv_weight, None, activation="silu").transpose(1, 2)
            q_, k_, v_ = mixed.split([key_heads * key_dim, key_heads * key_dim, value_heads * value_dim], dim=-1)
            out, _ = recurrence(q_.unflatten(-1, (key_heads, key_dim)), k_.unflatten(-1, (key_heads, key_dim)),
                                v_.unflatten(-1, (value_heads, value_dim)), g=g[b:b + 1, s:e], beta=beta[b:b + 1, s:e],
                                initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True)
            pieces.append(out)
        rows.append(torch.cat(pieces, dim=1))
    return torch.cat(rows)


def delta_rule_inputs(per_channel: bool, seq: int, key_heads: int = 2, value_heads: int = 4, seed: int = 0
                      ) -> list[Tensor]:
    """Random fp64 ``q, k, v, g, beta, conv_weight`` of a delta-rule layer (batch 2, head dims 3 and 5, kernel
    4; a gate per channel needs as many key heads as value heads)."""
    gen = torch.Generator().manual_seed(seed)
    key_heads = value_heads if per_channel else key_heads
    key_dim, value_dim, taps = 3, 5, 4

    def rand(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    g = -torch.rand(2, seq, value_heads, *((key_dim,) if per_channel else ()), generator=gen, dtype=torch.float64)
    beta = torch.rand(2, seq, value_heads, generator=gen, dtype=torch.float64)
    weight = 0.5 * rand(2 * key_heads * key_dim + value_heads * value_dim, taps)
    return [rand(2, seq, key_heads, key_dim), rand(2, seq, key_heads, key_dim), rand(2, seq, value_heads, value_dim),
            g, beta, weight]


def write_qwen3_5_dir(path: Any, seed: int = 3, **overrides: Any) -> Any:
    """A tiny ``Qwen3_5ForCausalLM`` directory (config.json + model.safetensors via ``save_pretrained``) for the
    byte tokenizer (vocab 256)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    config = Qwen3_5TextConfig(**{**QWEN3_5, "vocab_size": 256, **overrides})
    config.architectures = ["Qwen3_5ForCausalLM"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = perturb(Qwen3_5ForCausalLM(config), seed)
    model.save_pretrained(path)
    return path
