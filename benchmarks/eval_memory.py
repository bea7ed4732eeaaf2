"""Evaluation memory per rank vs training memory per rank (docs/evaluation.md).

1. **Model** (the planner's memory model, ``loongtrain/plan/memory_model.py``): a training step's
   per-rank peak for each recomputeing mode, and an upper bound of the forward-only
   evaluation with the same layout and ZeRO: the fp32 weight shards (``4P/z``, no gradients or AdamW
   states), the same working (gathered) weights, ONE layer's activations (what a no-grad forward has
   alive at most), the chunked loss's peak and the same attention workspace (the backward's, an upper
   bound for the forward's).
2. **Measured on CPU**: the peak RSS growth of one training step (``Trainer.step``) and of one evaluation
   forward (``position_loss``) of the same model at the same length, each in a fresh process (growth
   over the RSS after building the model; ``ru_maxrss``).

Usage: ``python -m benchmarks.eval_memory [--seq-len 16384] [--preset 1b --plan-len 65536 --world 8]``
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

GIB = 2**30


def modelled(preset: str, seq_len: int, world: int, hp: int, cp: int) -> list[dict]:
    from loongtrain.model.config import get_preset, num_params
    from loongtrain.model.memory import StepShape
    from loongtrain.parallel.config import ParallelConfig
    from loongtrain.plan.memory_model import layer_activation_bytes, memory_per_rank

    model = get_preset(preset)
    layout = ParallelConfig(hp=hp, cp=cp).layout(world)
    rows = []
    for recompute in ("none", "selective", "full"):
        parts = memory_per_rank(model, layout, ParallelConfig(hp=hp, cp=cp, recompute=recompute), seq_len=seq_len,
                                batch=1, dtype_bytes=2, zero_size=world)
        tokens = seq_len / layout.sp
        one_layer = tokens * layer_activation_bytes(StepShape(model, tokens, 2, True, hp, cp))
        evaluation = 4 * num_params(model) / world + parts["working_params"] + one_layer + parts["logits"] \
            + parts["workspace"]
        rows.append({"recompute": recompute, "train_gib": parts["total"] / GIB, "eval_bound_gib": evaluation / GIB})
    return rows


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize()


def measure(kind: str, seq_len: int) -> dict:
    """One fresh process's peak RSS growth for one training step or one evaluation forward."""
    import torch

    from loongtrain.eval.position_loss import position_loss
    from loongtrain.launch.config import TrainConfig, run_of
    from loongtrain.model.config import get_preset
    from loongtrain.parallel.config import ParallelConfig
    from loongtrain.parallel.mesh import single_process_mesh
    from loongtrain.train.trainer import Trainer

    torch.set_num_threads(2)
    mesh, cpu = single_process_mesh(), torch.device("cpu")
    cfg = TrainConfig.from_dict(dict(model="tiny", seq_len=seq_len, parallel=ParallelConfig(), dtype="fp32",
                                     memory_report=False))
    trainer = Trainer(run_of(cfg, get_preset("tiny")), mesh, cpu)
    ids = torch.randint(0, 256, (1, seq_len + 1), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "position_ids": torch.arange(seq_len)[None]}
    before = _rss_bytes()
    if kind == "train":
        trainer.step([batch])
    else:
        position_loss(trainer.model, [batch], mesh, cpu, seq_len)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"kind": kind, "seq_len": seq_len, "growth_mib": (peak - before) / 2**20}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=16384, help="measured length (tiny preset, one process)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--preset", default="1b")
    p.add_argument("--plan-len", type=int, default=65536)
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--hp", type=int, default=2)
    p.add_argument("--cp", type=int, default=4)
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.seq_len)))
        return 0
    print(f"model: {args.preset} at {args.plan_len} tokens, world {args.world} (hp {args.hp}, cp {args.cp}), "
          f"ZeRO full, bf16")
    for row in modelled(args.preset, args.plan_len, args.world, args.hp, args.cp):
        print(f"  ac {row['recompute']:9s} training {row['train_gib']:6.2f} GiB/rank   evaluation <= "
              f"{row['eval_bound_gib']:6.2f} GiB/rank")
    print(f"measured (CPU, tiny, fp32, {args.seq_len} tokens, one process; peak RSS growth, {args.repeats} runs):")
    for kind in ("train", "eval"):
        runs = [json.loads(subprocess.run([sys.executable, __file__, "--child", kind, "--seq-len", str(args.seq_len)],
                                          check=True, capture_output=True, text=True).stdout)["growth_mib"]
                for _ in range(args.repeats)]
        runs.sort()
        print(f"  {kind:5s} median {runs[len(runs) // 2]:7.1f} MiB (min {runs[0]:.1f}, max {runs[-1]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
