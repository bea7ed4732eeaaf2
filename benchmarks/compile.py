"""Training tokens/s with compiled decoder blocks against eager, side by side in the same processes (``--compile``,
docs/compile.md).

Two :class:`~loongtrain.train.trainer.Trainer` s with the same seed, one with ``compile="off"`` and one with
``compile="on"`` (inductor unless ``--backend``), take the same synthetic batches (packed documents whose mix
changes every step, as in ``--doc-mask on`` runs). After ``--warmup`` steps of each (the compilation), every
round times one eager step right before one compiled step; the table gives medians, the min-max of the
per-round ratio compiled / eager tokens/s, the largest loss difference between the two, and dynamo's graph
count (at most 2, shared by all blocks). With ``--hp``/``--cp`` (world > 1) every gloo rank (1 thread) runs
both trainers on its mesh, and a step's time is the slowest rank's. Prints markdown starting with the
command, date and load (:func:`benchmarks.common.header`).

    python -m benchmarks.compile --seq-len 2048 --steps 10
    python -m benchmarks.compile --hp 2 --cp 2 --seq-len 4096 --steps 10       # world 4
    python -m benchmarks.compile --device cuda --model 1b --seq-len 65536 --dtype bf16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from benchmarks.common import add_common, header, setup
from loongtrain.launch.config import TrainConfig
from loongtrain.model.config import ModelConfig, get_preset, step_flops
from loongtrain.parallel.config import ParallelConfig
from loongtrain.parallel.mesh import single_process_mesh
from loongtrain.parallelize import compile as compile_step

SMALL = ModelConfig(vocab_size=256, dim=256, num_layers=4, num_heads=8, num_kv_heads=2, ffn_dim=768)


def doc_batch(step: int, seq_len: int, vocab: int, max_docs: int = 8) -> dict[str, torch.Tensor]:
    """Random tokens packed into 1..max_docs documents, a different mix every step."""
    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, vocab, (1, seq_len + 1), generator=gen)
    starts = torch.zeros(1, seq_len, dtype=torch.bool)
    starts[0, 0] = True
    starts[0, torch.randperm(seq_len - 1, generator=gen)[: step % max_docs].add(1)] = True
    return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:],
            "position_ids": torch.arange(seq_len)[None], "doc_starts": starts}


def make_trainer(model: ModelConfig, compile: str, seq_len: int, dtype: str, recompute: str, device: torch.device,
                 mesh=None):
    from loongtrain.launch.config import run_of
    from loongtrain.train.trainer import Trainer

    mesh = mesh or single_process_mesh()
    parallel = ParallelConfig(recompute=recompute, hp=mesh.hp, cp=mesh.cp, inner_ring=mesh.inner_ring)
    cfg = TrainConfig.from_dict(dict(seq_len=seq_len, steps=1000, warmup=1, dtype=dtype, compile=compile, doc_mask="on",
                      parallel=parallel))
    return Trainer(run_of(cfg, model), mesh, device)


def timed_step(trainer, batch, device: torch.device) -> tuple[float, dict]:
    """One optimizer step's seconds (the slowest rank's, when distributed) and its result."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if dist.is_initialized():
        dist.barrier()
    t0 = time.perf_counter()
    result = trainer.step([batch])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    if dist.is_initialized():
        slowest = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        seconds = float(slowest)
    return seconds, result


def side_by_side(model: ModelConfig, seq_len: int, steps: int, warmup: int, dtype: str, recompute: str,
                 device: torch.device, mesh=None) -> dict:
    """Eager and compiled trainers on the same batches; per round an eager step right before a compiled one.
    Returns per timed round: tokens/s of each, the ratio, and the step's model FLOPs (visible pairs only)."""
    from torch._dynamo.utils import counters

    counters.clear()
    eager = make_trainer(model, "off", seq_len, dtype, recompute, device, mesh)
    compiled = make_trainer(model, "on", seq_len, dtype, recompute, device, mesh)
    out: dict = {"eager": [], "compiled": [], "ratio": [], "flops": [], "loss_diff": 0.0}
    t0 = time.perf_counter()
    for step in range(warmup + steps):
        batch = doc_batch(step, seq_len, model.vocab_size)
        (te, re), (tc, rc) = timed_step(eager, batch, device), timed_step(compiled, batch, device)
        out["loss_diff"] = max(out["loss_diff"], abs(re["loss"] - rc["loss"]))
        out["loss_rel_diff"] = max(out.get("loss_rel_diff", 0.0), abs(re["loss"] - rc["loss"]) / abs(re["loss"]))
        if step >= warmup:
            out["eager"].append(seq_len / te)
            out["compiled"].append(seq_len / tc)
            out["ratio"].append(te / tc)
            out["flops"].append(step_flops(model, seq_len, re["attention_pairs"]))
        elif step == warmup - 1:
            out["warmup_s"] = time.perf_counter() - t0
    out["graphs"] = counters["stats"]["unique_graphs"]
    return out


def _worker(rank: int, world: int, backend: str, hp: int, cp: int, inner_ring: int, model: ModelConfig,
            args: tuple) -> dict:
    """One gloo rank of ``--hp x --cp``: :func:`side_by_side` on its mesh (every rank times the same steps)."""
    from loongtrain.parallel.mesh import init_mesh

    compile_step.BACKEND = backend
    return side_by_side(model, *args, mesh=init_mesh(hp, cp, inner_ring=inner_ring))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="a preset (default: a 4-layer d=256 model)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10, help="timed rounds (an eager step, then a compiled one)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--recompute", default="selective")
    parser.add_argument("--backend", default=compile_step.BACKEND)
    parser.add_argument("--hp", type=int, default=1, help="head parallelism (hp x cp gloo ranks, 1 thread each)")
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--inner-ring", type=int, default=1, help="ranks per inner ring of the double ring")
    add_common(parser, device="cpu", threads=0)
    args = parser.parse_args(argv)
    device = setup(args)
    compile_step.BACKEND = args.backend
    model = get_preset(args.model) if args.model else SMALL
    timed = (args.seq_len, args.steps, args.warmup, args.dtype, args.recompute, device)
    world = args.hp * args.cp
    if world == 1:
        r = side_by_side(model, *timed)
    else:
        from loongtrain.parallel.workers import run_local

        r = run_local(_worker, world, args.backend, args.hp, args.cp, args.inner_ring, model, timed, backend="gloo",
                      threads=1, timeout=3600)[0]
    print(header())
    print(f"\nworld {world} (hp={args.hp}, cp={args.cp}, inner_ring {args.inner_ring}), {args.dtype}, "
          f"--recompute {args.recompute}, S={args.seq_len}, documents changing every step; {args.steps} rounds of an "
          f"eager step right before a compiled step (the slowest rank's time)\n")
    print("| backend | eager tok/s | compiled tok/s | compiled / eager tok/s (median, min-max) | max loss rel diff | "
          "graphs | warm-up s |\n|---|---:|---:|---|---:|---:|---:|")
    print(f"| {args.backend} | {statistics.median(r['eager']):.0f} | {statistics.median(r['compiled']):.0f} | "
          f"{statistics.median(r['ratio']):.2f} ({min(r['ratio']):.2f}-{max(r['ratio']):.2f}) | "
          f"{r['loss_rel_diff']:.1e} | {r['graphs']} | {r.get('warmup_s', float('nan')):.0f} |")


if __name__ == "__main__":
    main()
