"""The plain model, and the plain model + ``apply_2d_attention`` on a 2D mesh, give the same loss and
summed gradients; ``apply_2d_attention`` on any module tree; the model imports nothing parallel."""

from __future__ import annotations

import ast
import copy
import pickle
from pathlib import Path

import pytest
import torch
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
from tests.helpers.model_batches import BATCH, SEQ, SMALL, _batch


def test_single_process_mesh_matches_plain_model():
    config = ModelConfig(**SMALL)
    inputs, labels, positions = _batch(0, config.vocab_size)
    plain = Transformer(config, seed=3).double()
    applied = loongtrain.apply_2d_attention(Transformer(config, seed=3).double(), loongtrain.single_process_mesh())
    for model in (plain, applied):
        sharded_cross_entropy(model(inputs, positions), labels, None)[0].backward()
    torch.testing.assert_close(applied(inputs, positions), plain(inputs, positions), rtol=0, atol=1e-12)
    for (name, a), b in zip(applied.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-12, msg=name)
    # position_ids default to arange
    torch.testing.assert_close(plain(inputs), plain(inputs, torch.arange(SEQ).expand(BATCH, SEQ)), rtol=0, atol=0)


def _naive_attention(q, k, v, causal, scale):
    """Softmax attention written out, query head h on KV head h // (H / Hkv)."""
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        seq = q.shape[1]
        scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


def test_a_chunk_order_reaching_the_unsharded_model_is_an_error():
    from loongtrain.model.llama import Transformer

    model = Transformer(ModelConfig(vocab_size=32, dim=16, num_layers=1, num_heads=2, num_kv_heads=2,
                                    ffn_dim=32), seed=0)
    with pytest.raises(ValueError, match="chunk_order=\\(0, 2, 1, 3\\) describes sharded tokens"):
        model(torch.zeros(1, 8, dtype=torch.long), chunk_order=(0, 2, 1, 3))


@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("causal", [True, False])
def test_local_attention_is_exact(num_heads, num_kv_heads, causal):
    gen = torch.Generator().manual_seed(num_heads * 10 + num_kv_heads)
    q = torch.randn(2, 12, num_heads, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    k, v = (torch.randn(2, 12, num_kv_heads, 8, dtype=torch.float64, generator=gen, requires_grad=True)
            for _ in range(2))
    for scale in (None, 0.3):
        out = local_attention(q, k, v, causal=causal, softmax_scale=scale)
        ref = _naive_attention(q, k, v, causal, 8**-0.5 if scale is None else scale)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
        for g, r in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(g, r, rtol=0, atol=1e-12)


class _ToyAttention(nn.Module):
    """A foreign module tree following the protocol: its core is a replaceable ``attention_fn``."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.attention_fn = local_attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.proj(x).view(*x.shape[:2], 2, 4)
        return self.attention_fn(qkv, qkv[:, :, :1], qkv[:, :, 1:], causal=True).flatten(2)


def test_apply_2d_attention_replaces_every_attention_fn():
    mesh, other = loongtrain.single_process_mesh(), loongtrain.single_process_mesh()
    model = Transformer(ModelConfig(**SMALL), seed=0)
    assert all(layer.attention.attention_fn is local_attention for layer in model.layers)
    assert loongtrain.apply_2d_attention(model, mesh) is model
    fns = [m.attention_fn for m in model.modules() if hasattr(m, "attention_fn")]
    assert len(fns) == SMALL["num_layers"] and len({id(f) for f in fns}) == len(fns)
    assert all(isinstance(f, MeshAttention) and f.mesh is mesh for f in fns)
    loongtrain.apply_2d_attention(model, other)  # idempotent: re-applying rebinds
    assert all(layer.attention.attention_fn.mesh is other for layer in model.layers)
    # picklable (with a picklable mesh); a deep copy shares the mesh and its process groups
    assert pickle.loads(pickle.dumps(model.layers[0].attention.attention_fn)).mesh.layout == other.layout
    assert copy.deepcopy(model).layers[1].attention.attention_fn.mesh is other

    toy = nn.Sequential(_ToyAttention(), nn.ModuleList([_ToyAttention()]))
    x = torch.randn(1, 4, 8, dtype=torch.float64)
    toy.double()
    before = toy[0](x)
    with count_ring_forward() as calls:
        after = loongtrain.apply_2d_attention(toy, mesh)[0](x)
    assert calls["ring_forward"] == 1 and isinstance(toy[1][0].attention_fn, MeshAttention)
    torch.testing.assert_close(after, before, rtol=0, atol=1e-12)


def test_apply_2d_attention_rejects_models_without_attention_fn_and_bad_meshes():
    with pytest.raises(ValueError, match="Sequential has no module with an 'attention_fn'"):
        loongtrain.apply_2d_attention(nn.Sequential(nn.Linear(2, 2)), loongtrain.single_process_mesh())
    with pytest.raises(ValueError, match="mesh must be a loongtrain Mesh"):
        loongtrain.apply_2d_attention(Transformer(ModelConfig(**SMALL)), None)


def test_selective_checkpoint_finds_the_custom_ops_after_apply():
    """selective recompute keeps the outputs of torch.ops.loongtrain.* reached through attention_fn:
    the backward recomputes no attention; full checkpointing recomputes it once per layer."""
    from loongtrain.parallelize.recompute import apply_recompute

    config = ModelConfig(**SMALL)
    inputs, labels, positions = _batch(0, config.vocab_size)
    with count_ring_forward() as calls:
        for mode, recomputed in (("selective", 0), ("full", config.num_layers)):
            model = loongtrain.apply_2d_attention(Transformer(config, seed=0).double(),
                                                  loongtrain.single_process_mesh())
            apply_recompute(model.layers, mode)
            calls.clear()
            loss, _ = sharded_cross_entropy(model(inputs, positions), labels, None)
            loss.backward()
            assert calls["ring_forward"] == config.num_layers + recomputed, mode


def test_model_package_imports_nothing_parallel():
    """loongtrain.model knows no meshes, process groups or 2D-Attention: it imports only itself,
    torch and the standard library."""
    package = Path(loongtrain.__file__).parent / "model"
    files = sorted(package.glob("*.py"))
    assert len(files) >= 3
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                if name.startswith("loongtrain"):
                    assert name.startswith("loongtrain.model."), f"{path.name} imports {name}"
                assert not name.startswith("torch.distributed"), f"{path.name} imports {name}"


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
    all_ignored, _ = sharded_cross_entropy(logits, torch.full_like(labels, IGNORE_INDEX), None)
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
    from loongtrain.sections.data import DataSection

    torch.manual_seed(0)
    model = Transformer(get_preset("tiny"), seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    batches = build_batches(DataSection(corpus="stdlib", seq_len=64, batch_size=4), "byte", shuffle=False)
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
