"""Parallel equivalence: 3 AdamW steps on dp=2 x (hp, cp) gloo ranks equal one process on the global batch.

float64 weights and compute; losses, gradient norms and every parameter after 3 steps must agree with the
one-process reference to rtol 1e-9 / atol 1e-11 (the only differences are summation orders of
the sharded attention, the loss and the gradient all-reduce). Gradient accumulation (2
micro-batches), clipping and the warmup + cosine schedule are all active.
"""

from __future__ import annotations

import pytest
import torch

from loongtrain.data.synthetic import synthetic_source
from loongtrain.parallel.config import ParallelConfig
from loongtrain.parallel.mesh import init_mesh, single_process_mesh
from loongtrain.launch.config import TrainConfig
from tests.helpers.dist_utils import run_distributed
from tests.helpers.fixtures import tiny_model
from tests.helpers.training import fit

pytestmark = pytest.mark.distributed

MODEL = tiny_model()
RTOL, ATOL = 1e-9, 1e-11


def _cfg(out_dir: str, hp: int, cp: int, batch_size: int) -> TrainConfig:
    return TrainConfig.from_dict(dict(
        seq_len=32, batch_size=batch_size, grad_accum=2, steps=3, warmup=1, lr=1e-2, clip=0.5,
        parallel=ParallelConfig(hp=hp, cp=cp), dtype="fp64", out_dir=out_dir, peak_tflops=1.0,
        tensorboard=False, plot=False, progress="off",
    ))


def _run(cfg: TrainConfig, mesh) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Per-step (loss, grad norm) pairs and the final parameters. The gradient norm (before clipping)
    checks the gradient scale, which AdamW's update is almost blind to."""
    records = fit(cfg, mesh, torch.device("cpu"), model_config=MODEL,
                  batch_source=synthetic_source(MODEL.vocab_size))
    return [(r["loss"], r["grad_norm"]) for r in records], _final_params(cfg)


def _final_params(cfg: TrainConfig) -> dict[str, torch.Tensor]:
    """Parameters after training, read back from the final checkpoint (layout-independent)."""
    import torch.distributed.checkpoint as dcp

    from loongtrain.model.llama import Transformer

    model = Transformer(MODEL, seed=None).double()
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=f"{cfg.output.out_dir}/checkpoints/step_{cfg.optim.steps:08d}",
             no_dist=True)
    return {k: v.clone() for k, v in state["model"].items()}


def _worker(rank: int, world: int, layouts: list[tuple[int, int]], tmp: str):
    out = {}
    for hp, cp in layouts:
        mesh = init_mesh(hp, cp)
        assert mesh.dp == 2
        cfg = _cfg(f"{tmp}/hp{hp}_cp{cp}", hp, cp, batch_size=1)
        losses, params = _run(cfg, mesh)
        out[(hp, cp)] = (losses, params if rank == 0 else None)
    return out


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_parallel_equivalence(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the reference run in this process: tiny shapes, one thread is fastest
    try:
        _check_parallel_equivalence(tmp_path)
    finally:
        torch.set_num_threads(threads)


def _check_parallel_equivalence(tmp_path):
    ref_losses, ref_params = _run(_cfg(str(tmp_path / "ref"), 1, 1, batch_size=2), single_process_mesh())
    checked = []
    for world, layouts in ((2, [(1, 1)]), (4, [(2, 1), (1, 2)]), (8, [(2, 2)])):
        per_rank = run_distributed(_worker, world, layouts, str(tmp_path))
        for rank_out in per_rank:  # every rank reports the same dp-averaged loss
            for layout, (losses, _) in rank_out.items():
                torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses),
                                           rtol=RTOL, atol=ATOL, msg=lambda m, lay=layout: f"{lay}: {m}")
        for layout, (_, params) in per_rank[0].items():
            assert params.keys() == ref_params.keys()
            for name, value in params.items():
                torch.testing.assert_close(value, ref_params[name], rtol=RTOL, atol=ATOL,
                                           msg=lambda m, lay=layout, n=name: f"{lay} {n}: {m}")
            checked.append(layout)
    assert checked == [(1, 1), (2, 1), (1, 2), (2, 2)]
