"""``loongtrain eval MODEL --task passkey|position-loss ...`` (docs/design.md §14). Exit codes: 0 ok, 2 bad
input (one line, before any worker starts; ``--out`` in use by another eval), 1 a worker failed or the
disk is full (one line), 130/143 Ctrl-C/SIGTERM (one line)."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from loongtrain._files import DiskFullError, OutputLock
from loongtrain._input import failure, interrupted, one_line, user_error
from loongtrain.eval.job import FILLERS, TASKS, EvalConfig
from loongtrain.eval.passkey import DEPTHS, KEY_DIGITS
from loongtrain.launch.torchrun import under_torchrun
from loongtrain.parallel.config import ParallelConfig
from loongtrain.train.config import DOC_MASK, DTYPES

SUFFIXES = {"K": 1024, "M": 1024**2}


def parse_size(text: str) -> int:
    """``"4096"``, ``"4K"`` (4096), ``"1M"`` (1048576); ValueError naming the text otherwise."""
    value = text.strip().upper()
    scale = SUFFIXES.get(value[-1:], 1)
    digits = value[:-1] if scale > 1 else value
    if not digits.isdigit() or int(digits) < 1:
        raise ValueError(f"length {text!r} is not a positive integer (optionally with K or M: 4K = 4096)")
    return int(digits) * scale


def parse_list(text: str, item, what: str) -> tuple:
    try:
        return tuple(item(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise ValueError(f"--{what} {text!r}: {exc}") from None


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ValueError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="loongtrain eval", description="Long-context evaluation of a trained model, sharded with "
                "2D-Attention like training: loss by position, or passkey retrieval (depth x length).")
    p.add_argument("model", metavar="MODEL", help="a run directory (its checkpoints/latest), a checkpoint "
                   "directory, or a Hugging Face model directory")
    p.add_argument("--task", default="passkey", choices=TASKS)
    p.add_argument("--out", default="runs/eval", help="output directory (results.json, meta.json, a PNG)")
    p.add_argument("--seq-len", type=parse_size, default=0, help="position-loss: tokens per sequence "
                   "(default: the checkpoint's trained --seq-len)")
    p.add_argument("--docs", type=int, default=4, help="position-loss: sequences from the corpus")
    p.add_argument("--lengths", default="4K,16K", help="passkey: comma-separated prompt lengths (4K = 4096)")
    p.add_argument("--depths", default=",".join(f"{d:g}" for d in DEPTHS), help="passkey: key depths in [0, 1]")
    p.add_argument("--trials", type=int, default=3, help="passkey: prompts per (length, depth) cell")
    p.add_argument("--key-digits", type=int, default=KEY_DIGITS, help="passkey: digits of the key")
    p.add_argument("--filler", default="text", choices=FILLERS, help="passkey: a fixed text repeated, or the "
                   "corpus's tokens")
    p.add_argument("--corpus", default="", help="eval corpus (default: the run's --corpus)")
    p.add_argument("--tokenizer", default="", help="tokenizer (default: the run's, or the HF directory's)")
    p.add_argument("--dtype", default="", choices=("", *DTYPES), help="compute dtype (default: as trained)")
    p.add_argument("--doc-mask", default="", choices=("", *DOC_MASK), help="position-loss: document masking "
                   "of packed sequences (default: as trained)")
    p.add_argument("--seed", type=int, default=0, help="passkey keys")
    for name, kind, default in (("hp", int, 1), ("cp", int, 1), ("window", int, 1), ("placement", str, "head_first")):
        p.add_argument(f"--{name}", type=kind, default=default, help=f"layout, as for train (default: {default})")
    p.add_argument("--zero", default="", choices=("", "none", "full", "hybrid"), help="ZeRO/FSDP2 of the weights "
                   "(default: as trained; none for a Hugging Face directory)")
    p.add_argument("--plan", default="", choices=("", "auto"), help="'auto': the planner chooses the layout")
    p.add_argument("--plan-cluster", default="auto", help="cluster for --plan auto (as for train)")
    p.add_argument("--nproc", type=int, default=0, help="local workers (0: GPUs, or hp*cp); ignored under torchrun")
    p.add_argument("--threads", type=int, default=0, help="torch threads per worker (0: as train)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a collective may wait")
    return p


def parse_args(argv: list[str]) -> EvalConfig:
    """EvalConfig from the command line; ValueError naming the bad value."""
    a = build_parser().parse_args(argv)
    parallel = ParallelConfig(hp=a.hp, cp=a.cp, window=a.window, placement=a.placement)
    return EvalConfig(
        model=a.model, task=a.task, out=a.out, seq_len=a.seq_len, docs=a.docs,
        lengths=parse_list(a.lengths, parse_size, "lengths"), depths=parse_list(a.depths, float, "depths"),
        trials=a.trials, key_digits=a.key_digits, filler=a.filler, corpus=a.corpus, tokenizer=a.tokenizer,
        dtype=a.dtype, doc_mask=a.doc_mask, seed=a.seed, parallel=parallel, zero=a.zero, plan=a.plan,
        plan_cluster=a.plan_cluster, nproc=a.nproc, threads=a.threads, timeout=a.timeout)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        from loongtrain.launch.eval_run import prepare
        from loongtrain.launch.train_run import setup_logging

        setup_logging(int(os.environ.get("RANK", 0)), False)
        job = prepare(parse_args(argv))
    except SystemExit as exc:  # --help
        return int(exc.code or 0)
    except ValueError as exc:
        return user_error("eval", exc)
    from loongtrain.eval.job import OUTPUT
    from loongtrain.launch.eval_run import launch
    from loongtrain.parallel.workers import WorkerError

    try:
        # one writer of --out (loongtrain._files); under torchrun every rank is its own process
        with contextlib.nullcontext() if under_torchrun() else OutputLock(OUTPUT, job.options.out):
            launch(job)
    except KeyboardInterrupt as exc:
        return interrupted("eval", exc)
    except ValueError as exc:
        return user_error("eval", exc)
    except DiskFullError as exc:
        return failure("eval", exc)
    except WorkerError as exc:
        print(f"loongtrain eval: {'error' if exc.kind == 'ValueError' else 'evaluation failed'}: rank {exc.rank} "
              f"of {exc.world_size}: {exc.error}", file=sys.stderr)
        return 2 if exc.kind == "ValueError" else 1
    except RuntimeError as exc:
        print(f"loongtrain eval: evaluation failed: {one_line(exc)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
