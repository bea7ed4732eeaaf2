"""Cost of checking the attention arguments across ranks on EVERY call (parallel/agreement.py).

One spawn of ``--world`` gloo ranks (``--hp`` x ``--cp``, 1 torch thread each). Per sequence length and
per round, side by side in the same processes: ``--iters`` forward + backward calls of
``loongtrain.attention`` with the once-per-signature check ("once": after the first call a set lookup,
i.e. no check) right before the same calls with the per-call digest ("every": one all-reduce of two
int64 on the replica's ranks). Each call starts at a barrier and is timed on the slowest rank; a round's
value is the median call; the table gives the median over rounds of every/once and the min-max spread,
and the digest exchange alone (``check_agreement`` with the same fields, no attention). Packed documents
(``cu_seqlens``, 8 per row) are passed, as the trainer does with ``--doc-mask on``.

    .venv/bin/python -m benchmarks.agreement                       # world 4 = 2x2, S 1024 and 8192
    .venv/bin/python -m benchmarks.agreement --seq-lens 2048 --rounds 3
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


def _worker(rank: int, world: int, hp: int, cp: int, seq_lens: list[int], iters: int, rounds: int) -> list[dict]:
    mesh = init_mesh(hp, cp)
    return [_measure(mesh, seq, iters, rounds) for seq in seq_lens]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hp", type=int, default=2)
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--seq-lens", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 8192])
    p.add_argument("--iters", type=int, default=10)
    add_common(p, rounds=5)
    args = p.parse_args(argv)
    rows = run_local(_worker, args.hp * args.cp, args.hp, args.cp, args.seq_lens, args.iters, args.rounds,
                     backend="gloo", timeout=1800)[0]
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
