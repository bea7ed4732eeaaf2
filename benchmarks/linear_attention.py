"""Linear attention through the 2D mesh (docs/linear-attention.md): a sharded Gated DeltaNet layer
(``loongtrain.linear_attention`` forward + backward) against the unsharded one, and the bytes a layer exchanges
against the sequence length.

    python -m benchmarks.linear_attention --rounds 9 --seq-len 4096 --world 4 --hp 1 --cp 4
    python -m benchmarks.linear_attention --bytes --world 4 --hp 2 --cp 2

Timing: every rank (one thread each) runs the whole sequence on one process (the baseline: the same layer with no
mesh) and its shard on the mesh, alternating, one warm-up each; the table gives the slowest rank's CPU time of
the sharded step over the baseline's (median, quartiles, min-max; ``1/sp`` would be a perfect split). Bytes: one
step's traffic per rank by kind (:class:`~loongtrain.parallel.comm.CommCounter`) at several lengths.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import loongtrain
from benchmarks.common import add_common, header
from loongtrain.parallel.comm import CommCounter

#: a Qwen3.5-like linear layer scaled down for a CPU: key heads, value heads, head dims, kernel size
SHAPE = dict(key_heads=4, value_heads=8, key_dim=64, value_dim=64, taps=4)


def _inputs(seq_len: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hk, hv, dk, dv, taps = (SHAPE[k] for k in ("key_heads", "value_heads", "key_dim", "value_dim", "taps"))
    rand = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    gate = -torch.nn.functional.softplus(rand(1, seq_len, hv)) * 0.1
    return [rand(1, seq_len, hk, dk), rand(1, seq_len, hk, dk), rand(1, seq_len, hv, dv), gate,
            torch.sigmoid(rand(1, seq_len, hv)), 0.3 * rand(2 * hk * dk + hv * dv, taps), rand(1, seq_len, hv, dv)]


def _step(mesh, tensors: list[torch.Tensor]) -> float:
    *inputs, weight, dout = tensors
    cpu = time.process_time()
    out = loongtrain.linear_attention(*inputs, mesh, conv_weight=weight)
    out.backward(dout)
    return time.process_time() - cpu


def _slowest(mesh, value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    if mesh.sp_group is not None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=mesh.sp_group)
    return float(t)


def _time_rank(rank: int, world: int, hp: int, cp: int, seq_len: int, rounds: int) -> list[tuple[float, float]]:
    torch.set_num_threads(1)
    mesh = loongtrain.init_mesh(hp=hp, cp=cp)
    full = [t.requires_grad_() if i < 6 else t for i, t in enumerate(_inputs(seq_len))]
    local = [loongtrain.shard_sequence(t.detach(), mesh, 1) if i not in (5,) else t.detach()
             for i, t in enumerate(full)]
    local = [t.requires_grad_() if i < 6 else t for i, t in enumerate(local)]
    _step(None, full), _step(mesh, local)  # warm-up
    rows = []
    for r in range(rounds):
        order = [("whole", None, full), ("sharded", mesh, local)]
        times = {}
        for name, m, tensors in (order if r % 2 == 0 else order[::-1]):
            times[name] = _slowest(mesh, _step(m, tensors))
        rows.append((times["sharded"], times["whole"]))
    return rows


def _bytes_rank(rank: int, world: int, hp: int, cp: int, lengths: list[int]) -> list[dict[str, int]]:
    torch.set_num_threads(1)
    mesh = loongtrain.init_mesh(hp=hp, cp=cp)
    counted = []
    for seq_len in lengths:
        tensors = _inputs(seq_len)
        local = [loongtrain.shard_sequence(t, mesh, 1) if i != 5 else t for i, t in enumerate(tensors)]
        local = [t.requires_grad_() if i < 5 else t for i, t in enumerate(local)]
        with CommCounter() as counter:
            _step(mesh, local)
        counted.append(dict(counter.bytes))
    return counted


def _summary(values: list[float]) -> str:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return f"{statistics.median(values):.3f} | {q[0]:.3f}-{q[2]:.3f} | {min(values):.3f}-{max(values):.3f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common(parser, rounds=9)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--hp", type=int, default=1)
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--bytes", action="store_true", help="count the bytes per layer at several lengths instead")
    parser.add_argument("--lengths", default="1024,4096,16384", help="sequence lengths of --bytes")
    args = parser.parse_args(argv)
    print(header())
    if args.bytes:
        lengths = [int(x) for x in args.lengths.split(",")]
        counted = loongtrain.run_local(_bytes_rank, args.world, args.hp, args.cp, lengths, backend="gloo",
                                       threads=1)[0]
        kinds = sorted({k for c in counted for k in c})
        print(f"| S (hp{args.hp} x cp{args.cp}, rank 0, one layer fwd+bwd) | " + " | ".join(kinds) + " |")
        print("|---:|" + "---:|" * len(kinds))
        for seq_len, c in zip(lengths, counted):
            print(f"| {seq_len} | " + " | ".join(f"{c.get(k, 0):,}" for k in kinds) + " |")
        return 0
    rows = loongtrain.run_local(_time_rank, args.world, args.hp, args.cp, args.seq_len, args.rounds,
                                backend="gloo", threads=1)[0]
    print("| ratio (CPU time of the slowest rank, sharded / whole sequence on one process) | median | quartiles "
          "| min-max |\n|---|---:|---:|---:|")
    print(f"| hp{args.hp} x cp{args.cp}, S={args.seq_len} | {_summary([a / b for a, b in rows])} |")
    print(f"(median CPU time of the whole-sequence step: {statistics.median(b for _, b in rows) * 1e3:.0f} ms; "
          f"a perfect split: {1 / (args.hp * args.cp):.3f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
