"""Speed of the post-training objectives against the steps they are measured by (docs/post-training.md):

- ``sft`` / ``pretrain``: a ``--objective sft`` step (the target mask: prompts and padding ignored, the
  loss the mean over the step's targets) against a pretraining step on the SAME packed rows (the same
  documents, document mask and positions; every token a target), tokens/s;
- ``dpo`` / ``2 sft``: a ``--objective dpo`` step with the cached reference (its log-probabilities in the
  batch: what the reference pass computed before training) against an SFT step on the same rows: the
  chosen and the rejected sequences of every pair, i.e. two SFT passes over the pairs' completions.

One process per layout (``--world`` ranks, gloo, 1 thread each; world 1 in this process), a native preset
(``--model``, fp32) with random weights and random rows (conversations of ``--docs`` documents per row,
the first third of each a prompt; pairs with a prompt and two completions), one warm-up step each. Per
round, side by side: ``--steps`` steps of the baseline right before ``--steps`` of the case, timed on the
slowest rank from a barrier, both by the wall clock and by the process's CPU time (``time.process_time``:
on a machine shared with other jobs the CPU time of a one-thread process is its work, the wall clock also
its waiting); the table gives the median over rounds of case / baseline in tokens/s with its quartiles and
min-max spread.

    .venv/bin/python -m benchmarks.objectives                        # world 1, S 2048, 21 rounds of 1 step
    .venv/bin/python -m benchmarks.objectives --world 4 --hp 2 --cp 2 --seq-len 4096
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

from benchmarks.common import add_common, header
from loongtrain.data.pipeline import _collate
from loongtrain.data.whole_packing import build_row
from loongtrain.launch.config import TrainConfig, run_of
from loongtrain.model.config import get_preset
from loongtrain.parallel.config import ParallelConfig
from loongtrain.parallel.workers import run_local


def _rows(vocab: int, seq: int, docs: int, count: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """SFT rows: ``docs`` conversations of ``seq // docs`` tokens, the first third of each a prompt."""
    gen = np.random.default_rng(seed)
    size = seq // docs
    rows = []
    for _ in range(count):
        pieces = [(gen.integers(0, vocab, size), np.arange(size) >= size // 3) for _ in range(docs)]
        rows.append(build_row(pieces, seq, 0))
    return rows


def _pair_rows(vocab: int, seq: int, pairs: int, count: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """DPO rows: ``pairs`` pairs of a prompt and two completions of ``seq // (4 * pairs)`` tokens each."""
    gen = np.random.default_rng(seed)
    piece = seq // (4 * pairs)
    rows = []
    for r in range(count):
        docs, segments = [], []
        for k in range(pairs):
            prompt = gen.integers(0, vocab, piece)
            for s in range(2):
                docs.append((np.concatenate([prompt, gen.integers(0, vocab, piece)]), np.arange(2 * piece) >= piece))
                segments.append(2 * k + s)
        row = build_row(docs, seq, 0, segments)
        row.update(num_pairs=torch.tensor(pairs), ref_key=torch.tensor(r),
                   ref_logps=torch.full((2 * pairs,), -float(piece), dtype=torch.float64))
        rows.append(row)
    return rows


def _trainer(args, mesh, objective: str):
    from loongtrain.train.trainer import Trainer

    cfg = TrainConfig.from_dict(dict(model=args.model, objective=objective, seq_len=args.seq_len, batch_size=1,
                                     dtype="fp32",
                      memory_report=False, tensorboard=False, plot=False, progress="off", out_dir="/tmp/unused",
                      parallel=ParallelConfig(hp=mesh.hp, cp=mesh.cp), seed=args.seed))
    return Trainer(run_of(cfg, get_preset(args.model)), mesh, torch.device("cpu"), batches=lambda *a: iter(()))


def _timed(trainer, batches: list[dict[str, torch.Tensor]], steps: int, distributed: bool) -> tuple[float, float]:
    """(wall, CPU) seconds per step of ``steps`` steps, the slowest rank's."""
    if distributed:
        dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(steps):
        trainer.step([batches[i % len(batches)]])
    seconds = torch.tensor([(time.perf_counter() - t0) / steps, (time.process_time() - c0) / steps],
                           dtype=torch.float64)
    if distributed:
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds[0]), float(seconds[1])


def _measure(rank: int, world: int, args) -> dict[str, list[float]]:
    import loongtrain

    torch.set_num_threads(1 if world > 1 else (args.threads or torch.get_num_threads()))
    mesh = loongtrain.init_mesh(args.hp, args.cp) if world > 1 else loongtrain.single_process_mesh()
    vocab = get_preset(args.model).vocab_size
    sft_rows = _rows(vocab, args.seq_len, args.docs, 4, args.seed)
    pretrain_rows = [dict(r, labels=torch.cat([r["input_ids"][1:], r["input_ids"][:1]])) for r in sft_rows]
    pair_rows = _pair_rows(vocab, args.seq_len, args.docs, 4, args.seed)
    two_sft = [{k: r[k] for k in ("input_ids", "labels", "position_ids", "doc_starts")} for r in pair_rows]
    trainers = {name: _trainer(args, mesh, name) for name in ("pretrain", "sft", "dpo")}
    batched = lambda rows: [_collate([r]) for r in rows]  # noqa: E731
    pairs = {"sft / pretrain": ((trainers["pretrain"], batched(pretrain_rows)), (trainers["sft"], batched(sft_rows))),
             "dpo / 2 sft": ((trainers["sft"], batched(two_sft)), (trainers["dpo"], batched(pair_rows)))}
    for (base, rows), (case, case_rows) in pairs.values():  # warm-up
        _timed(base, rows, 1, world > 1)
        _timed(case, case_rows, 1, world > 1)
    out: dict[str, list[float]] = {f"{name} ({clock})": [] for name in pairs for clock in ("wall", "CPU")}
    for _ in range(args.rounds):
        for name, ((base, rows), (case, case_rows)) in pairs.items():
            before = _timed(base, rows, args.steps, world > 1)
            after = _timed(case, case_rows, args.steps, world > 1)
            for clock, b, c in zip(("wall", "CPU"), before, after):
                out[f"{name} ({clock})"].append(b / c)  # tokens/s ratio: the same tokens per step
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="native preset (default tiny)")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--docs", type=int, default=4, help="conversations (and pairs) per row (default 4)")
    parser.add_argument("--steps", type=int, default=1, help="timed steps per measurement (default 1)")
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--hp", type=int, default=1)
    parser.add_argument("--cp", type=int, default=1)
    add_common(parser, rounds=21, threads=1, seed=0)
    args = parser.parse_args(argv)
    print(header())
    if args.world == 1:
        result = _measure(0, 1, args)
    else:
        result = run_local(_measure, args.world, args, backend="gloo", threads=1, timeout=3600)[0]
    print(f"model {args.model}, seq_len {args.seq_len}, {args.docs} documents (pairs) per row, world {args.world} "
          f"(hp {args.hp} x cp {args.cp}), fp32, {args.rounds} rounds of {args.steps} steps")
    print("| ratio (tokens/s, case / baseline) | median | quartiles | min-max |")
    print("|---|---:|---:|---:|")
    for name, values in result.items():
        q1, _, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else (values[0],) * 3
        print(f"| {name} | {statistics.median(values):.3f} | {q1:.3f}-{q3:.3f} | {min(values):.3f}-"
              f"{max(values):.3f} |")


if __name__ == "__main__":
    main()
