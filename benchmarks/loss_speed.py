"""Time of the loss (forward + backward), side by side in one process: unchunked logits vs the fused
``chunked_cross_entropy`` (loongtrain/loss/chunked.py).

``unchunked`` is ``sharded_cross_entropy(F.linear(hidden, weight), ...)``; ``chunked`` computes each chunk's
logits, log-sum-exp and gradients in one pass. Each round times the unchunked loss right before the chunked
one (``--iters`` each, median); the table gives the per-round medians' median and min-max of the ratio
chunked / unchunked (the GPU target is <= 1.2). Prints markdown starting with the command.

    python -m benchmarks.loss_speed --vocab 32768 --tokens 4096 --dim 256 --chunk-tokens 256
    python -m benchmarks.loss_speed --device cuda --vocab 131072 --tokens 16384 --dim 4096 --dtype bf16
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from benchmarks.common import add_common
from loongtrain.loss.chunked import chunked_cross_entropy
from loongtrain.loss.sharded import sharded_cross_entropy


def loss_fns(chunk_tokens: int | None) -> dict:
    def unchunked(hidden, weight, labels):
        return sharded_cross_entropy(F.linear(hidden, weight), labels, None)[0]

    def chunked(hidden, weight, labels):
        return chunked_cross_entropy(hidden, weight, labels, None, chunk_tokens=chunk_tokens)[0]

    return {"unchunked": unchunked, "chunked": chunked}


def time_loss(fn, hidden, weight, labels, iters: int, bf16: bool) -> float:
    """Median seconds of ``iters`` forward + backward runs (after one untimed)."""
    times = []
    for i in range(iters + 1):
        hidden.grad = weight.grad = None
        if hidden.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast(hidden.device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = fn(hidden, weight, labels)
        loss.backward()
        if hidden.is_cuda:
            torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def side_by_side(vocab: int, tokens: int, dim: int, chunk_tokens: int | None, dtype: str, device: str,
                 rounds: int, iters: int) -> dict:
    """Per round: unchunked then chunked; returns their per-round medians and the ratios."""
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(0)
    hidden = torch.randn(1, tokens, dim, device=dev, generator=gen).requires_grad_(True)
    weight = (torch.randn(vocab, dim, device=dev, generator=gen) * 0.02).requires_grad_(True)
    labels = torch.randint(0, vocab, (1, tokens), device=dev, generator=gen)
    fns = loss_fns(chunk_tokens)
    out: dict = {"unchunked": [], "chunked": [], "ratio": []}
    for _ in range(rounds):
        base = time_loss(fns["unchunked"], hidden, weight, labels, iters, dtype == "bf16")
        case = time_loss(fns["chunked"], hidden, weight, labels, iters, dtype == "bf16")
        out["unchunked"].append(base)
        out["chunked"].append(case)
        out["ratio"].append(case / base)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--chunk-tokens", type=int, default=None)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    add_common(parser, device="cpu", rounds=5)
    parser.add_argument("--iters", type=int, default=3)
    args = parser.parse_args(argv)
    r = side_by_side(args.vocab, args.tokens, args.dim, args.chunk_tokens, args.dtype, args.device, args.rounds,
                     args.iters)
    print(f"```\npython -m benchmarks.loss_speed {shlex.join(argv if argv is not None else sys.argv[1:])}\n```\n")
    print("| dtype | unchunked s | chunked s | chunked / unchunked (median, min-max) |\n|---|---:|---:|---|")
    print(f"| {args.dtype} | {statistics.median(r['unchunked']):.3f} | {statistics.median(r['chunked']):.3f} | "
          f"{statistics.median(r['ratio']):.2f} ({min(r['ratio']):.2f}-{max(r['ratio']):.2f}) |")


if __name__ == "__main__":
    main()
