"""Speed of ``--objective grpo`` (docs/rl.md):

- ``grpo / sft``: a GRPO step (dapo, token ratios, no KL: the per-token log-probabilities, the clipped
  surrogate and TRL's metrics) against an SFT step on the SAME packed rows: each conversation's first third a
  prompt, the rest its completion (the SFT targets are the completion tokens), tokens/s; and ``grpo+kl / sft``,
  the same with ``--grpo-beta 0.04`` (a resident reference model: one more forward a step);
- the online loop's time split: ``--steps`` steps of the example task (examples/rl/) at world 1, each step's
  ``time/generate_s``, ``time/score_s`` and the rest of its step time (the update: weights out, packing,
  forward, backward, optimizer), medians and spreads.

Side by side as benchmarks/objectives.py: per round, the SFT step right before the case, wall clock and process
CPU time, the median over rounds of the ratio with quartiles and min-max.

    .venv/bin/python -m benchmarks.grpo                         # world 1, S 2048, 21 rounds
    .venv/bin/python -m benchmarks.grpo --world 4 --hp 2 --cp 2 --seq-len 4096 --rounds 9
    .venv/bin/python -m benchmarks.grpo --loop-steps 20         # and the loop's split
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import add_common, header
from benchmarks.objectives import _rows, _timed
from loongtrain.data.pipeline import _collate
from loongtrain.launch.config import TrainConfig, run_of
from loongtrain.model.config import get_preset
from loongtrain.parallel.config import ParallelConfig
from loongtrain.parallel.workers import run_local

ROOT = Path(__file__).resolve().parents[1]


def _grpo_rows(sft_rows: list[dict[str, torch.Tensor]], docs: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """The SFT rows as GRPO rows: each document's targets one completion (its segment), random advantages."""
    gen = np.random.default_rng(seed)
    out = []
    for row in sft_rows:
        starts = torch.nonzero(row["doc_starts"]).flatten().tolist() + [row["input_ids"].shape[0]]
        segment = torch.full_like(row["labels"], -1)
        lengths = torch.zeros(docs, dtype=torch.int64)
        for k, (s, e) in enumerate(zip(starts[:docs], starts[1:docs + 1])):
            target = row["labels"][s:e] != -100
            segment[s:e][target] = k
            lengths[k] = int(target.sum())
        out.append(dict(row, segment=segment, lengths=lengths, num_sequences=torch.tensor(docs),
                        advantages=torch.tensor(gen.standard_normal(docs)), rewards=torch.tensor(gen.random(docs)),
                        std_zero=torch.zeros(docs, dtype=torch.bool)))
    return out


def _trainer(args, mesh, objective: str, beta: float = 0.0):
    from loongtrain.train.trainer import Trainer

    extra = dict(doc_mask="on", position_reset=True, grpo_beta=beta) if objective == "grpo" else {}
    cfg = TrainConfig.from_dict(dict(model=args.model, objective=objective, seq_len=args.seq_len, batch_size=1,
                                     dtype="fp32", memory_report=False, tensorboard=False, plot=False, progress="off",
                                     out_dir="/tmp/unused", parallel=ParallelConfig(hp=mesh.hp, cp=mesh.cp),
                                     seed=args.seed, **extra))
    return Trainer(run_of(cfg, get_preset(args.model)), mesh, torch.device("cpu"), batches=lambda *a: iter(()))


def _measure(rank: int, world: int, args) -> dict[str, list[float]]:
    import loongtrain

    torch.set_num_threads(1 if world > 1 else (args.threads or torch.get_num_threads()))
    mesh = loongtrain.init_mesh(args.hp, args.cp) if world > 1 else loongtrain.single_process_mesh()
    sft_rows = _rows(get_preset(args.model).vocab_size, args.seq_len, args.docs, 4, args.seed)
    grpo_rows = [_collate([r]) for r in _grpo_rows(sft_rows, args.docs, args.seed)]
    sft = [_collate([r]) for r in sft_rows]
    cases = {"grpo / sft": _trainer(args, mesh, "grpo"), "grpo+kl / sft": _trainer(args, mesh, "grpo", 0.04)}
    base = _trainer(args, mesh, "sft")
    _timed(base, sft, 1, world > 1)
    for case in cases.values():
        _timed(case, grpo_rows, 1, world > 1)
    out: dict[str, list[float]] = {f"{name} ({clock})": [] for name in cases for clock in ("wall", "CPU")}
    for _ in range(args.rounds):
        for name, case in cases.items():
            before = _timed(base, sft, args.steps, world > 1)
            after = _timed(case, grpo_rows, args.steps, world > 1)
            for clock, b, c in zip(("wall", "CPU"), before, after):
                out[f"{name} ({clock})"].append(b / c)  # tokens/s ratio: the same tokens per step
    return out


def _loop_split(steps: int) -> dict[str, list[float]]:
    """The example task's online loop (README), ``steps`` steps: each step's generate / score / update seconds."""
    from loongtrain.commands import main as cli_main

    example = ROOT / "examples"
    with tempfile.TemporaryDirectory() as tmp:
        argv = ["train", "--model", str(example / "post-training/tiny-qwen3"), "--tokenizer", "byte",
                "--objective", "grpo", "--prompts", str(example / "rl/prompts.jsonl"),
                "--reward", f"{example / 'rl/reward.py'}:lowercase", "--num-generations", "4",
                "--generation-batch-size", "16", "--max-completion-length", "24", "--lr", "0.01", "--steps", str(steps),
                "--seq-len", "256", "--batch-size", "4", "--nproc", "1", "--hp", "1", "--cp", "1", "--progress", "off",
                "--no-plot", "--no-tensorboard", "--no-memory-report", "--out-dir", tmp]
        assert cli_main(argv) == 0
        records = [r for r in map(json.loads, (Path(tmp) / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    out: dict[str, list[float]] = {"generate": [], "score": [], "update": [], "step": []}
    for r in records[1:]:  # the first step also builds the engine
        out["generate"].append(r["time/generate_s"])
        out["score"].append(r["time/score_s"])
        out["update"].append(r["step_time_s"] - r["time/generate_s"] - r["time/score_s"])
        out["step"].append(r["step_time_s"])
    return out


def _row(name: str, values: list[float], digits: int = 3) -> str:
    q1, _, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else (values[0],) * 3
    return (f"| {name} | {statistics.median(values):.{digits}f} | {q1:.{digits}f}-{q3:.{digits}f} | "
            f"{min(values):.{digits}f}-{max(values):.{digits}f} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="native preset (default tiny)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--docs", type=int, default=4, help="completions per row (default 4)")
    parser.add_argument("--steps", type=int, default=1, help="timed steps per measurement (default 1)")
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--hp", type=int, default=1)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--loop-steps", type=int, default=0, help="also time the online loop for this many steps")
    add_common(parser, rounds=21, threads=1, seed=0)
    args = parser.parse_args(argv)
    print(header())
    if args.rounds:
        if args.world == 1:
            result = _measure(0, 1, args)
        else:
            result = run_local(_measure, args.world, args, backend="gloo", threads=1, timeout=3600)[0]
        print(f"model {args.model}, seq_len {args.seq_len}, {args.docs} completions per row, world {args.world} "
              f"(hp {args.hp} x cp {args.cp}), fp32, {args.rounds} rounds of {args.steps} steps")
        print("| ratio (tokens/s, case / baseline) | median | quartiles | min-max |")
        print("|---|---:|---:|---:|")
        for name, values in result.items():
            print(_row(name, values))
    if args.loop_steps:
        split = _loop_split(args.loop_steps)
        print(f"\nonline loop, examples/rl/ (16 completions of up to 24 tokens a step), steps 2-{args.loop_steps}")
        print("| part | median s | quartiles | min-max |")
        print("|---|---:|---:|---:|")
        for name, values in split.items():
            print(_row(name, values))


if __name__ == "__main__":
    main()
