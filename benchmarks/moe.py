"""Speed of an MoE block's step against the dense MLP of the same active FLOPs (docs/moe-and-gpt-oss.md):

- ``moe``: loongtrain's experts (:class:`loongtrain.model.llama.MoEFeedForward`: router, top-k, the tokens sorted
  by expert, each expert's SwiGLU over its rows, weighted and summed back; on CPU the loop over experts);
- ``dense``: :class:`loongtrain.model.llama.FeedForward` of width ``top_k * moe_ffn_dim``, so that a token's
  matmul FLOPs equal the experts' it runs through (the router's ``E * dim`` more for the MoE block).

One step is the block's forward and backward on ``[1, --tokens, --dim]`` (random weights and inputs; the router
weights scaled so that routing is uneven, as after training). Per round, side by side: the dense step right
before the MoE step, each ``--steps`` times, by the wall clock and the CPU time; the table gives the median over
rounds of moe / dense with its quartiles and min-max spread.

    .venv/bin/python -m benchmarks.moe                   # dim 1024, 16 experts, top-2 of width 512, 16384 tokens
    .venv/bin/python -m benchmarks.moe --experts 64 --top-k 8 --moe-ffn-dim 128
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import add_common, header, setup
from loongtrain.model.config import ModelConfig
from loongtrain.model.llama import FeedForward, MoEFeedForward
from loongtrain.model.moe import RouterStats


def _blocks(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.nn.Module]:
    config = ModelConfig(vocab_size=256, dim=args.dim, num_layers=1, num_heads=8, num_kv_heads=8, ffn_dim=4 * args.dim,
                         num_experts=args.experts, top_k=args.top_k, moe_ffn_dim=args.moe_ffn_dim, moe_layers=(0,))
    torch.manual_seed(args.seed)
    moe = MoEFeedForward(config, RouterStats())
    dense = FeedForward(args.dim, args.top_k * args.moe_ffn_dim)
    with torch.no_grad():
        for block in (moe, dense):
            for param in block.parameters():
                param.normal_(0.0, args.dim ** -0.5)
        moe.router.weight.mul_(4.0)
    return moe, dense


def _step(block: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor, steps: int) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        stats = getattr(block, "stats", None)
        if stats is not None:
            stats.open()
        y = block(x)
        y.backward(grad)
        if stats is not None:
            stats.close()
        block.zero_grad(set_to_none=True)
        x.grad = None
    return time.perf_counter() - wall, time.process_time() - cpu


def _quartiles(values: list[float]) -> str:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return f"{q[1]:.3f} (quartiles {q[0]:.3f}-{q[2]:.3f}, range {min(values):.3f}-{max(values):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--moe-ffn-dim", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=16384, help="tokens of the rank (default 16384)")
    parser.add_argument("--steps", type=int, default=1, help="steps per case per round (default 1)")
    add_common(parser, rounds=11, threads=1, seed=0)
    args = parser.parse_args()
    setup(args)
    moe, dense = _blocks(args)
    x = torch.randn(1, args.tokens, args.dim, requires_grad=True)
    grad = torch.randn(1, args.tokens, args.dim)
    _step(dense, x, grad, 1)  # warm-up
    _step(moe, x, grad, 1)
    wall, cpu = [], []
    for _ in range(args.rounds):
        dense_wall, dense_cpu = _step(dense, x, grad, args.steps)
        moe_wall, moe_cpu = _step(moe, x, grad, args.steps)
        wall.append(moe_wall / dense_wall)
        cpu.append(moe_cpu / dense_cpu)
    print(header())
    print(f"MoE block ({args.experts} experts, top-{args.top_k}, expert FFN {args.moe_ffn_dim}) against the dense "
          f"MLP of FFN {args.top_k * args.moe_ffn_dim}, dim {args.dim}, {args.tokens} tokens, forward + backward, "
          f"{args.rounds} rounds of {args.steps} steps:")
    print(f"| moe / dense step time | wall clock | {_quartiles(wall)} |")
    print(f"| moe / dense step time | CPU time   | {_quartiles(cpu)} |")


if __name__ == "__main__":
    main()
