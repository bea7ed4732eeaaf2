"""Side-by-side timing of ``loongtrain.attention`` (forward + backward) for every (hp, cp) of a world.

Every config runs on ``--world`` local gloo processes (CPU, 1 torch thread per rank). Its limit is torch's
own ``scaled_dot_product_attention`` on the whole sequence (``enable_gqa`` when Hkv < H) in a process of its
own with all cores, measured right before the case (``benchmarks/timing.py``): this machine's speed drifts
by up to 1.5x within minutes, so a ratio only compares measurements taken side by side. Optional baselines,
when the ``bench`` extra is installed: DeepSpeed-Ulysses (``deepspeed.sequence.layer.DistributedAttention``
around a local SDPA attention) and ring-attention-pytorch (``ring_flash_attn``, striped ring), each again
right after its own limit measurement.

Method: ``--rounds`` rounds; a round measures, for every case in turn, the limit (fresh process) and then
the case (fresh spawn of ``--world`` ranks). A measurement is ``--warmup`` untimed iterations, then
``--iters`` timed iterations, each starting at a barrier and timed on the slowest rank; its value is the
median. A ratio is case / limit of the same round; the table shows the median over rounds and, with
several rounds, the min–max spread. Beside wall time the table gives CPU time (process time, summed over
ranks; for the limit, over its threads): CPU ratio - 1 is the extra work sharding adds (communication,
copies, merges), and it moves far less than wall time on a shared machine.

    .venv/bin/python -m benchmarks.attention                      # S=8192 H=8 D=64 fp32 causal, Hkv 8 and 2
    .venv/bin/python -m benchmarks.attention --seq-len 2048 --iters 3 --configs 1x4,2x2 --baselines none
    .venv/bin/python -m benchmarks.attention --write benchmarks/results/RESULTS.md

Configs are ``HPxCP`` (``2x2``) with an optional inner-ring size (``1x4w2``: a double ring of inner rings of 2);
the default is every
``hp x cp == world``. Every case runs in its own spawn, so a baseline that hangs or crashes is reported
in its row and cannot take the others with it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

import loongtrain
from benchmarks.timing import (
    DTYPES,
    LimitSpec,
    Timing,
    load_average,
    measure_limit,
    ms,
    random_bshd,
    ratios,
    spread,
    time_step,
    write_section,
)
from loongtrain.parallel.workers import run_local

BASELINES = ("deepspeed", "ring-attention-pytorch")
BASELINE_TITLES = {
    "deepspeed": "DeepSpeed-Ulysses",
    "ring-attention-pytorch": "ring-attention-pytorch",
}
SECTION = "benchmarks/attention.py against SDPA"


# ----------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    """One timed thing: ``kind`` is ``loongtrain`` or a baseline name."""

    kind: str
    kv_heads: int
    hp: int = 1
    cp: int = 1
    inner_ring: int = 1

    @property
    def label(self) -> str:
        if self.kind == "loongtrain":
            win = f" inner_ring={self.inner_ring}" if self.inner_ring > 1 else ""
            return f"loongtrain hp={self.hp} cp={self.cp}{win}"
        return BASELINE_TITLES.get(self.kind, self.kind)


@dataclass(frozen=True)
class Shape:
    seq_len: int
    heads: int
    head_dim: int
    batch: int
    dtype: str
    causal: bool

    def limit(self, kv_heads: int) -> LimitSpec:
        return LimitSpec(self.seq_len, self.heads, kv_heads, self.head_dim, self.dtype, self.causal, self.batch,
                         seed=1234 + kv_heads)


@dataclass
class Measured:
    """Per round, medians over the iterations (seconds) of the case and of its limit; or an error."""

    total: list[float] = field(default_factory=list)
    forward: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    limit: list[float] = field(default_factory=list)
    limit_cpu: list[float] = field(default_factory=list)
    error: str | None = None


def parse_configs(text: str, world: int) -> list[tuple[int, int, int]]:
    if text in ("", "all"):
        return [(hp, world // hp, 1) for hp in range(1, world + 1) if world % hp == 0]
    out = []
    for item in text.split(","):
        m = re.fullmatch(r"\s*(\d+)x(\d+)(?:w(\d+))?\s*", item)
        if not m:
            raise SystemExit(f"bad config {item!r}: expected HPxCP or HPxCPwWINDOW, e.g. 2x2 or 1x4w2")
        hp, cp, inner_ring = int(m[1]), int(m[2]), int(m[3] or 1)
        if hp * cp != world:
            raise SystemExit(f"config {item!r}: hp*cp = {hp * cp} must equal --world {world}")
        out.append((hp, cp, inner_ring))
    return out


# ----------------------------------------------------------------------------- per-rank bodies


def _full_inputs(shape: Shape, kv_heads: int) -> tuple[torch.Tensor, ...]:
    """The replica's full q, k, v, dout ``[B, S, heads, D]`` (the limit's inputs too), identical on every rank."""
    return random_bshd(shape.batch, shape.seq_len, shape.heads, kv_heads, shape.head_dim, shape.dtype,
                       seed=1234 + kv_heads)


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().requires_grad_()


def _make_step(fwd: Callable[[], torch.Tensor], dout: torch.Tensor, leaves: tuple[torch.Tensor, ...]):
    """A closure running forward + backward once; returns its forward wall seconds."""

    def step() -> float:
        for t in leaves:
            t.grad = None
        t0 = time.perf_counter()
        out = fwd()
        t1 = time.perf_counter()
        out.backward(dout)
        return t1 - t0

    return step


def _loongtrain_step(shape: Shape, case: Case):
    mesh = loongtrain.init_mesh(case.hp, case.cp, inner_ring=case.inner_ring)
    full = _full_inputs(shape, case.kv_heads)
    q, k, v, dout = (loongtrain.shard_sequence(t, mesh, 1).contiguous() for t in full)
    q, k, v = _leaf(q), _leaf(k), _leaf(v)
    return _make_step(lambda: loongtrain.attention(q, k, v, mesh, causal=shape.causal), dout, (q, k, v))


def _sdpa_bshd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """Local attention on ``[B, S, H, D]`` (KV heads may be fewer) via torch SDPA (CPU flash kernel)."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                           enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(1, 2)


def _deepspeed_step(shape: Shape, case: Case):
    """DeepSpeed-Ulysses: DistributedAttention (scatter heads, gather sequence) around local SDPA.
    Contiguous sequence shards: after its all-to-all every rank holds whole sequences."""
    import deepspeed
    from deepspeed.sequence.layer import DistributedAttention

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)  # wraps the existing process group
    rank, world = dist.get_rank(), dist.get_world_size()

    class LocalAttention(torch.nn.Module):
        def forward(self, q, k, v):
            return _sdpa_bshd(q, k, v, shape.causal)

    attn = DistributedAttention(LocalAttention(), dist.group.WORLD, scatter_idx=2, gather_idx=1)
    q, k, v, dout = (t.chunk(world, dim=1)[rank].contiguous() for t in _full_inputs(shape, case.kv_heads))
    q, k, v = _leaf(q), _leaf(k), _leaf(v)
    return _make_step(lambda: attn(q, k, v, 0), dout, (q, k, v))


def _ring_attention_pytorch_step(shape: Shape, case: Case):
    """ring-attention-pytorch ``ring_flash_attn`` (pure-PyTorch blockwise attention; K/V passed round the
    ring with isend/irecv) on striped shards (token ``i`` on rank ``i % world``), its load-balanced
    causal mode."""
    from ring_attention_pytorch import ring_flash_attn

    rank, world = dist.get_rank(), dist.get_world_size()
    q, k, v, dout = (t[:, rank::world].contiguous() for t in _full_inputs(shape, case.kv_heads))
    q, k, v = _leaf(q), _leaf(k), _leaf(v)
    bucket = min(1024, q.shape[1])
    return _make_step(
        lambda: ring_flash_attn(q, k, v, causal=shape.causal, bucket_size=bucket, ring_reduce_col=True,
                                striped_ring_attn=True, ring_size=world),
        dout, (q, k, v),
    )


STEP_BUILDERS = {
    "loongtrain": _loongtrain_step,
    "deepspeed": _deepspeed_step,
    "ring-attention-pytorch": _ring_attention_pytorch_step,
}


def rank_main(rank: int, world: int, shape: Shape, case: Case, iters: int, warmup: int) -> Timing:
    """One case on every rank of a fresh spawn."""
    return time_step(STEP_BUILDERS[case.kind](shape, case), iters, warmup, distributed=True)


# ----------------------------------------------------------------------------- measuring


def _short_error(exc: BaseException) -> str:
    text = [line for line in f"{type(exc).__name__}: {exc}".strip().splitlines() if line.strip()]
    return text[-1][:300] if text else type(exc).__name__


def measure(shape: Shape, world: int, cases: list[Case], rounds: dict[Case, int], iters: int, warmup: int,
            timeout: float, verbose: bool) -> dict[Case, Measured]:
    """Per round, per case: the limit in its own process, then the case on ``world`` fresh ranks."""
    results = {case: Measured() for case in cases}
    for r in range(max(rounds.values(), default=0)):
        for case in cases:
            res = results[case]
            if res.error or r >= rounds[case]:
                continue
            limit = measure_limit(shape.limit(case.kv_heads), iters, warmup, timeout)
            try:
                got = run_local(rank_main, world, shape, case, iters, warmup, backend="gloo", threads=1,
                                timeout=timeout)[0]
            except (RuntimeError, TimeoutError) as exc:  # WorkerError is a RuntimeError
                res.error = _short_error(exc)
                continue
            total, fwd, cpu = got.medians()
            res.total.append(total)
            res.forward.append(fwd)
            res.cpu.append(cpu)
            res.limit.append(statistics.median(limit.total))
            res.limit_cpu.append(statistics.median(limit.cpu))
            if verbose:
                print(f"[round {r}] Hkv={case.kv_heads} {case.label}: {ms(total)} ms, limit {ms(res.limit[-1])} "
                      f"ms (load {load_average():.2f})", file=sys.stderr, flush=True)
    return results


# ----------------------------------------------------------------------------- report


def render(command: str, shape: Shape, world: int, kv_list: list[int], results: dict[Case, Measured],
           rounds: int, iters: int, warmup: int, load: tuple[float, float], notes: list[str]) -> str:
    mask = "causal" if shape.causal else "full"
    cpus = os.cpu_count()
    lines = [
        f"### attention forward+backward against plain SDPA: S={shape.seq_len}, H={shape.heads}, "
        f"D={shape.head_dim}, B={shape.batch}, {shape.dtype}, {mask}, world={world}",
        "",
        "```",
        command,
        "```",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; torch {torch.__version__}, {cpus} CPUs; world "
        f"{world} gloo ranks x 1 thread; limit: torch SDPA on the whole sequence in its own process x {cpus} "
        f"threads, measured right before each case; {rounds} round(s) x {iters} timed iters (warmup {warmup}); "
        f"load average at start {load[0]:.2f}, at end {load[1]:.2f}.",
        "Median ms: forward+backward wall time (slowest rank), per-round median, median over rounds "
        "(spread: min–max of the round medians). Ratio: case / its limit of the same round. CPU ms: process "
        "CPU time summed over ranks; CPU ratio: against the limit's CPU time of the same round.",
        "",
        "| Hkv | config | median ms | spread ms | fwd ms | limit ms | limit spread | ratio vs SDPA "
        "| ratio spread | CPU ms | CPU ratio |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for kv in kv_list:
        for case, res in results.items():
            if case.kv_heads != kv:
                continue
            if res.error or not res.total:
                err = (res.error or "no measurement").replace("|", "\\|")
                lines.append(f"| {kv} | {case.label} | — | | | | | error: {err} | | | |")
                continue
            rs, cs = ratios(res.total, res.limit), ratios(res.cpu, res.limit_cpu)
            lines.append(
                f"| {kv} | {case.label} | {ms(statistics.median(res.total))} | {spread(res.total, ms)} | "
                f"{ms(statistics.median(res.forward))} | {ms(statistics.median(res.limit))} | "
                f"{spread(res.limit, ms)} | {statistics.median(rs):.2f}x | {spread(rs, lambda x: f'{x:.2f}')} | "
                f"{ms(statistics.median(res.cpu))} | {statistics.median(cs):.2f}x |"
            )
    lines += [""] + [f"- {n}" for n in notes]
    return "\n".join(lines).rstrip() + "\n"


# ----------------------------------------------------------------------------- main


def baseline_available(name: str) -> str | None:
    """None if importable, else the import error."""
    module = {"deepspeed": "deepspeed.sequence.layer",
              "ring-attention-pytorch": "ring_attention_pytorch"}[name]
    try:
        __import__(module)
    except Exception as exc:  # noqa: BLE001 - reported in the table
        return f"not installed ({_short_error(exc)})"
    return None


def _baselines(text: str) -> tuple[list[str], list[str]]:
    """The baselines to run and notes about those skipped."""
    if text == "none":
        return [], []
    wanted = list(BASELINES) if text == "all" else [b.strip() for b in text.split(",")]
    if unknown := [b for b in wanted if b not in BASELINES]:
        raise SystemExit(f"unknown baselines {unknown}; choose from {BASELINES}")
    run, notes = [], []
    for name in wanted:
        missing = baseline_available(name)
        if missing and text == "all":
            notes.append(f"{BASELINE_TITLES[name]}: {missing}; skipped")
        else:
            run.append(name)
    return run, notes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=lambda s: [int(x) for x in s.split(",")], default=[8, 2],
                   help="comma-separated list (default 8,2)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--no-causal", dest="causal", action="store_false")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--iters", type=int, default=5, help="timed iterations per case and round")
    p.add_argument("--warmup", type=int, default=1, help="untimed iterations before each measurement")
    p.add_argument("--rounds", type=int, default=2,
                   help="repeat every (limit, case) pair; the table shows median and spread over rounds")
    p.add_argument("--baseline-rounds", type=int, default=1,
                   help="rounds for the baselines (ring-attention-pytorch is slow on CPU)")
    p.add_argument("--configs", default="all", help="HPxCP[wWINDOW],... (default: every hp*cp == world)")
    p.add_argument("--baselines", default="all",
                   help=f"comma-separated from {','.join(BASELINES)}, or 'all' (those installed) or 'none'")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before a spawn counts as hung")
    p.add_argument("--write", type=Path, help="also write the table as a section of this markdown file")
    p.add_argument("--json", type=Path, help="also write every case's per-round seconds here (plan_check.py local)")
    p.add_argument("-v", "--verbose", action="store_true", help="per-round timings on stderr")
    a = p.parse_args(argv)

    command = "python " + " ".join(shlex.quote(x) for x in [os.path.relpath(__file__, Path.cwd()),
                                                           *(sys.argv[1:] if argv is None else argv)])
    print(command, flush=True)
    shape = Shape(a.seq_len, a.heads, a.head_dim, a.batch, a.dtype, a.causal)
    baselines, notes = _baselines(a.baselines)
    cases = [Case("loongtrain", kv, hp, cp, w) for kv in a.kv_heads for hp, cp, w in parse_configs(a.configs, a.world)]
    cases += [Case(name, kv) for kv in a.kv_heads for name in baselines]
    rounds = {c: a.rounds if c.kind == "loongtrain" else a.baseline_rounds for c in cases}
    load_start = load_average()
    results = measure(shape, a.world, cases, rounds, a.iters, a.warmup, a.timeout, a.verbose)
    text = render(command, shape, a.world, a.kv_heads, results, a.rounds, a.iters, a.warmup,
                  (load_start, load_average()), notes)
    print(text)
    if a.write:
        write_section(a.write, SECTION, text)
        print(f"(written to {a.write})")
    if a.json:
        a.json.write_text(json.dumps({
            "command": command, "world": a.world, "shape": dataclasses.asdict(shape),
            "cases": [dict(dataclasses.asdict(c), total_s=r.total, forward_s=r.forward, cpu_s=r.cpu,
                           limit_s=r.limit, error=r.error) for c, r in results.items()],
        }, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
