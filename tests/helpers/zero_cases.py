"""The ZeRO training harness: a tiny fp64 trainer, its batches and steps, and comparisons of losses and parameters."""

from __future__ import annotations

from typing import Any

import torch

TOL = 1e-10
STEPS = 3
SEQ = 16
VOCAB = 64


def model_config(tied: bool = False) -> Any:
    from loongtrain.model.config import ModelConfig

    return ModelConfig(vocab_size=VOCAB, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=64,
                       tie_embeddings=tied)


def make_trainer(mesh: Any, *, tied: bool = False, batch_size: int = 1, train_opts: dict | None = None,
                 **opts: Any) -> Any:
    """A float64 Trainer on CPU whose ``cfg.parallel`` has ``mesh``'s degrees and the memory options ``opts``
    (``train_opts``: further TrainConfig fields)."""
    from loongtrain.launch.config import TrainConfig, run_of
    from loongtrain.parallel.config import ParallelConfig
    from loongtrain.train.trainer import Trainer

    parallel = ParallelConfig(hp=mesh.hp, cp=mesh.cp, **opts)
    cfg = TrainConfig.from_dict(dict(seq_len=SEQ, steps=STEPS, warmup=1, parallel=parallel, dtype="fp64", seed=0,
                      batch_size=batch_size, **(train_opts or {})))
    return Trainer(run_of(cfg, model_config(tied)), mesh, torch.device("cpu"))


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded copies of every parameter, by name (collective under FSDP)."""
    out = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = full.detach().clone()
    return out


def compare(a: tuple[list[float], dict], b: tuple[list[float], dict]) -> dict[str, float]:
    """Max absolute loss and parameter differences between two (losses, params) results."""
    assert a[1].keys() == b[1].keys()
    return {
        "loss": max(abs(x - y) for x, y in zip(a[0], b[0], strict=True)),
        "param": max((a[1][n] - b[1][n]).abs().max().item() for n in a[1]),
    }


def replica_batch(mesh: Any, step: int) -> dict[str, torch.Tensor]:
    """This rank's replica's full-sequence micro-batch of global step ``step`` (batch 1 per replica)."""
    from loongtrain.data.synthetic import global_batch

    batch = global_batch(step, mesh.dp, SEQ, VOCAB, seed=0)
    return {k: v[mesh.dp_rank : mesh.dp_rank + 1] for k, v in batch.items()}


def train(trainer: Any, mesh: Any, steps: range) -> list[float]:
    return [trainer.step([replica_batch(mesh, s)])["loss"] for s in steps]
