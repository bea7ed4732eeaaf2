"""The model on a 2D mesh equals the model in one process (loss and summed gradients), plus config checks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import loongtrain
from loongtrain.model import (
    PRESETS,
    ModelConfig,
    Transformer,
    apply_rope,
    flops_per_token,
    get_preset,
    num_params,
    rope_cos_sin,
    sharded_cross_entropy,
)
from tests.dist_utils import run_distributed

SMALL = dict(vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=48)
SEQ, BATCH = 32, 2


def _batch(seed: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random tokens, shifted labels with some ignored, and positions offset by an arbitrary amount."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (BATCH, SEQ + 1), generator=gen)
    inputs, labels = tokens[:, :-1], tokens[:, 1:].clone()
    labels[0, 3:7] = -100
    labels[1, -5:] = -100
    positions = torch.arange(SEQ).expand(BATCH, SEQ) + 100
    return inputs, labels, positions


def _reference(config: ModelConfig, data_seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = Transformer(config, None, seed=7).double()
    inputs, labels, positions = _batch(data_seed, config.vocab_size)
    logits = model(inputs, positions)
    loss, value = sharded_cross_entropy(logits, labels, None)
    assert torch.equal(loss.detach(), value)
    loss.backward()
    return value, {n: p.grad for n, p in model.named_parameters()}


def _check_sharded(rank: int, world_size: int, cases: list[tuple[int, int, list[bool]]]) -> int:
    checked = 0
    for hp, cp, tied in cases:
        mesh = loongtrain.init_mesh(hp=hp, cp=cp)
        for tie in tied:
            config = ModelConfig(**SMALL, tie_embeddings=tie)
            data_seed = 1000 + mesh.dp_rank  # replicas train on different data
            ref_loss, ref_grads = _reference(config, data_seed)
            model = Transformer(config, mesh, seed=7).double()
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


def test_sharded_model_matches_single_process_world4():
    # (hp, cp, tie_embeddings values); (4, 1) replicates KV heads (hp > Hkv); (2, 1) has dp=2 replicas
    cases = [(2, 2, [True, False]), (1, 4, [False]), (4, 1, [True]), (2, 1, [False])]
    counts = run_distributed(_check_sharded, 4, cases)
    assert counts == [5] * 4


def test_single_process_mesh_matches_none():
    config = ModelConfig(**SMALL)
    inputs, labels, positions = _batch(0, config.vocab_size)
    a = Transformer(config, None, seed=3).double()(inputs, positions)
    b = Transformer(config, loongtrain.single_process_mesh(), seed=3).double()(inputs, positions)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_init_is_deterministic_and_seeded():
    config = ModelConfig(**SMALL)
    a, b, c = (Transformer(config, seed=s) for s in (5, 5, 6))
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        if "norm" in name:
            assert torch.equal(pa, torch.ones_like(pa))
        else:
            assert not torch.equal(pa, pc), name
            assert abs(pa.std().item() - 0.02) < 0.01, name


def test_rope_non_contiguous_positions_match_contiguous():
    """RoPE applied to a permuted subset of positions equals the permuted RoPE of the full sequence."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 24, 3, 8, dtype=torch.float64, generator=gen)
    full_pos = torch.arange(24).expand(2, 24)
    cos, sin = rope_cos_sin(full_pos, 8, 10000.0, torch.float64)
    full = apply_rope(x, cos, sin)
    idx = torch.tensor([5, 0, 23, 11, 12, 2])
    cos_s, sin_s = rope_cos_sin(full_pos[:, idx], 8, 10000.0, torch.float64)
    torch.testing.assert_close(apply_rope(x[:, idx], cos_s, sin_s), full[:, idx], rtol=0, atol=1e-12)
    # Against the complex-number definition: pair (i, i + D/2) rotated by pos * theta^(-2i/D).
    inv = 10000.0 ** (-torch.arange(4, dtype=torch.float64) * 2 / 8)
    z = torch.complex(x[..., :4], x[..., 4:]) * torch.polar(torch.ones(24, 4, dtype=torch.float64),
                                                            torch.arange(24)[:, None] * inv)[None, :, None]
    torch.testing.assert_close(full, torch.cat([z.real, z.imag], dim=-1), rtol=0, atol=1e-12)
    # Relative property: q.k after RoPE depends only on the position difference.
    q, k = x[:, :1, :1], x[:, 1:2, :1]

    def dot(pq: int, pk: int) -> torch.Tensor:
        cq, sq = rope_cos_sin(torch.full((2, 1), pq), 8, 10000.0, torch.float64)
        ck, sk = rope_cos_sin(torch.full((2, 1), pk), 8, 10000.0, torch.float64)
        return (apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum()

    torch.testing.assert_close(dot(10, 3), dot(1007, 1000), rtol=0, atol=1e-9)


def test_loss_ignores_labels_and_matches_torch():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 6, 11, dtype=torch.float64, generator=gen)
    labels = torch.randint(0, 11, (2, 6), generator=gen)
    labels[0, :2] = -100
    loss, value = sharded_cross_entropy(logits, labels, None)
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1))
    torch.testing.assert_close(loss, ref, rtol=0, atol=1e-14)
    assert not value.requires_grad
    all_ignored, _ = sharded_cross_entropy(logits, torch.full_like(labels, -100), None)
    assert all_ignored.item() == 0.0
    with pytest.raises(ValueError, match="labels shape"):
        sharded_cross_entropy(logits, labels[:, :3], None)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(num_kv_heads=3), "num_kv_heads=3"),
        (dict(dim=30), "dim=30"),
        (dict(dim=20), "head_dim=5"),
        (dict(num_layers=0), "num_layers=0"),
        (dict(vocab_size=-1), "vocab_size=-1"),
        (dict(ffn_dim=2.5), "ffn_dim=2.5"),
        (dict(rope_theta=0.0), "rope_theta"),
    ],
)
def test_config_validation(overrides, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**{**SMALL, **overrides})
    ModelConfig(**{**SMALL, "dim": 36, "num_heads": 6, "num_kv_heads": 3})  # valid


def test_presets_counts_and_flops():
    assert set(PRESETS) >= {"tiny", "1b", "7b-mha", "7b-gqa", "13b"}
    with pytest.raises(ValueError, match="7b-gqa"):
        get_preset("nope")
    assert get_preset("7b-mha").num_kv_heads == 32 and get_preset("7b-gqa").num_kv_heads == 8
    assert 6.5e9 < num_params(get_preset("7b-mha")) < 6.9e9  # LLaMA-2 7B: 6.74e9
    assert 12.8e9 < num_params(get_preset("13b")) < 13.2e9  # LLaMA-2 13B: 13.0e9
    tiny = get_preset("tiny")
    assert tiny.tie_embeddings and tiny.vocab_size == 256
    assert num_params(tiny) == sum(p.numel() for p in Transformer(tiny).parameters())
    untied = ModelConfig(**SMALL, tie_embeddings=False)
    assert num_params(untied) == sum(p.numel() for p in Transformer(untied).parameters())
    cfg = get_preset("7b-mha")
    # Attention term: 3 * 2 * S * H * D per layer per token; doubles with S.
    delta = flops_per_token(cfg, 8192) - flops_per_token(cfg, 4096)
    assert delta == 3 * 2 * 4096 * 32 * 128 * 32
    L, d, V = cfg.num_layers, cfg.dim, cfg.vocab_size
    matmul = num_params(cfg) - V * d - (2 * L + 1) * d  # minus embedding lookup and norm weights
    assert flops_per_token(cfg, 1) == 6 * matmul + 3 * 2 * 1 * 32 * 128 * L


def test_tiny_preset_learns_stdlib_bytes():
    """End to end in one process: data pipeline + tiny preset + loss; a few Adam steps cut the loss."""
    from loongtrain.data import build_batches

    torch.manual_seed(0)
    model = Transformer(get_preset("tiny"), None, seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    batches = build_batches("stdlib", "byte", seq_len=64, batch_size=4, shuffle=False)
    losses = []
    for _ in range(20):
        batch = next(batches)
        logits = model(batch["input_ids"], batch["position_ids"])
        loss, value = sharded_cross_entropy(logits, batch["labels"], None)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(value.item())
    assert 5.0 < losses[0] < 6.0  # ~ln(256) at init
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5, losses
