"""Packed documents and sliding windows through ``loongtrain.attention`` (forward + backward), CPU gloo ranks.

Documents: one packed row of lognormal lengths (``--median``, shape ``--sigma``, ``--seed``; stated in the
output, :func:`loongtrain.plan.document_work.lognormal_documents`). Cases, each on ``--world`` ranks
(1 thread per rank) for every ``hp x cp`` of the world unless ``--configs``:

- ``docs``: causal attention inside each document, zigzag layout (the default);
- ``docs-balanced``: the same on :func:`loongtrain.balanced_chunk_order`'s layout;
- ``causal``: full causal attention of the same sequence (``docs`` should be faster by about the
  visible fraction);
- ``window``: a ``--window`` sliding window, no documents (time and ring bytes against ``causal``).

Each case is compared with its limit (``benchmarks/timing.py``): torch's own SDPA in a process of its own
with every core, measured right before the case: each document alone for ``docs*``, the whole sequence
for ``causal``, query blocks with a window mask for ``window`` (SDPA has no window argument). Rounds
repeat every (limit, case) pair; tables give medians over rounds and min–max spreads. Ring bytes: K/V and
dK/dV bytes one call sends (forward + backward), the most over ranks
(:class:`~loongtrain.parallel.comm.CommCounter`). Work: visible (query, key) pairs per context rank,
max / mean (:func:`loongtrain.parallel.documents.rank_work`).

    .venv/bin/python -m benchmarks.documents                       # S=16384 H=8 D=64 fp32, world 4
    .venv/bin/python -m benchmarks.documents --tiny                # seconds: the smoke test's run
    .venv/bin/python -m benchmarks.documents --rounds 2 --write benchmarks/results/RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

import loongtrain
from benchmarks.common import add_common
from benchmarks.timing import (
    LimitSpec,
    load_average,
    measure_limit,
    ms,
    random_bshd,
    ratios,
    spread,
    time_step,
    write_section,
)
from loongtrain.parallel.comm import CommCounter
from loongtrain.parallel.documents import balanced_chunk_order, rank_work, visible_pairs
from loongtrain.parallel.workers import run_local
from loongtrain.plan.document_work import imbalance, lognormal_documents

CASES = ("docs", "docs-balanced", "causal", "window")
SECTION = "benchmarks/documents.py"


@dataclass(frozen=True)
class Setup:
    seq_len: int
    heads: int
    head_dim: int
    world: int
    median: int
    sigma: float
    seed: int
    window: int
    iters: int
    warmup: int
    causal_iters: int

    def iterations(self, case: str) -> int:
        return self.causal_iters if case == "causal" else self.iters

    def documents(self) -> list[int]:
        return lognormal_documents(self.seq_len, self.median, self.sigma, self.seed)

    def limit(self, case: str) -> LimitSpec:
        docs = tuple(self.documents()) if case.startswith("docs") else None
        window = self.window if case == "window" else None
        return LimitSpec(self.seq_len, self.heads, self.heads, self.head_dim, cu_seqlens=docs,
                         sliding_window=window, seed=7)

    def order(self, case: str, hp: int, cp: int) -> tuple[int, ...] | None:
        return balanced_chunk_order([self.documents()], self.seq_len, cp, hp) if case == "docs-balanced" else None

    def work(self, case: str, hp: int, cp: int) -> tuple[float, float]:
        """(visible fraction of causal attention's pairs, per-rank work max/mean) of ``case``."""
        docs = [self.documents()] if case.startswith("docs") else None
        window = self.window if case == "window" else None
        pairs = visible_pairs(docs[0] if docs else None, self.seq_len, sliding_window=window)
        per_rank = rank_work(docs, self.seq_len, cp, chunk_order=self.order(case, hp, cp), sliding_window=window)
        return pairs / visible_pairs(None, self.seq_len), imbalance(per_rank)


def rank_main(rank: int, world: int, setup: Setup, hp: int, cp: int, case: str) -> dict:
    """One case on every rank: its timing and the ring bytes this rank sends per call."""
    mesh = loongtrain.init_mesh(hp, cp)
    order = setup.order(case, hp, cp)
    kw = {"cu_seqlens": torch.tensor(setup.documents())} if case.startswith("docs") else {}
    if case == "window":
        kw["sliding_window"] = setup.window
    full = random_bshd(1, setup.seq_len, setup.heads, setup.heads, setup.head_dim, "float32", seed=7)
    q, k, v, dout = (loongtrain.shard_sequence(t, mesh, 1, order).contiguous() for t in full)
    leaves = [t.requires_grad_() for t in (q, k, v)]

    def step() -> float:
        for t in leaves:
            t.grad = None
        t0 = time.perf_counter()
        out = loongtrain.attention(*leaves, mesh, chunk_order=order, **kw)
        fwd = time.perf_counter() - t0
        out.backward(dout)
        return fwd

    with CommCounter() as counter:  # the bytes of one call; it doubles as the first warmup iteration
        step()
    timing = time_step(step, setup.iterations(case), max(0, setup.warmup - 1), distributed=True)
    return {"timing": timing, "ring_bytes": counter.bytes["kv"] + counter.bytes["dkv"]}


@dataclass
class Row:
    """One (config, case): per-round medians of the limit and the case (seconds)."""

    hp: int
    cp: int
    case: str
    visible_fraction: float
    work_imbalance: float
    limit: list[float] = field(default_factory=list)
    time: list[float] = field(default_factory=list)
    ring_bytes: int = 0


def measure(setup: Setup, configs: list[tuple[int, int]], cases: list[str], rounds: int,
            verbose: bool) -> list[Row]:
    rows = {(hp, cp, c): Row(hp, cp, c, *setup.work(c, hp, cp)) for hp, cp in configs for c in cases}
    for r in range(rounds):
        for (hp, cp, case), row in rows.items():
            limit = measure_limit(setup.limit(case), setup.iterations(case), setup.warmup)  # right before the case
            got = run_local(rank_main, setup.world, setup, hp, cp, case, backend="gloo", timeout=3600)
            row.limit.append(statistics.median(limit.total))
            row.time.append(statistics.median(got[0]["timing"].total))
            row.ring_bytes = max(g["ring_bytes"] for g in got)
            if verbose:
                print(f"[round {r}] {hp}x{cp} {case}: limit {ms(row.limit[-1])} ms, "
                      f"loongtrain {ms(row.time[-1])} ms (load {load_average():.2f})", file=sys.stderr, flush=True)
    return list(rows.values())


def render(command: str, setup: Setup, rows: list[Row], rounds: int, load: tuple[float, float]) -> str:
    docs = setup.documents()
    lengths = [e - s for s, e in zip(docs, docs[1:])]
    lines = [
        f"### packed documents and sliding window: S={setup.seq_len}, H={setup.heads}, D={setup.head_dim}, "
        f"fp32, causal, world={setup.world}",
        "",
        "```",
        command,
        "```",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; torch {torch.__version__}, {os.cpu_count()} CPUs; "
        f"{setup.world} gloo ranks x 1 thread; limit: torch SDPA in its own process x {os.cpu_count()} threads, "
        f"measured right before each case; {rounds} round(s) x {setup.iters} timed iters ({setup.causal_iters} for "
        f"causal; warmup {setup.warmup} in every fresh process); "
        f"load average at start {load[0]:.2f}, at end {load[1]:.2f}.",
        f"Documents: {len(lengths)} of lognormal length (median {setup.median}, sigma {setup.sigma}, seed "
        f"{setup.seed}; the last cut at S): min {min(lengths)}, median {statistics.median(lengths):.0f}, "
        f"max {max(lengths)}. Window case: w={setup.window}, no documents.",
        "Times: forward+backward ms, slowest rank, median over iterations, then median (and min–max) over "
        "rounds. Ratio: loongtrain / its limit of the same round. Speedup: causal / case, same config and "
        "round (loongtrain; and for the limits). Visible: the case's visible (q, k) pairs / causal's. "
        "Work max/mean: visible pairs per context rank. Ring MiB: K/V + dK/dV bytes one call sends (most "
        "over ranks).",
        "",
        "| hp x cp | case | visible | work max/mean | limit ms | limit spread | loongtrain ms | spread "
        "| ratio | ratio spread | speedup vs causal | 1 / visible | limit speedup | ring MiB |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    by_key = {(r.hp, r.cp, r.case): r for r in rows}
    for row in rows:
        rs = ratios(row.time, row.limit)
        causal = by_key.get((row.hp, row.cp, "causal"))
        speed = lim_speed = ideal = ""
        if causal is not None and row.case != "causal":
            speed = f"{statistics.median(ratios(causal.time, row.time)):.2f}x"
            lim_speed = f"{statistics.median(ratios(causal.limit, row.limit)):.2f}x"
            ideal = f"{1 / row.visible_fraction:.2f}x"
        lines.append(
            f"| {row.hp}x{row.cp} | {row.case} | {row.visible_fraction:.3f} | {row.work_imbalance:.2f} | "
            f"{ms(statistics.median(row.limit))} | {spread(row.limit, ms)} | {ms(statistics.median(row.time))} | "
            f"{spread(row.time, ms)} | {statistics.median(rs):.2f}x | {spread(rs, lambda x: f'{x:.2f}')} | "
            f"{speed} | {ideal} | {lim_speed} | {row.ring_bytes / 2**20:.1f} |")
    return "\n".join(lines) + "\n"


def _configs(text: str, world: int) -> list[tuple[int, int]]:
    if text == "all":
        return [(hp, world // hp) for hp in range(1, world + 1) if world % hp == 0]
    out = []
    for item in text.split(","):
        hp, _, cp = item.partition("x")
        if not (hp.isdigit() and cp.isdigit()) or int(hp) * int(cp) != world:
            raise SystemExit(f"config {item!r}: expected HPxCP with hp*cp == --world {world}, e.g. 2x2")
        out.append((int(hp), int(cp)))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--median", type=int, default=1024, help="median document length (lognormal)")
    p.add_argument("--sigma", type=float, default=1.0, help="lognormal shape of the document lengths")
    add_common(p, seed=0)
    p.add_argument("--window", type=int, default=1024, help="sliding window of the 'window' case")
    p.add_argument("--iters", type=int, default=3, help="timed iterations per case and round")
    p.add_argument("--causal-iters", type=int, help="timed iterations of the (slow) causal case (default: --iters)")
    p.add_argument("--warmup", type=int, default=1)
    add_common(p, rounds=2)
    p.add_argument("--configs", default="all", help="HPxCP,... (default: every hp*cp == world)")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated from {','.join(CASES)}")
    p.add_argument("--tiny", action="store_true",
                   help="S=512 H=4 D=16, median 64, window 64, 1 iter, 1 round (a smoke run)")
    p.add_argument("--write", type=Path, help="also write the table as a section of this markdown file")
    p.add_argument("--json", type=Path, help="also write every row's per-round seconds here")
    p.add_argument("-v", "--verbose", action="store_true", help="per-round timings on stderr")
    a = p.parse_args(argv)
    if a.tiny:
        a.seq_len, a.heads, a.head_dim, a.median, a.window, a.iters, a.warmup, a.rounds = 512, 4, 16, 64, 64, 1, 0, 1
    cases = [c.strip() for c in a.cases.split(",")]
    if unknown := [c for c in cases if c not in CASES]:
        raise SystemExit(f"unknown cases {unknown}; choose from {CASES}")
    setup = Setup(a.seq_len, a.heads, a.head_dim, a.world, a.median, a.sigma, a.seed, a.window, a.iters, a.warmup,
                  a.iters if a.causal_iters is None else a.causal_iters)
    command = "python " + " ".join(shlex.quote(x) for x in [os.path.relpath(__file__, Path.cwd()),
                                                           *(sys.argv[1:] if argv is None else argv)])
    print(command, flush=True)
    load_start = load_average()
    rows = measure(setup, _configs(a.configs, a.world), cases, a.rounds, a.verbose)
    text = render(command, setup, rows, a.rounds, (load_start, load_average()))
    print(text)
    if a.write:
        write_section(a.write, SECTION, text)
        print(f"(written to {a.write})")
    if a.json:
        a.json.write_text(json.dumps({"command": command, "setup": asdict(setup),
                                      "rows": [asdict(r) for r in rows]}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
