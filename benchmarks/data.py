"""Data benchmarks: ``loongtrain prepare`` throughput, and start-up from a prepared corpus.

1. **prepare throughput** (tokens/s) on the stdlib corpus ``--copies`` times over (.txt files, shards of
   8 MB of text), with the byte tokenizer and with a BPE
   tokenizer trained here with ``tokenizers`` on the first ``--bpe-train-mb`` MB of the corpus (vocab
   ``--bpe-vocab``). Baseline, timed right before each case: that tokenizer's own batch encoding in one
   process over the same documents already in memory (byte: ``ByteTokenizer.encode_many``; BPE:
   ``tokenizers.Tokenizer.encode_batch``, which uses every core by its own threads). The case is the
   whole ``prepare`` (read files, tokenize in ``--workers`` processes, write shards and index, SHA-256
   and sampled digests, manifest). Ratio = case tokens/s / baseline tokens/s.
2. **start-up and memory**: ``loongtrain train --nproc 2 --hp 1 --cp 2 --steps 1`` through the real
   command, launch to the first step record in metrics.jsonl, and rank 0's peak RSS (its metrics'
   ``peak_mem_gib``), from the embedded default (``--corpus stdlib``, tokenized at start-up) and from
   prepared corpora of ``--sizes`` GB of tokens. The large prepared corpora are made quickly by repeating
   the prepared stdlib's token stream (shards of 2**28 tokens, a real index, manifest and digests), so
   their size, not their text, is what differs. Cases alternate in rounds; medians and min-max spreads.
   Then, in this process, the data part alone: launcher check + ``build_batches`` + the first batch.

    .venv/bin/python -m benchmarks.data [--rounds 3] [--sizes 0.3,3] [--workers 0] [--json out.json]

Run on a quiet machine; ratios are side by side in one run, but a shared machine still adds noise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import ROOT, add_common
from loongtrain.data import build_corpus, build_tokenizer
from loongtrain.data.prepare import Sharding, prepare
from loongtrain.data.prepared import (
    FORMAT,
    FORMAT_VERSION,
    INDEX_FILE,
    MANIFEST,
    SHARD_DIR,
    file_digests,
    read_manifest,
)


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def train_bpe(docs: list[str], megabytes: float, vocab: int, path: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    text, size = [], 0
    for d in docs:
        text.append(d)
        size += len(d)
        if size > megabytes * 1e6:
            break
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "</s>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path))
    return path


def baseline_tokens_per_s(tokenizer, docs: list[str]) -> float:
    t0 = time.perf_counter()
    if hasattr(tokenizer, "_tok") and tokenizer._tok is not None:
        count = sum(len(e.ids) + 1 for e in tokenizer._tok.encode_batch(docs, add_special_tokens=False))
    else:
        count = sum(e.size + 1 for e in tokenizer.encode_many(docs))
    return count / (time.perf_counter() - t0)


def prepare_tokens_per_s(tokenizer, corpus: Path, out: Path, workers: int) -> float:
    shutil.rmtree(out, ignore_errors=True)
    result = prepare([str(corpus)], out, tokenizer, Sharding(shard_bytes=SHARD_BYTES), workers=workers, progress=False)
    return result.num_tokens / result.seconds


SHARD_BYTES = 8 << 20


def bench_prepare(work: Path, rounds: int, workers: int, bpe_mb: float, bpe_vocab: int, copies: int) -> dict:
    """The stdlib's documents ``copies`` times, as .txt files (one document each) in ``work/corpus``."""
    docs = list(build_corpus("stdlib")) * copies
    corpus = work / "corpus"
    corpus.mkdir(exist_ok=True)
    for i, doc in enumerate(docs):
        (corpus / f"{i:06d}.txt").write_text(doc, encoding="utf-8")
    docs = list(build_corpus(corpus))  # as prepare reads them (sorted paths)
    t0 = time.perf_counter()
    bpe = build_tokenizer(str(train_bpe(docs, bpe_mb, bpe_vocab, work / "bpe.json")))
    trained = time.perf_counter() - t0
    out = {}
    for name, tok in (("byte", build_tokenizer("byte")), (f"bpe{bpe_vocab}", bpe)):
        base, case = [], []
        for _ in range(rounds):
            base.append(baseline_tokens_per_s(tok, docs))
            case.append(prepare_tokens_per_s(tok, corpus, work / f"prep-{name}", workers))
        ratios = [c / b for c, b in zip(case, base)]
        out[name] = {"baseline_tokens_per_s": spread(base), "prepare_tokens_per_s": spread(case),
                     "ratio": spread(ratios)}
        print(f"prepare {name}: {statistics.median(case):.3g} tokens/s vs {statistics.median(base):.3g} "
              f"(own batch encoding, 1 process): ratio {statistics.median(ratios):.2f} "
              f"[{min(ratios):.2f}, {max(ratios):.2f}]", flush=True)
    out["bpe_training_s"] = trained
    out["corpus_chars"] = sum(len(d) for d in docs)
    return out


def synthesize(source: Path, out: Path, num_tokens: int, shard_tokens: int = 1 << 28) -> Path:
    """A prepared directory of ``num_tokens`` tokens: the source's stream repeated (whole documents)."""
    if (out / MANIFEST).is_file() and read_manifest(out).num_tokens >= num_tokens:
        return out  # made by an earlier run with --work
    src = read_manifest(source)
    stream = np.concatenate([np.fromfile(f, dtype=src.dtype) for f, _ in src.files()[:-1]])
    index = np.fromfile(source / SHARD_DIR / INDEX_FILE, dtype="<u8").astype(np.int64)
    lengths = np.diff(index)
    copies = -(-num_tokens // stream.size)
    shutil.rmtree(out, ignore_errors=True)
    (out / SHARD_DIR).mkdir(parents=True)
    shards, written, k, buf = [], 0, 0, []
    total = copies * stream.size

    def flush(parts: list[np.ndarray], k: int) -> dict:
        name = f"tokens-{k:05d}.bin"
        data = np.concatenate(parts)
        data.tofile(out / SHARD_DIR / name)
        return {"file": name, "num_tokens": int(data.size), "num_documents": len(parts) * int(lengths.size),
                **file_digests(out / SHARD_DIR / name)}

    for _ in range(copies):
        buf.append(stream)
        written += stream.size
        if sum(b.size for b in buf) >= shard_tokens or written == total:
            shards.append(flush(buf, k))
            buf, k = [], k + 1
    offsets = np.zeros(copies * lengths.size + 1, dtype="<u8")
    np.cumsum(np.tile(lengths, copies), out=offsets[1:])
    offsets.tofile(out / SHARD_DIR / INDEX_FILE)
    manifest = {**src.data, "format": FORMAT, "version": FORMAT_VERSION, "sources": ["synthetic"],
                "num_tokens": int(total), "num_documents": int(copies * lengths.size), "shards": shards,
                "index": file_digests(out / SHARD_DIR / INDEX_FILE)}
    (out / MANIFEST).write_text(json.dumps(manifest))
    return out


def train_startup(corpus: str, out_dir: Path, seq_len: int) -> dict:
    """Launch ``loongtrain train`` (2 workers); seconds to the first step record, rank 0's peak RSS."""
    shutil.rmtree(out_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "loongtrain.commands", "train", "--corpus", corpus, "--out-dir", str(out_dir),
           "--nproc", "2", "--hp", "1", "--cp", "2", "--seq-len", str(seq_len), "--steps", "1", "--warmup", "0",
           "--progress", "off", "--peak-tflops", "1", "--no-tensorboard", "--no-plot", "--threads", "1"]
    metrics = out_dir / "metrics.jsonl"
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    first = None
    while proc.poll() is None and first is None:
        if metrics.is_file() and '"step": 1' in metrics.read_text():
            first = time.perf_counter() - t0
        time.sleep(0.01)
    _, err = proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{err[-3000:]}")
    first = first if first is not None else time.perf_counter() - t0
    record = [json.loads(line) for line in metrics.read_text().splitlines() if '"loss"' in line][-1]
    return {"first_step_s": first, "peak_rss_gib": record["peak_mem_gib"]}


def bench_startup(work: Path, rounds: int, sizes: list[float], seq_len: int) -> dict:
    source = work / "prep-stdlib"
    if not (source / MANIFEST).is_file():
        prepare(["stdlib"], source, "byte", workers=1, progress=False)
    corpora = {"default (stdlib, raw)": "stdlib"}
    for gb in sizes:
        t0 = time.perf_counter()
        path = synthesize(source, work / f"prep-{gb:g}GB", int(gb * 1e9))
        print(f"made a prepared corpus of {gb:g} G tokens in {time.perf_counter() - t0:.0f} s", flush=True)
        corpora[f"prepared {gb:g} G tokens"] = str(path)
    runs: dict[str, list[dict]] = {name: [] for name in corpora}
    for _ in range(rounds):
        for name, corpus in corpora.items():
            runs[name].append(train_startup(corpus, work / "run", seq_len))
    default = runs["default (stdlib, raw)"]
    out = {}
    for name, rs in runs.items():
        ratio = [r["first_step_s"] / d["first_step_s"] for r, d in zip(rs, default)]
        growth = [(r["peak_rss_gib"] - d["peak_rss_gib"]) * 1024 for r, d in zip(rs, default)]
        out[name] = {"first_step_s": spread([r["first_step_s"] for r in rs]), "vs_default": spread(ratio),
                     "peak_rss_gib": spread([r["peak_rss_gib"] for r in rs]), "rss_growth_mib": spread(growth)}
        print(f"{name}: first step {statistics.median([r['first_step_s'] for r in rs]):.2f} s "
              f"({statistics.median(ratio):.3f}x default [{min(ratio):.3f}, {max(ratio):.3f}]), rank-0 peak RSS "
              f"{statistics.median([r['peak_rss_gib'] for r in rs]):.3f} GiB ({statistics.median(growth):+.0f} MiB "
              f"[{min(growth):+.0f}, {max(growth):+.0f}])", flush=True)
    return out


def bench_open(work: Path, rounds: int, sizes: list[float], seq_len: int) -> dict:
    """In this process: seconds from nothing to the first batch (launcher check + ``build_batches`` +
    one batch, as rank 0 of dp=1), raw default vs the prepared corpora made by :func:`bench_startup`."""
    from loongtrain.data import build_batches
    from loongtrain.data.prepared import check_prepared
    from loongtrain.sections.data import DataSection

    corpora = {"default (stdlib, raw)": "stdlib", **{f"prepared {gb:g} G tokens": str(work / f"prep-{gb:g}GB")
                                                     for gb in sizes}}
    byte = build_tokenizer("byte")
    times: dict[str, list[float]] = {name: [] for name in corpora}
    for _ in range(rounds):
        for name, corpus in corpora.items():
            t0 = time.perf_counter()
            if corpus != "stdlib":
                check_prepared(corpus, byte, seq_len + 1)
            next(build_batches(DataSection(corpus=corpus, seq_len=seq_len), byte))
            times[name].append(time.perf_counter() - t0)
    out = {name: spread(ts) for name, ts in times.items()}
    for name, ts in times.items():
        print(f"open + first batch in-process, {name}: {statistics.median(ts) * 1e3:.1f} ms "
              f"[{min(ts) * 1e3:.1f}, {max(ts) * 1e3:.1f}]", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common(parser, rounds=3)
    parser.add_argument("--workers", type=int, default=0, help="prepare workers (0: one per core)")
    parser.add_argument("--sizes", default="0.3,3", help="prepared corpus sizes, G tokens (comma-separated)")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--bpe-vocab", type=int, default=4096)
    parser.add_argument("--copies", type=int, default=4, help="prepare corpus: the stdlib this many times")
    parser.add_argument("--bpe-train-mb", type=float, default=2.0)
    parser.add_argument("--skip", choices=("prepare", "startup"), action="append", default=[])
    parser.add_argument("--work", default="", help="scratch directory (default: a temporary one, removed)")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="loongtrain-data-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    result = {"cpus": os.cpu_count(), "args": vars(args)}
    try:
        if "prepare" not in args.skip:
            result["prepare"] = bench_prepare(work, args.rounds, args.workers, args.bpe_train_mb, args.bpe_vocab,
                                              args.copies)
        if "startup" not in args.skip:
            sizes = [float(s) for s in args.sizes.split(",") if s]
            result["startup"] = bench_startup(work, args.rounds, sizes, args.seq_len)
            result["open"] = bench_open(work, max(args.rounds, 5), sizes, args.seq_len)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
