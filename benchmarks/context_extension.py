"""Context extension on CPU in one command: which RoPE change lets a model trained at L retrieve at 4L?

1. Pretrain the tiny preset at ``--length L`` on passkey prompts and copy documents
   (``benchmarks/passkey_train.py``'s corpus: retrieval is an induction-head task that copying teaches).
2. Continue from its checkpoint at ``4L`` for the same number of steps and the same tokens per step (a
   quarter of the sequences), three ways, each a ``loongtrain train --init-from PRETRAINED --seq-len 4L``
   (weights only: a fresh AdamW, warmup and cosine schedule at ``--continue-lr``):
   - ``unchanged``: the same RoPE (theta 10000);
   - ``theta``: ``--rope-theta`` scaled by ``4 ** (d / (d - 2))`` (the NTK-aware rule, d = head dim 32:
     x4.38, 43838), or by ``--theta-scale``;
   - ``yarn``: ``--rope-scaling yarn:factor=4,original_max_position_embeddings=L``.
3. Evaluate the pretrained model and each continuation with ``loongtrain eval``: ``--task passkey`` at
   L, 2L and 4L (the eval's own seeded keys and filler, never the training keys), and ``--task
   position-loss`` at 4L on held-out passkey and copy documents (mean loss per position bucket; the buckets
   past L are the extension's); and passkey at 4L of each of the ``--checkpoints`` checkpoints of every
   continuation, with the minutes from the command's start to that checkpoint (when does a way first
   retrieve 90% of the keys at 4L?).

Writes ``results.json``, ``context_extension.md`` (the tables) and ``context_extension.png`` (passkey by
length, passkey at 4L along the continuation, loss by position) into ``--out`` (and copies the last two
to ``--notes`` if given). Continuations run ``--jobs`` at a time, one thread each. Usage::

    python -m benchmarks.context_extension --out /tmp/context_extension

Develop with small settings (``--steps 50 --trials 1``); the defaults are the demonstration's.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.common import add_common, header
from benchmarks.passkey_train import write_corpus  # the passkey + copy corpus

CLI = [sys.executable, "-m", "loongtrain.commands"]
DEPTHS = "0,0.25,0.5,0.75,1"
HEAD_DIM = 32  # the tiny preset's
QUIET = ["--progress", "off", "--no-tensorboard", "--no-memory-report", "--hp", "1", "--cp", "1", "--nproc", "1"]


def ntk_theta_scale(factor: float, head_dim: int = HEAD_DIM) -> float:
    """The NTK-aware base change for a context ``factor`` longer: ``factor ** (d / (d - 2))``."""
    return factor ** (head_dim / (head_dim - 2))


def ways(length: int, theta_scale: float) -> dict[str, list[str]]:
    """The continuation flags of each way."""
    return {
        "unchanged": [],
        "theta": ["--rope-theta", f"{10000.0 * theta_scale:.0f}"],
        "yarn": ["--rope-scaling", f"yarn:factor=4,original_max_position_embeddings={length}"],
    }


def run(cmd: list[str], log: Path) -> float:
    """Run ``cmd`` with its output in ``log``; its wall seconds (an error names the log)."""
    t0 = time.perf_counter()
    with log.open("w") as fh:
        proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}; see {log}")
    return time.perf_counter() - t0


def train(out: Path, corpus: Path, seq_len: int, batch: int, lr: float, args: argparse.Namespace,
          extra: list[str]) -> float:
    cmd = [*CLI, "train", "--model", "tiny", "--corpus", str(corpus), "--seq-len", str(seq_len), "--batch-size",
           str(batch), "--steps", str(args.steps), "--lr", str(lr), "--warmup", str(args.warmup), "--seed",
           str(args.seed), "--threads", "1", "--out-dir", str(out), "--overwrite", "--log-interval",
           str(max(1, args.steps // 20)), *QUIET, *extra]
    out.mkdir(parents=True, exist_ok=True)
    return run(cmd, out.parent / f"{out.name}.train.log")


def evaluate(model: Path, out: Path, args: argparse.Namespace, eval_corpus: Path) -> dict:
    """Passkey at L, 2L, 4L and loss by position at 4L of the run ``model``."""
    L = args.length
    out.parent.mkdir(parents=True, exist_ok=True)
    common = ["--nproc", "1", "--hp", "1", "--cp", "1", "--threads", "1"]
    passkey = [*CLI, "eval", str(model), "--task", "passkey", "--lengths", f"{L},{2 * L},{4 * L}", "--depths",
               DEPTHS, "--trials", str(args.trials), "--out", str(out / "passkey"), *common]
    position = [*CLI, "eval", str(model), "--task", "position-loss", "--seq-len", str(4 * L), "--docs",
                str(args.eval_docs), "--corpus", str(eval_corpus), "--out", str(out / "position"), *common]
    seconds = run(passkey, out.parent / f"{out.name}.passkey.log") + run(position, out.parent / f"{out.name}.pos.log")
    cells = json.loads((out / "passkey" / "results.json").read_text())
    keys = {str(n): [sum(c[k] for c in cells if c["length"] == n) for k in ("correct", "trials")]
            for n in (L, 2 * L, 4 * L)}
    buckets = json.loads((out / "position" / "results.json").read_text())
    return {"passkey": keys, "position_loss": buckets, "eval_s": seconds}


def progress(run_dir: Path, out: Path, args: argparse.Namespace, started: float) -> dict[str, dict]:
    """Passkey at 4L of each checkpoint of a continuation: ``{step: {"keys": [correct, trials], "wall_s":
    seconds from the benchmark's start to that checkpoint's save}}``."""
    found = {}
    for ckpt in sorted((run_dir / "checkpoints").glob("step_*[0-9]")):
        where = out / ckpt.name
        where.parent.mkdir(parents=True, exist_ok=True)
        cmd = [*CLI, "eval", str(ckpt), "--task", "passkey", "--lengths", str(4 * args.length), "--depths", DEPTHS,
               "--trials", str(args.trials), "--out", str(where), "--nproc", "1", "--hp", "1", "--cp", "1",
               "--threads", "1"]
        run(cmd, out / f"{ckpt.name}.log")
        cells = json.loads((where / "results.json").read_text())
        found[str(int(ckpt.name[5:]))] = {"keys": [sum(c[k] for c in cells) for k in ("correct", "trials")],
                                          "wall_s": (ckpt / "trainer_state.json").stat().st_mtime - started}
    return found


def last_loss(run_dir: Path) -> float:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r][-1]["loss"]


def markdown(results: dict, args: argparse.Namespace) -> str:
    L = args.length
    buckets = [b for b in next(iter(results["models"].values()))["position_loss"]]
    head = (["model", f"passkey @{L}", f"@{2 * L}", f"@{4 * L}"]
            + [f"loss {b['start']}-{b['end']}" for b in buckets] + ["train s", "end loss"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in results["models"].items():
        keys = [f"{c}/{t} ({100 * c / t:.0f}%)" for c, t in r["passkey"].values()]
        losses = [f"{b['loss']:.3f}" if b["loss"] is not None else "-" for b in r["position_loss"]]
        lines.append("| " + " | ".join([name, *keys, *losses, f"{r['train_s']:.0f}", f"{r['end_loss']:.4f}"]) + " |")
    steps = sorted({int(k) for r in results["models"].values() for k in r.get("progress", {})})
    if steps:
        lines += ["", f"passkey at {4 * L} during the continuation (keys; minutes from the benchmark's start "
                      f"to that checkpoint):", "",
                  "| way | " + " | ".join(f"step {k}" for k in steps) + " |", "|" + "---|" * (len(steps) + 1)]
        for name, r in results["models"].items():
            if r.get("progress"):
                cells = [r["progress"].get(str(k)) for k in steps]
                lines.append(f"| {name} | " + " | ".join(
                    f"{c['keys'][0]}/{c['keys'][1]} ({100 * _share(c['keys']):.0f}%), {c['wall_s'] / 60:.1f} min"
                    if c else "-" for c in cells) + " |")
    return "\n".join(lines) + "\n"


def first_to(results: dict, share: float, length: int) -> tuple[str, int, float] | None:
    """``(way, step, minutes)`` of the earliest checkpoint (by wall time) retrieving ``share`` of the keys."""
    hits = [(c["wall_s"], name, int(step)) for name, r in results["models"].items()
            for step, c in r.get("progress", {}).items() if _share(c["keys"]) >= share]
    if not hits:
        return None
    wall, name, step = min(hits)
    return name, step, wall / 60


def plot(results: dict, args: argparse.Namespace, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    L = args.length
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(16, 4))
    for index, (name, r) in enumerate(results["models"].items()):
        style = dict(marker="o", label=name, color=f"C{index}")  # one colour per model in every panel
        lengths = [int(n) for n in r["passkey"]]
        left.plot(lengths, [100 * c / t for c, t in r["passkey"].values()], **style)
        shown = [b for b in r["position_loss"] if b["loss"] is not None]
        right.plot([(b["start"] + b["end"]) / 2 for b in shown], [b["loss"] for b in shown], **style)
        if r.get("progress"):
            steps = sorted(int(k) for k in r["progress"])
            middle.plot(steps, [100 * _share(r["progress"][str(k)]["keys"]) for k in steps], **style)
    left.set_xscale("log", base=2)
    left.set_xticks([L, 2 * L, 4 * L], [str(L), str(2 * L), str(4 * L)])
    left.set_xlabel("prompt length (tokens)")
    left.set_ylabel("passkey keys retrieved (%)")
    left.set_ylim(-5, 105)
    left.axvline(L, color="grey", ls=":", lw=1)
    left.set_title(f"passkey (pretrained at {L}, continued at {4 * L})")
    middle.set_xlabel(f"continuation step (at {4 * L})")
    middle.set_ylabel(f"passkey keys retrieved at {4 * L} (%)")
    middle.set_ylim(-5, 105)
    middle.set_title("while continuing")
    right.axvline(L, color="grey", ls=":", lw=1)
    right.set_xlabel("token position (bucket middle)")
    right.set_ylabel("mean loss (nats, log scale)")
    right.set_yscale("log")
    right.set_title(f"loss by position at {4 * L}")
    for ax in (left, middle, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="/tmp/context_extension")
    p.add_argument("--notes", default="", help="also copy the table and the plot into this directory")
    p.add_argument("--length", type=int, default=128, help="L: the pretraining length (continued at 4L)")
    p.add_argument("--steps", type=int, default=3000, help="optimizer steps of the pretraining and of each way")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step at L (a quarter of it at 4L)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate of the pretraining")
    p.add_argument("--continue-lr", type=float, default=1e-3, help="peak learning rate of the continuations")
    p.add_argument("--warmup", type=int, default=20)
    add_common(p, seed=1)  # the corpora's and the trainings' seed
    p.add_argument("--copy-fraction", type=float, default=0.5)
    p.add_argument("--theta-scale", type=float, default=0.0, help="theta way: base x this (0: the NTK-aware rule)")
    p.add_argument("--trials", type=int, default=10, help="passkey prompts per (length, depth)")
    p.add_argument("--eval-docs", type=int, default=16, help="position-loss: held-out sequences of 4L")
    p.add_argument("--jobs", type=int, default=3, help="continuations trained at once (one thread each)")
    p.add_argument("--ways", default="unchanged,theta,yarn")
    p.add_argument("--checkpoints", type=int, default=6, help="checkpoints of each continuation, each scored "
                   "on passkey at 4L (the last one fully)")
    p.add_argument("--replot", default="", metavar="RESULTS_JSON", help="only redraw the tables and the plot of "
                   "an earlier run's results.json (into --out)")
    args = p.parse_args()
    if args.replot:
        return report(json.loads(Path(args.replot).read_text()), args, Path(args.out))
    if args.batch_size % 4:
        raise SystemExit(f"--batch-size {args.batch_size} must be a multiple of 4 (a quarter of it at 4L)")
    L, out = args.length, Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start, started = time.perf_counter(), time.time()
    corpora = {"pre": out / "corpus_L.jsonl", "cont": out / "corpus_4L.jsonl", "eval": out / "eval_4L.jsonl"}
    write_corpus(corpora["pre"], args.steps * args.batch_size, L - 2, args.copy_fraction, (5, 39), args.seed)
    write_corpus(corpora["cont"], args.steps * args.batch_size // 4, 4 * L - 2, args.copy_fraction, (5, 39),
                 args.seed + 1)
    write_corpus(corpora["eval"], args.eval_docs + 1, 4 * L - 2, args.copy_fraction, (5, 39), args.seed + 100)
    scale = args.theta_scale or ntk_theta_scale(4.0)
    chosen = {k: v for k, v in ways(L, scale).items() if k in args.ways.split(",")}
    pre = out / "pretrained"
    pre_s = train(pre, corpora["pre"], L, args.batch_size, args.lr, args, [])
    print(f"pretrained at {L}: {args.steps} steps in {pre_s:.0f} s, end loss {last_loss(pre):.4f}", flush=True)

    def extend(item: tuple[str, list[str]]) -> float:
        name, flags = item
        interval = ["--ckpt-interval", str(max(1, args.steps // max(1, args.checkpoints)))]
        return train(out / name, corpora["cont"], 4 * L, args.batch_size // 4, args.continue_lr, args,
                     ["--init-from", str(pre), *interval, *flags])

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        seconds = dict(zip(chosen, pool.map(extend, chosen.items())))
    cont_s = time.perf_counter() - t0
    models = {f"pretrained (at {L})": (pre, pre_s), **{name: (out / name, seconds[name]) for name in chosen}}
    results = {"args": vars(args), "theta_scale": scale, "flags": chosen, "models": {}}
    for name, (run_dir, train_s) in models.items():
        r = evaluate(run_dir, out / "eval" / run_dir.name, args, corpora["eval"])
        results["models"][name] = {**r, "train_s": train_s, "end_loss": last_loss(run_dir)}
        if run_dir != pre:
            results["models"][name]["progress"] = progress(run_dir, out / "eval" / f"{run_dir.name}_steps", args,
                                                           started)
        print(name, json.dumps(r["passkey"]), flush=True)
    results["wall_s"] = {"total": time.perf_counter() - t_start, "pretrain": pre_s, "continuations": cont_s}
    results["first_90"] = first_to(results, 0.9, 4 * L)
    results["header"] = header()
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    return report(results, args, out)


def report(results: dict, args: argparse.Namespace, out: Path) -> int:
    """Write the tables and the plot of ``results`` into ``out`` (and ``--notes``) and print the summary."""
    run_args = argparse.Namespace(**{**vars(args), **results["args"]})  # the run's own length and settings
    L = run_args.length
    out.mkdir(parents=True, exist_ok=True)
    table = f"<!-- {results.get('header', '')} -->\n" + markdown(results, run_args)
    (out / "context_extension.md").write_text(table)
    plot(results, run_args, out / "context_extension.png")
    if args.notes:
        for name in ("context_extension.md", "context_extension.png"):
            shutil.copy(out / name, Path(args.notes) / name)
    print(table)
    wall = results["wall_s"]
    first = first_to(results, 0.9, 4 * L)
    reached = f"{first[0]} at step {first[1]}, {first[2]:.1f} min after the start" if first else "none"
    print(f"wall {wall['total']:.0f} s (pretraining {wall['pretrain']:.0f} s, continuations "
          f"{wall['continuations']:.0f} s with --jobs {run_args.jobs}); theta x{results['theta_scale']:.2f}; "
          f"first checkpoint with >= 90% of the keys at {4 * L}: {reached}")
    return 0


def _share(cell: list[int]) -> float:
    return cell[0] / max(1, cell[1])


if __name__ == "__main__":
    sys.exit(main())
