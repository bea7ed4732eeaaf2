"""Cost of checking the attention arguments across ranks on every call, and the trainer's step with the
per-call check against the once-per-step one (parallel/agreement.py, docs/launching.md).

One spawn of ``--world`` gloo ranks (``--hp`` x ``--cp``, 1 torch thread each). Per sequence length and
per round, side by side in the same processes: ``--iters`` forward + backward calls of
``loongtrain.attention`` with the once-per-signature check ("once": after the first call a set lookup,
i.e. no check) right before the same calls with the per-call digest ("every": one all-reduce of two
int64 on the replica's ranks). Each call starts at a barrier and is timed on the slowest rank; a round's
value is the median call; the table gives the median over rounds of every/once and the min-max spread,
and the digest exchange alone (``check_agreement`` with the same fields, no attention). Packed documents
(``cu_seqlens``, 8 per row) are passed, as the trainer does with ``--doc-mask on``.

``--steps N``: instead, whole training steps of the tiny preset (selective recompute, packed documents,
fp32) through ``Trainer.step``, side by side in the same processes: ``--rounds x N`` pairs, each a step of a
trainer with the per-call agreement (``per_call_checks=True``: one exchange per attention call) right before
a step of one with the step's agreement (the layout agreed up front, one digest of every call checked at the
end) on the same batch; each step starts at a barrier and is timed on the slowest rank; the table gives the
median of the per-pair new/old with its quartiles and min-max, and the digest exchanges each made per step.

    .venv/bin/python -m benchmarks.agreement                       # world 4 = 2x2, S 1024 and 8192
    .venv/bin/python -m benchmarks.agreement --seq-lens 2048 --rounds 3
    .venv/bin/python -m benchmarks.agreement --steps 4 --seq-lens 1024,4096 --rounds 5
    .venv/bin/python -m benchmarks.agreement --steps 4 --seq-lens 1024 --rounds 5 --layers 12
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist

from benchmarks.common import add_common
from loongtrain import attention, shard_sequence
from loongtrain.parallel import agreement
from loongtrain.parallel.mesh import init_mesh
from loongtrain.parallel.workers import run_local


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _timed(fn, iters: int) -> float:
    """Median over ``iters`` calls of the slowest rank's seconds (each call starts at a barrier)."""
    out = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        out.append(_slowest(time.perf_counter() - t0))
    return statistics.median(out)


def _measure(mesh, seq: int, iters: int, rounds: int) -> dict:
    """One sequence length: every/once per round, and the digest exchange alone."""
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(1, seq, 8, 64, generator=gen) for _ in range(3)]
    q, k, v = (shard_sequence(t, mesh, dim=1).requires_grad_() for t in full)
    cu = torch.linspace(0, seq, 9).to(torch.int64)
    fields = {"batch": 1, "seq": seq, "documents": tuple(cu.tolist())}

    def call() -> None:
        attention(q, k, v, mesh, cu_seqlens=cu).sum().backward()

    ratios, once_s, every_s, digest_s = [], [], [], []
    for _ in range(rounds):
        agreement.set_attention_check("once")
        call()  # the one check of this signature, untimed
        once = _timed(call, iters)
        agreement.set_attention_check("every")
        call()
        every = _timed(call, iters)
        digest_s.append(_timed(lambda: agreement.check_agreement("attention", fields, mesh.sp_group), iters))
        ratios.append(every / once)
        once_s.append(once)
        every_s.append(every)
    return {"seq": seq, "ratio": statistics.median(ratios), "lo": min(ratios), "hi": max(ratios),
            "once_ms": 1e3 * statistics.median(once_s), "every_ms": 1e3 * statistics.median(every_s),
            "digest_us": 1e6 * statistics.median(digest_s)}


def _packed(step: int, seq: int, documents: int = 8) -> dict[str, torch.Tensor]:
    """One row of random bytes packed as ``documents`` equal documents (as the data pipeline marks them)."""
    tokens = torch.randint(0, 256, (1, seq + 1), generator=torch.Generator().manual_seed(step))
    starts = torch.zeros(1, seq, dtype=torch.bool)
    starts[0, :: max(1, seq // documents)] = True
    return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:], "position_ids": torch.arange(seq)[None],
            "doc_starts": starts}


def _measure_steps(mesh, seq: int, steps: int, rounds: int, layers: int) -> dict:
    """One sequence length: ``rounds x steps`` pairs of training steps, each step of the trainer with the
    step's agreement (new) timed right after one of the trainer with the per-call agreement (old) on the
    same batch; new/old per pair, and the digest exchanges each makes per step."""
    import dataclasses

    from loongtrain.launch.config import TrainConfig, run_of
    from loongtrain.model.config import PRESETS
    from loongtrain.parallel.config import ParallelConfig
    from loongtrain.train.trainer import Trainer

    cfg = TrainConfig.from_dict(dict(model="tiny", seq_len=seq, steps=steps * rounds + 1, dtype="fp32", doc_mask="on",
                      parallel=ParallelConfig(hp=mesh.hp, cp=mesh.cp, recompute="selective")))
    model = dataclasses.replace(PRESETS["tiny"], num_layers=layers or PRESETS["tiny"].num_layers)
    trainers = {old: Trainer(run_of(cfg, model), mesh, torch.device("cpu"), per_call_checks=old)
                for old in (True, False)}
    for trainer in trainers.values():
        trainer.step([_packed(0, seq)])  # warm-up: AdamW state
    exchanges = {True: 0, False: 0}
    case = {"old": True}  # the trainer being timed
    digest = agreement._same_everywhere

    def counted(text, group):
        exchanges[case["old"]] += 1
        return digest(text, group)

    ratios, old_s, new_s = [], [], []
    agreement._same_everywhere = counted
    try:
        for i in range(1, rounds * steps + 1):
            times = {}
            for old in (True, False):  # the baseline (per-call) right before the case (once per step)
                case["old"] = old
                times[old] = _timed(lambda o=old, i=i: trainers[o].step([_packed(i, seq)]), 1)
            ratios.append(times[False] / times[True])
            old_s.append(times[True])
            new_s.append(times[False])
    finally:
        agreement._same_everywhere = digest
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    pairs = rounds * steps
    return {"seq": seq, "ratio": statistics.median(ratios), "q1": quartiles[0], "q3": quartiles[2],
            "lo": min(ratios), "hi": max(ratios), "pairs": pairs,
            "old_ms": 1e3 * statistics.median(old_s), "new_ms": 1e3 * statistics.median(new_s),
            "old_exchanges": exchanges[True] / pairs, "new_exchanges": exchanges[False] / pairs}


def _worker(rank: int, world: int, hp: int, cp: int, seq_lens: list[int], iters: int, rounds: int,
            steps: int, layers: int) -> list[dict]:
    mesh = init_mesh(hp, cp)
    if steps:
        return [_measure_steps(mesh, seq, steps, rounds, layers) for seq in seq_lens]
    return [_measure(mesh, seq, iters, rounds) for seq in seq_lens]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hp", type=int, default=2)
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--seq-lens", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 8192])
    p.add_argument("--iters", type=int, default=10)
    add_common(p, rounds=5)
    p.add_argument("--steps", type=int, default=0, help="time training steps (this many per case and round)")
    p.add_argument("--layers", type=int, default=0, help="with --steps: the tiny preset at this depth (0: its own)")
    args = p.parse_args(argv)
    rows = run_local(_worker, args.hp * args.cp, args.hp, args.cp, args.seq_lens, args.iters, args.rounds,
                     args.steps, args.layers, backend="gloo", timeout=3600)[0]
    if args.steps:
        depth = f" at {args.layers} layers" if args.layers else ""
        print(f"world {args.hp * args.cp} (hp={args.hp}, cp={args.cp}), gloo, tiny preset{depth}, fp32, selective "
              f"checkpointing, 8 packed documents; {args.rounds} x {args.steps} pairs of steps (per-call, then "
              f"once per step, same batch)")
        print("| S | per-call ms/step | once per step ms/step | new / old: median (quartiles; min-max) | "
              "digest exchanges per step (old, new) |")
        print("|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['seq']} | {r['old_ms']:.1f} | {r['new_ms']:.1f} | {r['ratio']:.3f} ({r['q1']:.3f}-"
                  f"{r['q3']:.3f}; {r['lo']:.3f}-{r['hi']:.3f}) | {r['old_exchanges']:.0f}, {r['new_exchanges']:.0f} |")
        return 0
    print(f"world {args.hp * args.cp} (hp={args.hp}, cp={args.cp}), gloo, fp32, B=1 H=8 D=64, 8 documents; "
          f"{args.rounds} rounds x {args.iters} calls (forward + backward)")
    print("| S | once ms | every ms | every / once (min-max) | digest exchange alone |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['seq']} | {r['once_ms']:.2f} | {r['every_ms']:.2f} | {r['ratio']:.3f} "
              f"({r['lo']:.3f}-{r['hi']:.3f}) | {r['digest_us']:.0f} us |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
