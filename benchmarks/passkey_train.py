"""Does a short training on passkey-rich text raise the tiny preset's passkey accuracy? (docs/design.md §14)

1. Writes a corpus of passkey documents (``loongtrain.eval.passkey.build_prompt`` with random keys and
   depths, decoded by the byte tokenizer: each document is one prompt of ``--doc-len`` tokens plus its
   answer, so with ``--seq-len doc_len + 2`` every packed sample is exactly one document).
2. Scores the untrained model (the seeded initial weights ``loongtrain train`` starts from).
3. Trains ``loongtrain train --model tiny`` on it, then runs ``loongtrain eval RUN --task passkey`` on
   held-out keys (the eval's own seeded keys, never in the corpus) at the trained length and twice it.

Prints both grids' totals and one summary line. Usage::

    python benchmarks/passkey_train.py --out /tmp/passkey_bench --steps 400
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from loongtrain.data import ByteTokenizer
from loongtrain.eval.passkey import build_prompt, passkey, passkey_tokens
from loongtrain.model.config import get_preset
from loongtrain.model.llama import Transformer
from loongtrain.parallel.config import ParallelConfig
from loongtrain.parallel.mesh import single_process_mesh
from loongtrain.train.parallelize import parallelize

DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


def write_corpus(path: Path, docs: int, doc_len: int, seed: int) -> None:
    """``docs`` passkey prompts (random 5-digit keys, uniform depths) as JSON lines."""
    tok = ByteTokenizer()
    tokens = passkey_tokens(tok)
    gen = torch.Generator().manual_seed(10_000 + seed)  # not the eval's keys (loongtrain.eval.passkey.draw_key)
    with open(path, "w") as fh:
        for _ in range(docs):
            key = torch.randint(0, 10, (5,), generator=gen).tolist()
            depth = float(torch.rand((), generator=gen))
            batch = build_prompt(tokens, doc_len, depth, key)
            ids = torch.cat([batch["input_ids"][0], batch["labels"][0, -1:]])
            fh.write(json.dumps({"text": tok.decode(ids)}) + "\n")


def totals(cells: list[dict]) -> str:
    keys = sum(c["correct"] for c in cells), sum(c["trials"] for c in cells)
    digits = sum(c["digits_correct"] for c in cells), sum(c["digits"] for c in cells)
    return f"keys {keys[0]}/{keys[1]} ({100 * keys[0] / keys[1]:.0f}%), digits {digits[0]}/{digits[1]} " \
           f"({100 * digits[0] / digits[1]:.0f}%)"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="/tmp/passkey_bench")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--docs", type=int, default=4000)
    p.add_argument("--doc-len", type=int, default=126)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--trials", type=int, default=4)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    corpus = out / "passkey_corpus.jsonl"
    write_corpus(corpus, args.docs, args.doc_len, seed=0)
    lengths = [args.doc_len, 2 * args.doc_len]  # the trained length, and twice it
    torch.set_num_threads(2)
    untrained = parallelize(Transformer(get_preset("tiny"), seed=0), single_process_mesh(), ParallelConfig(),
                            torch.device("cpu"))
    before = passkey(untrained, passkey_tokens(ByteTokenizer()), lengths, DEPTHS, args.trials,
                     single_process_mesh(), torch.device("cpu"))
    run = out / "run"
    cli = [sys.executable, "-m", "loongtrain.cli"]
    train = [*cli, "train", "--model", "tiny", "--corpus", str(corpus), "--seq-len", str(args.doc_len + 2),
             "--batch-size", str(args.batch_size), "--steps", str(args.steps), "--lr", str(args.lr), "--warmup", "20",
             "--hp", "1", "--cp", "1", "--nproc", "1", "--out-dir", str(run), "--overwrite", "--no-memory-report",
             "--progress", "off", "--log-interval", "50", "--eval-interval", str(max(1, args.steps // 4)),
             "--eval-batches", "4"]
    t0 = time.perf_counter()
    subprocess.run(train, check=True)
    train_s = time.perf_counter() - t0
    evaluate = [*cli, "eval", str(run), "--task", "passkey", "--lengths", ",".join(map(str, lengths)),
                "--depths", ",".join(map(str, DEPTHS)), "--trials", str(args.trials), "--nproc", "1",
                "--out", str(out / "eval")]
    t0 = time.perf_counter()
    subprocess.run(evaluate, check=True)
    eval_s = time.perf_counter() - t0
    after = json.loads((out / "eval" / "results.json").read_text())
    print(f"untrained: {totals(before)}")
    print(f"after {args.steps} steps ({train_s:.0f} s training, {eval_s:.0f} s eval): {totals(after)}")
    for length in lengths:
        b = [c for c in before if c["length"] == length]
        a = [c for c in after if c["length"] == length]
        print(f"  length {length}: before {totals(b)}; after {totals(a)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
