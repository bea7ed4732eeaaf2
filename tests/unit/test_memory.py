"""Single-process checks of the memory options and the per-rank memory report (no spawn: fast)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from loongtrain.commands.train import parse_args
from loongtrain.model.llama import Transformer
from loongtrain.parallel.config import ParallelConfig
from loongtrain.parallel.mesh import single_process_mesh
from loongtrain.parallelize.compose import parallelize
from loongtrain.parallelize.recompute import apply_recompute, recomputed_layers
from loongtrain.train.memory_report import (
    SavedActivations,
    format_memory_table,
    memory_report,
    metrics_fields,
    optimizer_state_bytes,
)
from tests.helpers.counting import count_ring_forward
from tests.helpers.fixtures import tiny_model

CONFIG = tiny_model(num_layers=4)
SEQ = 32


def _model(**opts: Any) -> torch.nn.Module:
    model = Transformer(CONFIG, seed=0).to(torch.float64)
    return parallelize(model, single_process_mesh(), ParallelConfig(**opts), torch.device("cpu"))


def _loss_fn(model: torch.nn.Module) -> Any:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, CONFIG.vocab_size, (2, SEQ + 1), generator=gen)

    def loss_fn() -> torch.Tensor:
        logits = model(tokens[:, :-1])
        flat = logits.reshape(-1, CONFIG.vocab_size)
        return torch.nn.functional.cross_entropy(flat, tokens[:, 1:].reshape(-1))

    return loss_fn


@pytest.mark.parametrize(
    ("opts", "words"),
    [
        ({"zero": "zero3"}, ["'zero3'", "none", "full", "hybrid"]),
        ({"recompute": "partial"}, ["'partial'", "none", "full", "selective"]),
        ({"recompute_fraction": 1.5}, ["1.5", "[0, 1]"]),
        ({"zero_shard_size": -1, "zero": "hybrid"}, ["-1", ">= 0"]),
        ({"zero_shard_size": 2, "zero": "full"}, ["zero_shard_size=2", "hybrid"]),
        ({"reshard_after_forward": "yes"}, ["'yes'"]),
    ],
)
def test_bad_options_raise_value_error_naming_value_and_choices(opts: dict, words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        ParallelConfig(**opts)
    for word in words:
        assert word in str(info.value)


def test_shard_size_must_divide_world() -> None:
    assert ParallelConfig(zero="full").shard_size(8) == 8
    assert ParallelConfig(zero="hybrid", zero_shard_size=0).shard_size(8) == 8
    assert ParallelConfig(zero="hybrid", zero_shard_size=4).shard_size(8) == 4
    assert ParallelConfig().shard_size(8) == 1
    with pytest.raises(ValueError, match=r"zero_shard_size=3 .* \[2, 4, 8\]"):
        ParallelConfig(zero="hybrid", zero_shard_size=3).shard_size(8)


def test_memory_options_from_the_command_line_and_aliases() -> None:
    assert parse_args([]).parallel == ParallelConfig(hp=2, cp=2)
    cfg = parse_args(["--zero", "full", "--recompute", "selective", "--recompute-fraction", "0.5"])
    assert cfg.parallel == ParallelConfig(hp=2, cp=2, zero="full", recompute="selective", recompute_fraction=0.5)
    with pytest.raises(ValueError, match="parallel must be a ParallelConfig"):
        parallelize(torch.nn.Linear(2, 2), single_process_mesh(), cfg, torch.device("cpu"))  # type: ignore[arg-type]
    assert recomputed_layers(4, 0.5) == [0, 1]
    assert recomputed_layers(4, 0.0) == []
    assert recomputed_layers(3, 1.0) == [0, 1, 2]


def test_checkpoint_modes_keep_names_and_gradients() -> None:
    plain = _model()
    names = [n for n, _ in plain.named_parameters()]
    loss = _loss_fn(plain)()
    loss.backward()
    for mode, fraction in (("full", 1.0), ("selective", 1.0), ("selective", 0.5)):
        model = _model(recompute=mode, recompute_fraction=fraction)
        assert [n for n, _ in model.named_parameters()] == names
        other = _loss_fn(model)()
        other.backward()
        assert torch.equal(other, loss)
        for (n, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12, msg=f"{mode} {fraction} {n}")


def test_selective_runs_attention_once_single_process() -> None:
    with count_ring_forward() as calls:
        for mode, recomputed in (("none", 0), ("selective", 0), ("full", CONFIG.num_layers)):
            calls.clear()
            loss = _loss_fn(_model(recompute=mode))()
            assert calls["ring_forward"] == CONFIG.num_layers, mode
            loss.backward()
            assert calls["ring_forward"] == CONFIG.num_layers + recomputed, mode


def test_memory_report_counts_params_grads_optimizer_and_activations() -> None:
    n_params = sum(p.numel() for p in _model().parameters())
    reports = {}
    for mode in ("none", "selective", "full"):
        model = _model(recompute=mode)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
        report = memory_report(model, optimizer, _loss_fn(model))
        assert report["params"] == report["grads"] == 8 * n_params
        assert report["optimizer_state"] == 2 * 8 * n_params and report["optimizer_state_estimated"] == 1
        assert all(p.grad is None for p in model.parameters())  # the measuring backward left no grads
        parts = ("params", "grads", "optimizer_state", "activations")
        assert report["total"] == sum(report[k] for k in parts)
        reports[mode] = report
    act = {mode: r["activations"] for mode, r in reports.items()}
    assert act["none"] > act["selective"] > act["full"] > 0, act
    # full checkpointing keeps only each block's input (plus rope tables) and the un-checkpointed tail
    assert act["full"] < act["none"] / 4, act

    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    _loss_fn(model)().backward()
    optimizer.step()
    measured, estimated = optimizer_state_bytes(optimizer)
    assert not estimated
    assert 2 * 8 * n_params <= measured <= 2 * 8 * n_params + 8 * len(list(model.parameters()))
    table = format_memory_table([reports["none"], reports["full"]])
    assert table.count("\n| ") == 2 and "estimated" in table
    assert set(metrics_fields(reports["none"])) == {
        "mem_params_gib", "mem_grads_gib", "mem_optimizer_state_gib", "mem_activations_gib", "mem_total_gib",
        "mem_host_gib",
    }


def test_saved_activations_skip_parameters_and_count_storages_once() -> None:
    weight = torch.nn.Parameter(torch.randn(8, 8, dtype=torch.float64))
    lin = torch.nn.Linear(8, 8, bias=False).to(torch.float64)
    lin.weight = weight
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    with SavedActivations() as counter:
        y = lin(x)
        z = (y * y).sum()  # y saved twice: one storage
    z.backward()
    assert counter.bytes == 2 * 4 * 8 * 8  # x (saved by the matmul) and y; the weight is not counted
    assert counter.tensors == 2
    assert apply_recompute(torch.nn.ModuleList(), "none") == []
