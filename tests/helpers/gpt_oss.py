"""gpt-oss-style models (attention sinks, per-layer windows from ``layer_types``): per-rank bodies comparing
``apply_2d_attention(model, mesh)`` with the unsharded model in fp64, logits and every parameter's gradient."""

from __future__ import annotations

import copy
import types
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import loongtrain

Tensor = torch.Tensor


def native_config(window: int = 5) -> Any:
    from loongtrain.model.config import ModelConfig

    return ModelConfig(vocab_size=64, dim=32, num_layers=4, num_heads=4, num_kv_heads=2, ffn_dim=48,
                       sliding_window=window, attention_sinks=True, attention_bias=True,
                       layer_types=("sliding_attention", "full_attention", "sliding_attention", "full_attention"))


def native_model(seed: int = 3) -> nn.Module:
    from loongtrain.model.llama import Transformer

    model = Transformer(native_config(), seed=seed).double()
    with torch.no_grad():  # sinks large enough to matter
        for layer in model.layers:
            layer.attention.sinks.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(seed))
    return model


def documents(seq: int) -> list[Tensor]:
    """Two rows of packed documents of the full sequence (fixed)."""
    return [torch.tensor([0, seq // 3, seq // 2 + 1, seq]), torch.tensor([0, 5, seq])]


def positions(seq: int, docs: list[Tensor] | None) -> Tensor:
    """Per-row position ids: restarting at each document, or ``arange`` without documents."""
    if docs is None:
        return torch.arange(seq).expand(2, seq)
    rows = []
    for cu in docs:
        rows.append(torch.cat([torch.arange(int(e - s)) for s, e in zip(cu[:-1], cu[1:])]))
    return torch.stack(rows)


def compare_sharded(model: nn.Module, forward, mesh, seq: int, with_documents: bool, tol: float,
                    sharded_forward=None) -> list[float]:
    """``forward(model, input_ids, position_ids, cu_seqlens) -> logits``: the unsharded model's logits and
    gradients (of ``<logits, w>``) vs ``apply_2d_attention`` on a copy fed this rank's shards
    (``sharded_forward``, default ``forward``); the sharded gradients are summed over the sequence ranks.
    Returns [logits error, max gradient error]."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, model.config.vocab_size, (2, seq), generator=g)
    docs = documents(seq) if with_documents else None
    pos = positions(seq, docs)
    sharded_model = loongtrain.apply_2d_attention(copy.deepcopy(model), mesh)
    logits = forward(model, ids, pos, docs)
    weight = torch.randn(logits.shape, generator=g, dtype=logits.dtype)
    want = dict(zip((n for n, _ in model.named_parameters()),
                    torch.autograd.grad((logits * weight).sum(), list(model.parameters()))))
    local = (sharded_forward or forward)(sharded_model, loongtrain.shard_sequence(ids, mesh, 1),
                                         loongtrain.shard_sequence(pos, mesh, 1), docs)
    local_weight = loongtrain.shard_sequence(weight, mesh, 1)
    params = [p for p in sharded_model.parameters()]
    grads = torch.autograd.grad((local * local_weight).sum(), params, allow_unused=True)
    errors = [(local - loongtrain.shard_sequence(logits, mesh, 1)).abs().max().item()]
    worst = 0.0
    for (name, _), grad in zip(sharded_model.named_parameters(), grads):
        grad = torch.zeros_like(want[name]) if grad is None else grad.clone()
        if mesh.sp_group is not None:
            dist.all_reduce(grad, group=mesh.sp_group)
        worst = max(worst, (grad - want[name]).abs().max().item())
        assert want[name].abs().max() > 0 or "bias" in name, name  # every weight takes part
    errors.append(worst)
    assert max(errors) < tol, errors
    return errors


def native_forward(model: nn.Module, ids: Tensor, pos: Tensor, docs: list[Tensor] | None) -> Tensor:
    return model(ids, pos, cu_seqlens=docs)


def check_native(rank: int, world_size: int, configs: list[dict], tol: float) -> list[list[float]]:
    """loongtrain's decoder with sinks, attention biases and alternating sliding/full layers: sharded == whole."""
    results = []
    for cfg in configs:
        mesh = loongtrain.init_mesh(**cfg)
        for with_documents in (False, True):
            results.append(compare_sharded(native_model(), native_forward, mesh, 16 * mesh.sp // mesh.hp * mesh.hp,
                                           with_documents, tol))
    return results


def hf_gpt_oss(seed: int = 3, window: int = 5, router_aux_loss_coef: float = 0.001, vocab_size: int = 64) -> nn.Module:
    """A tiny random ``GptOssForCausalLM`` in fp64 with HF's eager attention and eager experts: 4 layers
    alternating sliding/full (HF's default ``layer_types``), GQA, YaRN RoPE, attention biases, sinks ~ N(0, 1)."""
    from transformers import AutoModelForCausalLM, GptOssConfig

    config = GptOssConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=window,
        max_position_embeddings=256, attn_implementation="eager", experts_implementation="eager",
        router_aux_loss_coef=router_aux_loss_coef,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 64, "rope_theta": 150000.0})
    config.architectures = ["GptOssForCausalLM"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).double()
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 1.0)
                for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                    getattr(layer.self_attn, name).bias.normal_(0.0, 0.1)
    return model


def hf_reference_forward(model: nn.Module, ids: Tensor, pos: Tensor, docs: list[Tensor] | None) -> Tensor:
    """HF's own unsharded eager model; packed documents each run alone (what document masking means)."""
    if docs is None:
        return model(input_ids=ids, position_ids=pos).logits
    rows = []
    for b, cu in enumerate(docs):
        rows.append(torch.cat([model(input_ids=ids[b:b + 1, s:e], position_ids=pos[b:b + 1, s:e]).logits
                               for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())], dim=1))
    return torch.cat(rows)


def hf_sharded_forward(model: nn.Module, ids: Tensor, pos: Tensor, docs: list[Tensor] | None) -> Tensor:
    extra = {"cu_seqlens": docs} if docs is not None else {}
    return model(input_ids=ids, position_ids=pos, **extra).logits


def check_hf(rank: int, world_size: int, configs: list[dict], tol: float) -> list[list[float]]:
    """HF's tiny gpt-oss through apply_2d_attention == HF's own unsharded eager model (logits, all gradients)."""
    results = []
    for cfg in configs:
        mesh = loongtrain.init_mesh(**cfg)
        for with_documents in (False, True):
            results.append(compare_sharded(hf_gpt_oss(), hf_reference_forward, mesh, 32, with_documents, tol,
                                           sharded_forward=hf_sharded_forward))
    return results


def _hf_total_loss_reference(model: nn.Module, ids: Tensor, labels: Tensor, docs: list[Tensor] | None):
    """HF's unsharded eager gpt-oss, each document alone (one per row without documents): logits, cross-entropy +
    coef x router loss (HF's formula in fp64: HF sums the router statistics in fp32), and its gradients."""
    import torch.nn.functional as F

    from tests.helpers.moe import reference_aux_loss

    config = model.config
    seq = ids.shape[1]
    outs = []
    for b, cu in enumerate(docs or [torch.tensor([0, seq])] * ids.shape[0]):
        for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
            outs.append((b, model(input_ids=ids[b:b + 1, s:e], position_ids=torch.arange(e - s)[None],
                                  output_router_logits=True)))
    logits = torch.cat([torch.cat([o.logits for r, o in outs if r == b], dim=1) for b in range(ids.shape[0])])
    router = tuple(torch.cat([o.router_logits[i] for _, o in outs]) for i in range(config.num_hidden_layers))
    aux = reference_aux_loss(router, config.num_local_experts, config.num_experts_per_tok)
    total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
    total = total + config.router_aux_loss_coef * aux
    total.backward()
    return logits.detach(), total.detach()


def check_hf_moe(rank: int, world_size: int, configs: list[dict], tol: float) -> int:
    """HF's tiny gpt-oss with its experts run by loongtrain's MoE (``bind_moe``) and the router loss over the whole
    sequence, through apply_2d_attention: logits, total loss (cross-entropy + coef x aux; HF's ``out.loss``
    without documents) and every parameter's gradient (summed over the sequence ranks) equal HF's unsharded eager."""
    from loongtrain.hf.moe import bind_moe
    from loongtrain.loss.router import load_balancing_loss
    from loongtrain.loss.sharded import sharded_cross_entropy

    checked, seq = 0, 32
    ids = torch.randint(0, 64, (2, seq), generator=torch.Generator().manual_seed(9))
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
    for with_documents in (False, True):
        docs = documents(seq) if with_documents else None
        if docs is not None:  # HF's labels do not cross documents: neither do these
            for b, cu in enumerate(docs):
                labels[b, cu[1:] - 1] = -100
        ref = hf_gpt_oss(router_aux_loss_coef=0.5)  # large enough to matter
        ref_logits, ref_total = _hf_total_loss_reference(ref, ids, labels, docs)
        if docs is None:  # HF's own out.loss (its router sums in fp32): the same total
            hf_loss = hf_gpt_oss(router_aux_loss_coef=0.5)(input_ids=ids, labels=ids, output_router_logits=True).loss
            assert abs(hf_loss.item() - ref_total.item()) < 1e-6, (hf_loss.item(), ref_total.item())
        for cfg in configs:
            mesh = loongtrain.init_mesh(**cfg)
            model = hf_gpt_oss(router_aux_loss_coef=0.5)
            stats = bind_moe(model)
            model = loongtrain.apply_2d_attention(model, mesh)
            local = {"cu_seqlens": docs} if docs is not None else {}
            stats.open()
            logits = model(input_ids=loongtrain.shard_sequence(ids, mesh, 1), output_router_logits=False,
                           position_ids=loongtrain.shard_sequence(positions(seq, docs), mesh, 1), **local).logits
            stats.close()
            aux = load_balancing_loss(stats, model.config.num_local_experts, mesh)
            ce, ce_value = sharded_cross_entropy(logits, loongtrain.shard_sequence(labels, mesh, 1), mesh)
            coef = model.config.router_aux_loss_coef
            (ce + coef * aux).backward()
            errors = [(logits - loongtrain.shard_sequence(ref_logits, mesh, 1)).abs().max().item(),
                      abs((ce_value + coef * aux.detach()).item() - ref_total.item())]
            ref_params = dict(ref.named_parameters())
            for name, param in model.named_parameters():
                grad = param.grad.clone()
                dist.all_reduce(grad, group=mesh.sp_group)
                errors.append((grad - ref_params[name].grad).abs().max().item())
            assert max(errors) < tol, (cfg, with_documents, errors)
            checked += 1
    return checked


def hf_untested_family(name: str, seed: int = 3, **extra: Any) -> nn.Module:
    """A tiny random fp64 HF causal LM of a family not in loongtrain's tested list, 1-D weights perturbed from HF's
    ones/zeros; its attention is HF's sdpa (HF's eager softmax runs in fp32 even for fp64 inputs)."""
    import transformers

    cls = getattr(transformers, name)
    config = cls.config_class(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                              pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation="sdpa", **extra)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config).double()
        with torch.no_grad():
            for param in model.parameters():
                if param.dim() == 1:
                    param.add_(0.1 * torch.randn(param.shape, dtype=param.dtype))
    for module in model.modules():  # HF's RMSNorms round through fp32 by design: in fp64 here, to compare at 1e-10
        if type(module).__name__ == "Olmo2RMSNorm":  # weight * x / rms(x)
            module.forward = types.MethodType(_fp64_rms_norm, module)
        elif type(module).__name__ == "Gemma3RMSNorm":  # (1 + weight) * x / rms(x)
            module.forward = types.MethodType(_fp64_gemma_rms_norm, module)
    return model


def _fp64_rms_norm(self: nn.Module, x: Tensor) -> Tensor:
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _fp64_gemma_rms_norm(self: nn.Module, x: Tensor) -> Tensor:
    return (1.0 + self.weight) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def check_untested_family(rank: int, world_size: int, name: str, extra: dict, configs: list[dict], tol: float) -> int:
    """A family accepted by structure (not by name) through apply_2d_attention == HF's own unsharded model."""
    checked = 0
    for cfg in configs:
        mesh = loongtrain.init_mesh(**cfg)
        for with_documents in (False, True):
            compare_sharded(hf_untested_family(name, **extra), hf_reference_forward, mesh, 32, with_documents, tol,
                            sharded_forward=hf_sharded_forward)
            checked += 1
    return checked
