"""Side-by-side timing of ``loongtrain.attention`` (forward + backward) for every (hp, cp) of a world.

Every config runs on ``--world`` local gloo processes (CPU, 1 torch thread per rank). The reference is
one process running the whole, unsharded attention with all cores (``torch.set_num_threads(os.cpu_count())``)
through the same kernel (``loongtrain.attention`` with ``mesh=None``). Optional baselines, when the
``bench`` extra is installed: DeepSpeed-Ulysses (``deepspeed.sequence.layer.DistributedAttention`` around a
local SDPA attention) and ring-attention-pytorch (``ring_flash_attn``, striped ring).

Method: all ranks of one spawn run the cases in rounds (``--rounds``); a round measures the single process
(on rank 0, the other ranks idle in a barrier) and then every distributed case, so each ratio compares
measurements taken side by side. A distributed measurement is ``--warmup`` untimed iterations, then
``--iters`` iterations, each preceded by a barrier and timed as the max over ranks (all_reduce MAX); its
value is the median. A ratio is case median / single-process median of the same round; the table shows the
median over rounds and, when there are several rounds, the min-max spread. Beside wall time the table gives
CPU time (``time.process_time`` per iteration, summed over ranks; for the single process, over its threads):
on a shared machine it moves far less than wall time, and CPU ratio - 1 is the extra work that sharding adds
(communication, copies, merges). ``--single-1thread`` adds a 1-thread single-process row, the pure-work
reference.

    .venv/bin/python benchmarks/attention.py                      # S=8192 H=8 D=64 fp32 causal, Hkv 8 and 2
    .venv/bin/python benchmarks/attention.py --seq-len 2048 --iters 3 --configs 1x4,2x2 --baselines none
    .venv/bin/python benchmarks/attention.py --write benchmarks/RESULTS.md

Configs are ``HPxCP`` (``2x2``) with an optional double-ring window (``1x4w2``); the default is every
``hp x cp == world``. Baselines run in their own spawns (so one that hangs or crashes cannot take the
loongtrain measurements with it), each again beside the single process.
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
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere; spawned children re-import this module
    sys.path.insert(0, str(ROOT))

import loongtrain  # noqa: E402
from loongtrain.parallel.launch import run_local  # noqa: E402

BASELINES = ("deepspeed", "ring-attention-pytorch")
BASELINE_TITLES = {
    "deepspeed": "DeepSpeed-Ulysses",
    "ring-attention-pytorch": "ring-attention-pytorch",
}
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "float64": torch.float64, "fp64": torch.float64}
SECTION_BEGIN = "<!-- benchmarks/attention.py: begin -->"
SECTION_END = "<!-- benchmarks/attention.py: end -->"


# ----------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    """One timed thing: ``kind`` is ``single``, ``loongtrain`` or a baseline name."""

    kind: str
    kv_heads: int
    hp: int = 1
    cp: int = 1
    window: int = 1

    @property
    def label(self) -> str:
        if self.kind == "single":
            return "single process (all cores)"
        if self.kind == "single1":
            return "single process (1 thread)"
        if self.kind == "loongtrain":
            win = f" window={self.window}" if self.window > 1 else ""
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


@dataclass
class Measured:
    """Per round, medians over the iterations (seconds): forward+backward wall time (max over ranks),
    forward wall time (max over ranks) and CPU time (process time, summed over ranks); or an error."""

    total: list[float] = field(default_factory=list)
    forward: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    error: str | None = None
    reference: list[float] | None = None  # single-process totals of the same rounds, if not this table's
    reference_cpu: list[float] | None = None


def parse_configs(text: str, world: int) -> list[tuple[int, int, int]]:
    if text in ("", "all"):
        return [(hp, world // hp, 1) for hp in range(1, world + 1) if world % hp == 0]
    out = []
    for item in text.split(","):
        m = re.fullmatch(r"\s*(\d+)x(\d+)(?:w(\d+))?\s*", item)
        if not m:
            raise SystemExit(f"bad config {item!r}: expected HPxCP or HPxCPwWINDOW, e.g. 2x2 or 1x4w2")
        hp, cp, window = int(m[1]), int(m[2]), int(m[3] or 1)
        if hp * cp != world:
            raise SystemExit(f"config {item!r}: hp*cp = {hp * cp} must equal --world {world}")
        out.append((hp, cp, window))
    return out


# ----------------------------------------------------------------------------- per-rank bodies


def _full_inputs(shape: Shape, kv_heads: int) -> tuple[torch.Tensor, ...]:
    """The replica's full q, k, v, dout ``[B, S, heads, D]``, identical on every rank."""
    g = torch.Generator().manual_seed(1234 + kv_heads)
    dtype = DTYPES[shape.dtype]
    b, s, d = shape.batch, shape.seq_len, shape.head_dim
    q = torch.randn(b, s, shape.heads, d, generator=g).to(dtype)
    k = torch.randn(b, s, kv_heads, d, generator=g).to(dtype)
    v = torch.randn(b, s, kv_heads, d, generator=g).to(dtype)
    dout = torch.randn(b, s, shape.heads, d, generator=g).to(dtype)
    return q, k, v, dout


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().requires_grad_()


def _make_step(fwd: Callable[[], torch.Tensor], dout: torch.Tensor, leaves: tuple[torch.Tensor, ...]):
    """A closure running forward + backward once; returns (forward wall s, forward+backward CPU s)."""

    def step() -> tuple[float, float]:
        for t in leaves:
            t.grad = None
        c0 = time.process_time()
        t0 = time.perf_counter()
        out = fwd()
        t1 = time.perf_counter()
        out.backward(dout)
        return t1 - t0, time.process_time() - c0

    return step


def _single_step(shape: Shape, kv_heads: int):
    q, k, v, dout = _full_inputs(shape, kv_heads)
    q, k, v = _leaf(q), _leaf(k), _leaf(v)
    return _make_step(lambda: loongtrain.attention(q, k, v, None, causal=shape.causal), dout, (q, k, v))


_MESHES: dict[tuple[int, int, int], loongtrain.Mesh] = {}


def _loongtrain_step(shape: Shape, case: Case):
    key = (case.hp, case.cp, case.window)
    if key not in _MESHES:  # one mesh per grid: each init_mesh creates gloo groups (and their threads)
        _MESHES[key] = loongtrain.init_mesh(case.hp, case.cp, window=case.window)
    mesh = _MESHES[key]
    full = _full_inputs(shape, case.kv_heads)
    q, k, v, dout = (loongtrain.shard_sequence(t, mesh, 1).contiguous() for t in full)
    q, k, v = _leaf(q), _leaf(k), _leaf(v)
    return _make_step(lambda: loongtrain.attention(q, k, v, mesh, causal=shape.causal), dout, (q, k, v))


def _sdpa_bshd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """Local attention on ``[B, S, H, D]`` (KV heads may be fewer) via torch SDPA (CPU flash kernel)."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
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


def _time_distributed(step, iters: int, warmup: int) -> tuple[float, float, float]:
    """Medians over ``iters`` of: forward+backward and forward wall time (max over ranks), CPU time (sum)."""
    for _ in range(warmup):
        step()
    totals, forwards, cpus = [], [], []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        fwd, cpu = step()
        t = torch.tensor([time.perf_counter() - t0, fwd], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        c = torch.tensor([cpu], dtype=torch.float64)
        dist.all_reduce(c, op=dist.ReduceOp.SUM)
        totals.append(t[0].item())
        forwards.append(t[1].item())
        cpus.append(c.item())
    return statistics.median(totals), statistics.median(forwards), statistics.median(cpus)


def _time_single(step, iters: int, warmup: int) -> tuple[float, float, float]:
    for _ in range(warmup):
        step()
    totals, forwards, cpus = [], [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        fwd, cpu = step()
        totals.append(time.perf_counter() - t0)
        forwards.append(fwd)
        cpus.append(cpu)
    return statistics.median(totals), statistics.median(forwards), statistics.median(cpus)


def _run_agreed(fn: Callable, verbose: bool, rank: int) -> tuple[Any, str | None]:
    """Run ``fn`` on every rank; if any rank fails, all get the same short error (reported, no hang)."""
    result, err = None, None
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001 - reported in the table
        err = _short_error(exc)
        if verbose and rank == 0:
            traceback.print_exc()
    return result, _agree_on_error(err)


def _agree_on_error(err: str | None) -> str | None:
    """All ranks learn whether any rank failed (so none waits in a collective the others skipped)."""
    flag = torch.tensor([1.0 if err else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() and not err:
        return "failed on another rank"
    return err


def _short_error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


def rank_main(rank: int, world: int, shape: Shape, cases: list[Case], rounds: int, iters: int,
              warmup: int, single_warmup: int, verbose: bool) -> dict[Case, Measured]:
    """Runs on every rank; rank 0's return value is the result."""
    results = {case: Measured() for case in cases}
    steps: dict[Case, Callable] = {}
    for case in cases:  # build every case once (groups, inputs): same order on all ranks
        if case.kind in ("single", "single1"):
            continue
        step, err = _run_agreed(lambda c=case: STEP_BUILDERS[c.kind](shape, c), verbose, rank)
        if err:
            results[case].error = err
        else:
            steps[case] = step
    for r in range(rounds):
        for case in cases:
            res = results[case]
            if res.error:
                continue
            if case.kind in ("single", "single1"):
                total = fwd = cpu = None
                if rank == 0:
                    torch.set_num_threads((os.cpu_count() or 1) if case.kind == "single" else 1)
                    try:
                        step = _single_step(shape, case.kv_heads)
                        total, fwd, cpu = _time_single(step, iters, single_warmup)
                    finally:
                        torch.set_num_threads(1)
                dist.barrier()
            else:
                n_warm = warmup if r == 0 else min(warmup, 1)
                timed, err = _run_agreed(
                    lambda c=case, w=n_warm: _time_distributed(steps[c], iters, w), verbose, rank)
                if err:
                    res.error = err
                    continue
                total, fwd, cpu = timed
            if rank == 0:
                res.total.append(total)
                res.forward.append(fwd)
                res.cpu.append(cpu)
                if verbose:
                    print(f"[round {r}] Hkv={case.kv_heads} {case.label}: {total * 1e3:.1f} ms "
                          f"(fwd {fwd * 1e3:.1f}, cpu {cpu * 1e3:.1f})", file=sys.stderr, flush=True)
    return results


# ----------------------------------------------------------------------------- spawning


def spawn(world: int, args: tuple, timeout: float) -> dict[Case, Measured]:
    """Run :func:`rank_main` on ``world`` fresh gloo processes (1 thread each); rank 0's results.

    A failing rank or a run longer than ``timeout`` seconds raises RuntimeError."""
    try:
        return run_local(rank_main, world, *args, backend="gloo", threads=1, timeout=timeout)[0]
    except TimeoutError as exc:
        raise RuntimeError(str(exc)) from exc


# ----------------------------------------------------------------------------- report


def _ms(x: float) -> str:
    return f"{x * 1e3:.0f}" if x >= 0.1 else f"{x * 1e3:.1f}"


def _spread(values: list[float], fmt: Callable[[float], str]) -> str:
    return f"{fmt(min(values))}–{fmt(max(values))}" if len(values) > 1 else ""


def render(command: str, shape: Shape, world: int, kv_list: list[int], results: dict[Case, Measured],
           rounds: int, iters: int, warmup: int, load: tuple[tuple[float, ...], tuple[float, ...]],
           notes: list[str]) -> str:
    mask = "causal" if shape.causal else "full"
    lines = [
        f"### attention forward+backward: S={shape.seq_len}, H={shape.heads}, D={shape.head_dim}, "
        f"B={shape.batch}, {shape.dtype}, {mask}, world={world}",
        "",
        "```",
        command,
        "```",
        "",
        f"torch {torch.__version__}, {os.cpu_count()} CPUs; world {world} gloo ranks x 1 thread vs one "
        f"process x {os.cpu_count()} threads; {rounds} round(s) x {iters} timed iters (warmup {warmup}); "
        f"load average at start {load[0][0]:.2f}, at end {load[1][0]:.2f}.",
        "Median ms: forward+backward wall time (max over ranks), per-round median, median over rounds "
        "(spread: min–max of the round medians). Ratio: case / single process (all cores) of the same "
        "round. CPU ms: process CPU time summed over ranks (less sensitive to a busy machine than wall "
        "time); CPU ratio: against the single process of the same round.",
        "",
        "| Hkv | config | median ms | spread ms | fwd ms | ratio vs single | ratio spread | CPU ms "
        "| CPU ratio |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for kv in kv_list:
        single = next((r for c, r in results.items() if c.kind == "single" and c.kv_heads == kv), None)
        for case, res in results.items():
            if case.kv_heads != kv:
                continue
            if res.error or not res.total:
                err = (res.error or "no measurement").replace("|", "\\|")
                lines.append(f"| {kv} | {case.label} | — | | | error: {err} | | | |")
                continue
            ratio, ratio_spread = "", ""
            ref = res.reference if res.reference is not None else (single.total if single else [])
            ref_cpu = res.reference_cpu if res.reference is not None else (single.cpu if single else [])
            cpu_ratio = ""
            if ref and case.kind != "single":
                rs = [c / s for c, s in zip(res.total, ref, strict=False)]
                ratio = f"{statistics.median(rs):.2f}x"
                ratio_spread = _spread(rs, lambda x: f"{x:.2f}")
                cs = [c / s for c, s in zip(res.cpu, ref_cpu or [], strict=False)]
                cpu_ratio = f"{statistics.median(cs):.2f}x" if cs else ""
            elif case.kind == "single":
                ratio = cpu_ratio = "1.00x"
            lines.append(
                f"| {kv} | {case.label} | {_ms(statistics.median(res.total))} | {_spread(res.total, _ms)} | "
                f"{_ms(statistics.median(res.forward))} | {ratio} | {ratio_spread} | "
                f"{_ms(statistics.median(res.cpu))} | {cpu_ratio} |"
            )
    lines += [""] + [f"- {n}" for n in notes]
    return "\n".join(lines).rstrip() + "\n"


def write_section(path: Path, text: str) -> None:
    """Put ``text`` between this script's markers in ``path`` (replacing an earlier section, else append)."""
    block = f"{SECTION_BEGIN}\n{text}{SECTION_END}\n"
    old = path.read_text() if path.exists() else ""
    if SECTION_BEGIN in old and SECTION_END in old:
        head, rest = old.split(SECTION_BEGIN, 1)
        tail = rest.split(SECTION_END, 1)[1].lstrip("\n")
        new = head + block + tail
    else:
        new = (old.rstrip("\n") + "\n\n" if old.strip() else "") + block
    path.write_text(new)


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
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations before a case's first round")
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat the whole side-by-side sequence; table shows median and spread over rounds")
    p.add_argument("--baseline-rounds", type=int, default=1,
                   help="rounds for the baselines' spawns (ring-attention-pytorch is slow on CPU)")
    p.add_argument("--configs", default="all", help="HPxCP[wWINDOW],... (default: every hp*cp == world)")
    p.add_argument("--baselines", default="all",
                   help=f"comma-separated from {','.join(BASELINES)}, or 'all' (those installed) or 'none'")
    p.add_argument("--single-1thread", action="store_true",
                   help="also time the single process with 1 thread (CPU-time reference for overheads)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before a spawn counts as hung")
    p.add_argument("--write", type=Path, help="also write the table as a section of this markdown file")
    p.add_argument("--json", type=Path, help="also write every case's per-round seconds here (plan_check.py local)")
    p.add_argument("-v", "--verbose", action="store_true", help="per-round timings and tracebacks on stderr")
    a = p.parse_args(argv)

    command = "python " + " ".join(shlex.quote(x) for x in [os.path.relpath(__file__, Path.cwd()),
                                                           *(sys.argv[1:] if argv is None else argv)])
    print(command, flush=True)
    shape = Shape(a.seq_len, a.heads, a.head_dim, a.batch, a.dtype, a.causal)
    configs = parse_configs(a.configs, a.world)
    if a.baselines == "none":
        baselines, notes = [], []
    else:
        wanted = list(BASELINES) if a.baselines == "all" else [b.strip() for b in a.baselines.split(",")]
        unknown = [b for b in wanted if b not in BASELINES]
        if unknown:
            raise SystemExit(f"unknown baselines {unknown}; choose from {BASELINES}")
        baselines, notes = [], []
        for name in wanted:
            missing = baseline_available(name)
            if missing and a.baselines == "all":
                notes.append(f"{BASELINE_TITLES[name]}: {missing}; skipped")
            else:
                baselines.append(name)

    load_start = os.getloadavg()
    cases = []
    for kv in a.kv_heads:
        cases.append(Case("single", kv))
        if a.single_1thread:
            cases.append(Case("single1", kv))
        cases += [Case("loongtrain", kv, hp, cp, w) for hp, cp, w in configs]
    run_args = (shape, cases, a.rounds, a.iters, a.warmup, 1, a.verbose)
    results = spawn(a.world, run_args, a.timeout)

    for name in baselines:  # own spawn each, again beside the single process
        b_cases = [c for kv in a.kv_heads for c in (Case("single", kv), Case(name, kv))]
        try:
            b_args = (shape, b_cases, a.baseline_rounds, a.iters, a.warmup, 1, a.verbose)
            b_res = spawn(a.world, b_args, a.timeout)
        except RuntimeError as exc:
            b_res = {c: Measured(error=str(exc).strip().splitlines()[-1][:300]) for c in b_cases}
        for kv in a.kv_heads:
            base = b_res[Case(name, kv)]
            base.reference = b_res[Case("single", kv)].total  # its ratio: beside its own single process
            base.reference_cpu = b_res[Case("single", kv)].cpu
            results[Case(name, kv)] = base
            if base.total:
                notes.append(f"{BASELINE_TITLES[name]} Hkv={kv} ran in its own spawn; the single process "
                             f"beside it: {_ms(statistics.median(base.reference))} ms")

    # order rows: per Hkv, single, loongtrain configs, baselines
    ordered = {c: results[c] for kv in a.kv_heads for c in results if c.kv_heads == kv}
    text = render(command, shape, a.world, a.kv_heads, ordered, a.rounds, a.iters, a.warmup,
                  (load_start, os.getloadavg()), notes)
    print(text)
    if a.write:
        write_section(a.write, text)
        print(f"(written to {a.write})")
    if a.json:
        a.json.write_text(json.dumps({
            "command": command, "world": a.world, "shape": dataclasses.asdict(shape),
            "cases": [dict(dataclasses.asdict(c), total_s=r.total, forward_s=r.forward, cpu_s=r.cpu, error=r.error)
                      for c, r in ordered.items()],
        }, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
