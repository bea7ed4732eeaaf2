"""Training tokens/s with compiled decoder blocks against eager, side by side in one process (``--compile``,
docs/design.md §13).

Two :class:`~loongtrain.train.trainer.Trainer` s with the same seed, one with ``compile="off"`` and one with
``compile="on"`` (inductor unless ``--backend``), take the same synthetic batches (packed documents whose mix
changes every step, as in ``--doc-mask on`` runs). After ``--warmup`` steps of each (the compilation), every
round times one eager step right before one compiled step; the table gives medians, the min-max of the
per-round ratio compiled / eager tokens/s, the largest loss difference between the two, and dynamo's graph
count (at most 2 per block). Prints markdown starting with the command.

    python -m benchmarks.compile --seq-len 2048 --steps 10
    python -m benchmarks.compile --device cuda --model 1b --seq-len 65536 --dtype bf16
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time

import torch

from benchmarks.common import add_common, setup
from loongtrain.model.config import ModelConfig, get_preset, step_flops
from loongtrain.parallel.config import ParallelConfig
from loongtrain.parallel.mesh import single_process_mesh
from loongtrain.train.config import TrainConfig
from loongtrain.wrap import compile as compile_step

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


def make_trainer(model: ModelConfig, compile: str, seq_len: int, dtype: str, ac_mode: str, device: torch.device):
    from loongtrain.train.config import Run
    from loongtrain.train.trainer import Trainer

    cfg = TrainConfig(seq_len=seq_len, steps=1000, warmup=1, dtype=dtype, compile=compile, doc_mask="on",
                      parallel=ParallelConfig(ac_mode=ac_mode))
    return Trainer(Run(cfg, model), single_process_mesh(), device)


def timed_step(trainer, batch, device: torch.device) -> tuple[float, dict]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    result = trainer.step([batch])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0, result


def side_by_side(model: ModelConfig, seq_len: int, steps: int, warmup: int, dtype: str, ac_mode: str,
                 device: torch.device) -> dict:
    """Eager and compiled trainers on the same batches; per round an eager step right before a compiled one.
    Returns per timed round: tokens/s of each, the ratio, and the step's model FLOPs (visible pairs only)."""
    from torch._dynamo.utils import counters

    counters.clear()
    eager = make_trainer(model, "off", seq_len, dtype, ac_mode, device)
    compiled = make_trainer(model, "on", seq_len, dtype, ac_mode, device)
    out: dict = {"eager": [], "compiled": [], "ratio": [], "flops": [], "loss_diff": 0.0}
    t0 = time.perf_counter()
    for step in range(warmup + steps):
        batch = doc_batch(step, seq_len, model.vocab_size)
        (te, re), (tc, rc) = timed_step(eager, batch, device), timed_step(compiled, batch, device)
        out["loss_diff"] = max(out["loss_diff"], abs(re["loss"] - rc["loss"]))
        if step >= warmup:
            out["eager"].append(seq_len / te)
            out["compiled"].append(seq_len / tc)
            out["ratio"].append(te / tc)
            out["flops"].append(step_flops(model, seq_len, re["attention_pairs"]))
        elif step == warmup - 1:
            out["warmup_s"] = time.perf_counter() - t0
    out["graphs"] = counters["stats"]["unique_graphs"]
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="a preset (default: a 4-layer d=256 model)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--ac-mode", default="selective")
    parser.add_argument("--backend", default=compile_step.BACKEND)
    add_common(parser, device="cpu", threads=0)
    args = parser.parse_args(argv)
    device = setup(args)
    compile_step.BACKEND = args.backend
    model = get_preset(args.model) if args.model else SMALL
    r = side_by_side(model, args.seq_len, args.steps, args.warmup, args.dtype, args.ac_mode, device)
    print(f"```\npython -m benchmarks.compile {shlex.join(argv if argv is not None else sys.argv[1:])}\n```\n")
    print("| backend | eager tok/s | compiled tok/s | compiled / eager (median, min-max) | max loss diff | "
          "graphs | warm-up s |\n|---|---:|---:|---|---:|---:|---:|")
    print(f"| {args.backend} | {statistics.median(r['eager']):.0f} | {statistics.median(r['compiled']):.0f} | "
          f"{statistics.median(r['ratio']):.2f} ({min(r['ratio']):.2f}-{max(r['ratio']):.2f}) | "
          f"{r['loss_diff']:.1e} | {r['graphs']} | {r.get('warmup_s', float('nan')):.0f} |")


if __name__ == "__main__":
    main()
