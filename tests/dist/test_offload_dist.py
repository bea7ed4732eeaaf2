"""The offload and tiling modes on sharded runs (docs/memory.md): world 4 (hp=2 x cp=2, documents on)
and world 1 with parameter offload (FSDP2's CPUOffloadPolicy on a one-rank gloo group). Each mode's two
AdamW steps equal the plain run of the same layout: losses, gradients and the updated weights (fp64,
1e-10). One process launch of each size."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.helpers.dist_utils import run_distributed

pytestmark = pytest.mark.distributed

TOL = 1e-10

WORLD4_CASES: dict[str, dict[str, Any]] = {
    "offload selective": {"recompute": "selective", "offload_activations": True},
    "offload full, tiles 4": {"recompute": "full", "offload_activations": True, "mlp_tiles": "4"},
    "zero full, offload params, tiles auto": {"zero": "full", "offload_params": True, "mlp_tiles": "auto"},
    "everything": {"zero": "full", "offload_params": True, "recompute": "selective", "offload_activations": True,
                   "mlp_tiles": "2"},
}
WORLD1_CASES: dict[str, dict[str, Any]] = {
    "offload params": {"zero": "full", "offload_params": True},
    "everything": {"zero": "full", "offload_params": True, "recompute": "full", "offload_activations": True,
                   "mlp_tiles": "auto"},
}


def _run(hp: int, cp: int, **opts: Any) -> dict[str, Any]:
    """Two steps on the packed test batch: losses, the second step's full gradients and the weights after."""
    from loongtrain.parallel.config import ParallelConfig
    from loongtrain.parallel.mesh import init_mesh
    from loongtrain.parallelize.offload import activation_offloader
    from loongtrain.launch.config import TrainConfig, run_of
    from loongtrain.train.trainer import Trainer
    from tests.helpers.doc_batches import MODEL, ROWS, SEQ, packed_batch

    mesh = init_mesh(hp, cp)
    cfg = TrainConfig.from_dict(dict(seq_len=SEQ, batch_size=ROWS, steps=2, warmup=0, clip=1.0, dtype="fp64", doc_mask="on",
                      parallel=ParallelConfig(hp=hp, cp=cp, **opts)))
    trainer = Trainer(run_of(cfg, MODEL), mesh, torch.device("cpu"))
    if opts.get("offload_params"):
        shards = [p.to_local() for p in trainer.model.parameters()]
        assert shards and all(s.device.type == "cpu" for s in shards)
        assert all(type(p).__name__ == "DTensor" for p in trainer.model.parameters())
    losses = [trainer.step([packed_batch()])["loss"] for _ in range(2)]
    offloader = activation_offloader(trainer.model)
    assert (offloader is not None and offloader.offloaded_bytes > 0) == bool(opts.get("offload_activations"))

    def full(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()

    params = dict(trainer.model.named_parameters())
    return {"losses": losses, "params": {n: full(p) for n, p in params.items()}}


def _worker(rank: int, world: int, cases: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    hp, cp = (2, 2) if world == 4 else (1, 1)
    ref = _run(hp, cp)
    diffs = {}
    for name, opts in cases.items():
        got = _run(hp, cp, **opts)
        diffs[name] = {
            "loss": max(abs(a - b) for a, b in zip(got["losses"], ref["losses"], strict=True)),
            "param": max((got["params"][n] - ref["params"][n]).abs().max().item() for n in ref["params"]),
            "second_step": abs(got["losses"][1] - got["losses"][0]),
        }
    return diffs


@pytest.mark.parametrize("world, cases", [(4, WORLD4_CASES), (1, WORLD1_CASES)], ids=["world4", "world1"])
def test_modes_equal_the_plain_run(world: int, cases: dict[str, dict[str, Any]]) -> None:
    for rank, diffs in enumerate(run_distributed(_worker, world, cases)):
        assert diffs.keys() == cases.keys()
        for name, diff in diffs.items():
            assert diff["loss"] < TOL and diff["param"] < TOL, (world, rank, name, diff)
            assert diff["second_step"] > 1e-6, (world, rank, name, diff)  # the first step did update the weights
