"""Does a short training on passkey-rich text raise the tiny preset's passkey accuracy? (docs/evaluation.md)

1. Writes a corpus (JSON lines) of ``--docs`` documents of exactly ``--doc-len + 1`` bytes, so that with
   ``--seq-len doc_len + 2`` every packed sample is one document and its EOS:
   - passkey documents: one ``loongtrain.eval.passkey.build_prompt`` prompt of ``--doc-len`` tokens plus its
     answer (random 5-digit keys from a generator the eval never uses, uniform depths);
   - with ``--copy-fraction f``, a fraction ``f`` of *copy* documents: a random string of 5-39 letters and
     digits, repeated to fill the document. Retrieval is an induction-head task (the question repeats the
     needle's prefix; copying the token after the earlier match gives the key), and these documents train
     that copying on every repeated token, where a passkey document has only its 5 answer digits to learn
     from. Without them the tiny preset learns the digit distribution, not retrieval (benchmarks/results/RESULTS.md).
2. Scores the untrained model (the seeded initial weights ``loongtrain train`` starts from).
3. Trains ``loongtrain train --model tiny`` on the corpus (the trainer's own CLI; nothing in it knows about
   passkeys), then runs ``loongtrain eval RUN --task passkey`` on held-out keys (the eval's own seeded keys
   and filler) at the trained length and twice it.

Prints the training time and end loss, and per length, before and after: keys and digits correct and the
mean loss (nats) of the answer digits under teacher forcing (chance: ln 10 = 2.30). Usage::

    python -m benchmarks.passkey_train --out /tmp/passkey_bench

When copying, and then retrieval, set in is a matter of the seed (init and data order): with the defaults
``--seed 1`` retrieves at the trained length after 3000 steps, ``--seed 0`` had not after 3000 or 6000
(benchmarks/results/RESULTS.md, "Passkey training"). One thread by default: on shared cores two threads per
process ran 4x slower.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import add_common
from loongtrain.data import ByteTokenizer
from loongtrain.eval.passkey import PasskeyTokens, build_prompt, draw_key, passkey, passkey_tokens
from loongtrain.model.config import get_preset
from loongtrain.model.llama import Transformer
from loongtrain.parallel.config import ParallelConfig
from loongtrain.parallel.mesh import single_process_mesh
from loongtrain.parallelize.compose import parallelize

DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
COPY_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz"


def passkey_doc(tokens: PasskeyTokens, tok: ByteTokenizer, doc_len: int, gen: torch.Generator) -> str:
    key = torch.randint(0, 10, (5,), generator=gen).tolist()
    depth = float(torch.rand((), generator=gen))
    batch = build_prompt(tokens, doc_len, depth, key)
    return tok.decode(torch.cat([batch["input_ids"][0], batch["labels"][0, -1:]]))


def copy_doc(doc_len: int, unit: tuple[int, int], gen: torch.Generator) -> str:
    """A random string of ``unit[0]..unit[1]`` letters and digits and a space, repeated to ``doc_len + 1``
    characters."""
    n = int(torch.randint(unit[0], unit[1] + 1, (), generator=gen))
    text = "".join(COPY_ALPHABET[i] for i in torch.randint(0, len(COPY_ALPHABET), (n,), generator=gen).tolist()) + " "
    return (text * (doc_len // len(text) + 2))[:doc_len + 1]


def write_corpus(path: Path, docs: int, doc_len: int, copy_fraction: float, copy_unit: tuple[int, int],
                 seed: int) -> None:
    """``docs`` documents of ``doc_len + 1`` bytes, a random ``copy_fraction`` of them copy documents."""
    tok = ByteTokenizer()
    tokens = passkey_tokens(tok)
    gen = torch.Generator().manual_seed(10_000 + seed)  # not the eval's keys (loongtrain.eval.passkey.draw_key)
    with open(path, "w") as fh:
        for _ in range(docs):
            copy = float(torch.rand((), generator=gen)) < copy_fraction
            text = copy_doc(doc_len, copy_unit, gen) if copy else passkey_doc(tokens, tok, doc_len, gen)
            assert len(text.encode()) == doc_len + 1
            fh.write(json.dumps({"text": text}) + "\n")


@torch.no_grad()
def answer_loss(model: torch.nn.Module, tokens: PasskeyTokens, length: int, trials: int) -> float:
    """Mean cross-entropy (nats) of the key's digits after the question, on the eval's own prompts."""
    total, count = 0.0, 0
    for index, depth in enumerate(DEPTHS):
        for trial in range(trials):
            batch = build_prompt(tokens, length, depth, draw_key(0, length, index, trial, 5))
            logits = model(batch["input_ids"])[0, batch["answer"]]
            total += float(F.cross_entropy(logits.float(), batch["labels"][0, batch["answer"]], reduction="sum"))
            count += len(batch["answer"])
    return total / count


def trained_model(run: Path) -> torch.nn.Module:
    from loongtrain.eval.source import build_model, resolve_model

    source = resolve_model(str(run))
    return build_model(source, source.run, single_process_mesh(), torch.device("cpu"))


def totals(cells: list[dict]) -> str:
    keys = sum(c["correct"] for c in cells), sum(c["trials"] for c in cells)
    digits = sum(c["digits_correct"] for c in cells), sum(c["digits"] for c in cells)
    return f"keys {keys[0]}/{keys[1]} ({100 * keys[0] / keys[1]:.0f}%), digits {digits[0]}/{digits[1]} " \
           f"({100 * digits[0] / digits[1]:.0f}%)"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="/tmp/passkey_bench")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--docs", type=int, default=0, help="corpus documents (0: steps x batch size, one epoch)")
    p.add_argument("--doc-len", type=int, default=126)
    p.add_argument("--copy-fraction", type=float, default=0.5)
    p.add_argument("--copy-unit", default="5,39", help="MIN,MAX characters of a copy document's repeated string")
    add_common(p, seed=1)  # the corpus's and the training's seed
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--trials", type=int, default=10)
    add_common(p, threads=1)
    args = p.parse_args()
    if not 0.0 <= args.copy_fraction < 1.0:
        raise SystemExit(f"--copy-fraction {args.copy_fraction} must be in [0, 1)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    corpus = out / "passkey_corpus.jsonl"
    unit = tuple(int(x) for x in args.copy_unit.split(","))
    write_corpus(corpus, args.docs or args.steps * args.batch_size, args.doc_len, args.copy_fraction, unit, args.seed)
    lengths = [args.doc_len, 2 * args.doc_len]  # the trained length, and twice it
    torch.set_num_threads(args.threads)
    tokens = passkey_tokens(ByteTokenizer())
    untrained = parallelize(Transformer(get_preset("tiny"), seed=args.seed), single_process_mesh(), ParallelConfig(),
                            torch.device("cpu"))
    before = passkey(untrained, tokens, lengths, DEPTHS, args.trials, single_process_mesh(), torch.device("cpu"))
    run = out / "run"
    cli = [sys.executable, "-m", "loongtrain.commands"]
    train = [*cli, "train", "--model", "tiny", "--corpus", str(corpus), "--seq-len", str(args.doc_len + 2),
             "--batch-size", str(args.batch_size), "--steps", str(args.steps), "--lr", str(args.lr),
             "--warmup", str(args.warmup), "--seed", str(args.seed), "--hp", "1", "--cp", "1", "--nproc", "1",
             "--threads", str(args.threads), "--out-dir", str(run), "--overwrite", "--no-memory-report",
             "--progress", "off", "--log-interval", str(max(1, args.steps // 10)),
             "--val-interval", str(max(1, args.steps // 4)), "--val-batches", "4"]
    t0 = time.perf_counter()
    subprocess.run(train, check=True)
    train_s = time.perf_counter() - t0
    evaluate = [*cli, "eval", str(run), "--task", "passkey", "--lengths", ",".join(map(str, lengths)),
                "--depths", ",".join(map(str, DEPTHS)), "--trials", str(args.trials), "--nproc", "1",
                "--threads", str(args.threads), "--out", str(out / "eval")]
    t0 = time.perf_counter()
    subprocess.run(evaluate, check=True)
    eval_s = time.perf_counter() - t0
    after = json.loads((out / "eval" / "results.json").read_text())
    last = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in last if "loss" in r][-1]
    trained = trained_model(run)
    print(f"trained {args.steps} steps in {train_s:.0f} s (eval {eval_s:.0f} s); end loss {last['loss']:.4f}, "
          f"val_loss {last.get('val_loss', math.nan):.4f}")
    print(f"untrained: {totals(before)}; trained: {totals(after)}")
    for length in lengths:
        b = [c for c in before if c["length"] == length]
        a = [c for c in after if c["length"] == length]
        loss_before = answer_loss(untrained, tokens, length, args.trials)
        loss_after = answer_loss(trained, tokens, length, args.trials)
        print(f"  length {length}: before {totals(b)}, answer loss {loss_before:.2f}; "
              f"after {totals(a)}, answer loss {loss_after:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
