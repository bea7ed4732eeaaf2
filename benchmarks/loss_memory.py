"""Peak memory and time of the loss (forward + backward): unchunked logits vs ``chunked_cross_entropy``.

``unchunked`` is what the trainer does today: ``logits = F.linear(hidden, weight)`` (kept alive by the
caller, as the trainer's loop does, until the backward is over), then ``sharded_cross_entropy``.
``chunked`` is ``chunked_cross_entropy(hidden, weight, ...)``. Each variant runs in a fresh process so
its peak is its own: on CPU the peak RSS above the set-up baseline (VmHWM, reset after set-up through
``/proc/self/clear_refs``), on CUDA ``max_memory_allocated`` above the set-up allocation. Both include
the fp32 gradients of ``hidden`` and ``weight``. Prints markdown starting with the command, then the
formula-predicted peaks of the chunked loss at the full size.

    python -m benchmarks.loss_memory --vocab 32768 --tokens 4096 --dim 256
    python -m benchmarks.loss_memory --device cuda --vocab 131072 --tokens 16384 --dim 4096
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.common import add_common
from loongtrain.loss.chunked import (
    chunked_cross_entropy,
    chunked_loss_peak_bytes,
    default_chunk_tokens,
)
from loongtrain.loss.sharded import sharded_cross_entropy

GIB = 2**30
VARIANTS = ("unchunked", "chunked")
FULL = dict(vocab=131072, tokens=16384, dim=4096)  # V=128K, S/sp=16K, d=4096


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _loss(variant: str, hidden, weight, labels, chunk_tokens: int | None):
    if variant == "unchunked":
        logits = F.linear(hidden, weight)
        loss, value = sharded_cross_entropy(logits, labels, None)
        return loss, value, logits  # the caller keeps the logits, as the trainer does
    loss, value = chunked_cross_entropy(hidden, weight, labels, None, chunk_tokens=chunk_tokens)
    return loss, value, None


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """One variant in this process: set up, reset the peak, run forward + backward, measure."""
    device = torch.device(args.device)
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(1, args.tokens, args.dim, device=device, generator=gen).requires_grad_(True)
    weight = (torch.randn(args.vocab, args.dim, device=device, generator=gen) * 0.02).requires_grad_(True)
    labels = torch.randint(0, args.vocab, (1, args.tokens), device=device, generator=gen)
    amp = args.dtype == "bf16"
    cuda = device.type == "cuda"
    if cuda:  # warm-up (cuBLAS workspaces, kernels), then measure the second run
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            loss, _, held = _loss(args.worker, hidden, weight, labels, args.chunk_tokens)
        loss.backward()
        del loss, held
        hidden.grad = weight.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:  # first run: freed memory cached by malloc would hide a second run's peak from RSS
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        base = _status_kib("VmRSS") * 1024
    start = time.perf_counter()
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
        loss, value, held = _loss(args.worker, hidden, weight, labels, args.chunk_tokens)
    loss.backward()
    del held
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated() if cuda else _status_kib("VmHWM") * 1024) - base
    return {"variant": args.worker, "peak": peak, "seconds": seconds, "loss": float(value),
            "grad_hidden_norm": float(hidden.grad.norm()), "grad_weight_norm": float(weight.grad.norm())}


def _run_variant(argv: list[str], variant: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, __file__, *argv, "--worker", variant],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def predicted_unchunked_bytes(tokens: int, vocab: int, dim: int, compute_bytes: int) -> int:
    """Unchunked loss, logits kept by the caller: ``b * t * V`` (the logits) + ``12 * t * V`` (the saved
    fp32 log-softmax output, then the fp32 gradients of the nll and of the log-softmax in the
    backward; in bf16 the forward's fp32 copy is freed before them) + the head's ``b * V * d``
    autocast copy when ``b < 4``."""
    copy = compute_bytes * vocab * dim if compute_bytes < 4 else 0
    return (12 + compute_bytes) * tokens * vocab + copy


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--tokens", type=int, default=4096, help="tokens on this rank (B * S / sp)")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--chunk-tokens", type=int, default=None, help="default: default_chunk_tokens(vocab)")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16", help="bf16: autocast, fp32 weights")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    add_common(parser, threads=2)
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    argv = sys.argv[1:] if argv is None else argv
    chunk = args.chunk_tokens or default_chunk_tokens(args.vocab)
    b = 2 if args.dtype == "bf16" else 4
    grads = 4 * (args.tokens + args.vocab) * args.dim
    print(f"```\npython -m benchmarks.loss_memory {shlex.join(argv)}\n```\n")
    print(f"{platform.node()}: {os.cpu_count()} CPUs, torch {torch.__version__}, {args.device}, {args.dtype}; "
          f"V={args.vocab}, tokens={args.tokens}, d={args.dim}, chunk_tokens={chunk}. Peaks include the fp32 "
          f"gradients of hidden and weight ({grads / GIB:.3f} GiB).\n")
    print("| variant | peak GiB | predicted GiB | time s | loss |")
    print("|---|---:|---:|---:|---:|")
    results = {}
    for variant in VARIANTS:
        r = results[variant] = _run_variant(argv, variant)
        predicted = grads + (predicted_unchunked_bytes(args.tokens, args.vocab, args.dim, b) if variant == "unchunked"
                             else chunked_loss_peak_bytes(args.tokens, args.vocab, args.dim, chunk_tokens=chunk,
                                                          compute_bytes=b))
        print(f"| {variant} | {r['peak'] / GIB:.3f} | {predicted / GIB:.3f} | {r['seconds']:.2f} | {r['loss']:.6f} |")
    u, c = results["unchunked"], results["chunked"]
    print(f"\nchunked / unchunked peak: 1/{u['peak'] / max(c['peak'], 1):.1f}; grad norms hidden "
          f"{c['grad_hidden_norm']:.6g} vs {u['grad_hidden_norm']:.6g}, weight {c['grad_weight_norm']:.6g} vs "
          f"{u['grad_weight_norm']:.6g}\n")
    t, v, d = FULL["tokens"], FULL["vocab"], FULL["dim"]
    full_chunk = default_chunk_tokens(v)
    print(f"Predicted at full size (V={v}, tokens={t}, d={d}, bf16 autocast, chunk_tokens={full_chunk}), "
          f"without the gradients: unchunked {predicted_unchunked_bytes(t, v, d, 2) / GIB:.2f} GiB, chunked "
          f"{chunked_loss_peak_bytes(t, v, d, compute_bytes=2) / GIB:.2f} GiB (of which the head's bf16 copy "
          f"{v * d * 2 / GIB:.2f} GiB, also in the unchunked figure).")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
