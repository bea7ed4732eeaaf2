"""``--deterministic``: the option parses, and a training step under
``torch.use_deterministic_algorithms(True)`` runs on CPU (no op without a deterministic version) and
repeats bit for bit."""

from __future__ import annotations

import torch

from loongtrain.commands.train import parse_args
from loongtrain.data.synthetic import global_batch
from loongtrain.launch.config import TrainConfig, run_of
from loongtrain.parallel.config import ParallelConfig
from loongtrain.parallel.mesh import single_process_mesh
from loongtrain.train.trainer import Trainer, use_deterministic
from tests.helpers.fixtures import tiny_model

CONFIG = tiny_model()


def _two_steps(recompute: str) -> tuple[list[float], list[torch.Tensor]]:
    cfg = TrainConfig.from_dict(dict(seq_len=64, warmup=1, parallel=ParallelConfig(recompute=recompute),
                                     deterministic=True))
    trainer = Trainer(run_of(cfg, CONFIG), single_process_mesh(), torch.device("cpu"))
    losses = [trainer.step([global_batch(s, 1, 64, 64, seed=0)])["loss"] for s in range(2)]
    return losses, [p.detach().clone() for p in trainer.params]


def test_deterministic_option_parses():
    assert parse_args(["--deterministic"]).optim.deterministic
    assert not parse_args([]).optim.deterministic


def test_steps_under_deterministic_algorithms_repeat_exactly():
    before = torch.are_deterministic_algorithms_enabled()
    try:
        use_deterministic(torch.device("cpu"))
        assert torch.are_deterministic_algorithms_enabled()
        for recompute in ("none", "selective"):
            (loss_a, params_a), (loss_b, params_b) = _two_steps(recompute), _two_steps(recompute)
            assert loss_a == loss_b
            assert all(torch.equal(a, b) for a, b in zip(params_a, params_b, strict=True))
    finally:
        torch.use_deterministic_algorithms(before)
