"""The planner's sanity table for the paper's setting: 7B (MHA and GQA) on 64 A100s (8 nodes x 8).

For each model and sequence length, the best fitting configuration (over zero and recompute)
among: pure Ulysses (``hp = sp = 64``, where valid), the most head parallelism the model allows
(``hp = 32, cp = 2``), pure ring (``hp = 1, cp = 64, inner_ring = 1``), and every 2D / double-ring
configuration with ``sp = 64``. Run: ``python -m benchmarks.plan_sanity > benchmarks/results/PLAN_SANITY.md``.
"""

from __future__ import annotations

import sys

from loongtrain._options import parse_size
from loongtrain.model.config import PRESETS
from loongtrain.plan.cost import Candidate
from loongtrain.plan.search import best_fitting

MODELS = ("7b-mha", "7b-gqa")
SEQ_LENS = ("128K", "256K", "512K", "1M")
NODES, CLUSTER = 8, "a100"
COLUMNS = {  # name -> filters (sp = 64 always: one sequence over all 64 devices)
    "pure Ulysses (hp=64)": dict(hp=64, cp=1),
    "max heads (hp=32, cp=2)": dict(hp=32, cp=2),
    "pure ring (cp=64, w=1)": dict(hp=1, cp=64, inner_ring=1),
    "best 2D / double ring": {},
}


def _flags(model: str, seq: str, filters: dict) -> str:
    extra = "".join(f" --{k} {v}" for k, v in filters.items())
    base = f"loongtrain plan --model {model} --seq-len {seq} --nodes {NODES} --cluster {CLUSTER}"
    return f"{base} --sp 64{extra}"


def _cell(c: Candidate, show_config: bool) -> str:
    g = c.config
    text = f"{c.step_time:.2f} s, MFU {c.mfu:.1%}"
    if show_config:
        text += f" (hp={g.hp} cp={g.cp} inner_ring={g.inner_ring} {g.placement}, {g.zero}, {g.recompute})"
    else:
        text += f" ({g.zero}, {g.recompute}; {c.bottleneck})"
    return text


def sanity_table() -> str:
    lines = [
        "# Planner sanity table: 7B on 64 A100-80GB (8 nodes x 8), one sequence over all 64 devices",
        "",
        "Predicted step time and MFU (model FLOPs / (step x 64 x 312 TFLOP/s)) of the best configuration",
        "that fits in memory in each family; bf16, batch 1. Produced by `python -m benchmarks.plan_sanity`;",
        "each cell is the first row of the command listed below the table.",
        "",
        "| model | seq | " + " | ".join(COLUMNS) + " |",
        "|---|---|" + "---|" * len(COLUMNS),
    ]
    commands = []
    for model in MODELS:
        for seq in SEQ_LENS:
            cells = []
            for filters in COLUMNS.values():
                commands.append(_flags(model, seq, filters))
                try:
                    seq_len = parse_size(seq)
                    best = best_fitting(model, CLUSTER, nodes=NODES, seq_len=seq_len, sp=64, **filters)
                    cells.append(_cell(best, show_config=not filters))
                except ValueError as exc:
                    heads = PRESETS[model].num_heads
                    invalid = "is invalid" in str(exc)
                    cells.append(f"invalid: hp={filters.get('hp')} does not divide {heads} heads"
                                 if invalid else "does not fit")
            lines.append(f"| {model} | {seq} | " + " | ".join(cells) + " |")
    lines += ["", "Commands (add `--json` for every field):", "", "```"] + commands + ["```", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(sanity_table())
