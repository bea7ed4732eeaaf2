"""Host work per training step, before and after issue 40's item 4, side by side in one run: the optimizer's share
of the step (clip + AdamW) and the per-layer planning share (document boundaries, masks, ring-step pieces and
kernel-call plans).

    python -m benchmarks.host_work --rounds 5

One Trainer on CPU (a deep, narrow model: many small parameters, many layers, so the host's per-tensor and
per-layer work shows), packed documents, a new mix every step. Each round times one step of each, alternating:

- before: AdamW's single-tensor step (``foreach=False``), the clip norm one fp64 norm and one multiply per
  gradient, and the document plan derived again at every layer (the step memos bypassed);
- after: the trainer as it is (foreach AdamW, ``torch._foreach_norm`` / ``_foreach_mul_``, the plan derived at
  the first layer and reused: loongtrain/parallel/step_memo.py, attn/ring_step.step_plans).

Printed: per variant the median step seconds, the optimizer's seconds and share, the planning seconds and share
(time inside the planning functions), with the spread over rounds, and after ÷ before.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import warnings
from collections.abc import Iterator

import torch

from benchmarks.common import add_common, header, setup
from loongtrain.attn import api, ops, ring_step
from loongtrain.launch.config import TrainConfig, run_of
from loongtrain.model.config import ModelConfig
from loongtrain.parallel.config import ParallelConfig
from loongtrain.parallel.mesh import single_process_mesh
from loongtrain.train import optim
from loongtrain.train import trainer as trainer_module
from loongtrain.train.trainer import Trainer

PLANNING = ((api, "_mask_tensors"), (ops, "_read_mask"), (ring_step, "plan_step"), (ring_step.Pieces, "__call__"))


def old_clip(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """The clip norm before: one fp64 norm and one multiply per gradient."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads]))
    if max_norm > 0:
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
    return total


class Clock:
    """Seconds spent inside wrapped functions (outermost calls only)."""

    def __init__(self) -> None:
        self.seconds, self._depth = 0.0, 0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.seconds += time.perf_counter() - t0
        return timed


@contextlib.contextmanager
def patched(pairs: list[tuple[object, str, object]]) -> Iterator[None]:
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in pairs]
    for owner, name, value in pairs:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def build(layers: int, seq: int, before: bool) -> Trainer:
    model = ModelConfig(vocab_size=128, dim=32, num_layers=layers, num_heads=4, num_kv_heads=2, ffn_dim=64)
    cfg = TrainConfig.from_dict(dict(seq_len=seq, steps=1000, warmup=1, dtype="fp32", doc_mask="on",
                                     parallel=ParallelConfig(),
                      memory_report=False))
    run = Trainer(run_of(cfg, model), single_process_mesh(), torch.device("cpu"))
    if before:
        run.optimizer = torch.optim.AdamW(run.optimizer.param_groups, foreach=False)
    return run


def batch(step: int, seq: int, documents: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 128, (1, seq + 1), generator=gen)
    starts = torch.zeros(1, seq, dtype=torch.bool)
    starts[0, 0] = True
    starts[0, torch.randperm(seq - 1, generator=gen)[:documents - 1] + 1] = True
    return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:], "position_ids": torch.arange(seq)[None],
            "doc_starts": starts}


def timed_step(run: Trainer, data: dict, before: bool) -> dict[str, float]:
    optimizer_clock, planning_clock = Clock(), Clock()
    clip = old_clip if before else optim.clip_grad_norm
    pairs = [(trainer_module, "clip_grad_norm", optimizer_clock.wrap(clip)),
             (run.optimizer, "step", optimizer_clock.wrap(run.optimizer.step))]
    pairs += [(owner, name, planning_clock.wrap(getattr(owner, name))) for owner, name in PLANNING]
    if before:  # every layer derives the plan again
        fresh = lambda compute, *args: compute(*args)  # noqa: E731
        pairs += [(api, "_MASK_TENSORS", fresh), (ops, "_MASKS", fresh),
                  (ring_step, "step_plans", lambda *args: ring_step.StepPlans(*args))]
    with patched(pairs), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")  # the wrapped step
        t0 = time.perf_counter()
        run.step([data])
        step_s = time.perf_counter() - t0
    return {"step_s": step_s, "optimizer_s": optimizer_clock.seconds, "planning_s": planning_clock.seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--documents", type=int, default=32)
    add_common(parser, rounds=5, threads=1)
    args = parser.parse_args(argv)
    setup(args)
    runs = {name: build(args.layers, args.seq, name == "before") for name in ("before", "after")}
    results: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for step in range(args.rounds + 1):
        data = batch(step, args.seq, args.documents)  # a new mix every step, the same for both
        for name in ("before", "after") if step % 2 else ("after", "before"):
            r = timed_step(runs[name], data, name == "before")
            if step:  # the first: warm-up
                results[name].append(r)
    print(header())
    print(f"{args.layers} layers, {args.seq} tokens, {args.documents} documents, CPU, {args.rounds} rounds "
          f"(median [min, max])")
    medians = {}
    for name, rows in results.items():
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        spread = {k: (min(r[k] for r in rows), max(r[k] for r in rows)) for k in rows[0]}
        medians[name] = med
        print(f"{name:>6}: step {med['step_s'] * 1e3:7.1f} ms [{spread['step_s'][0] * 1e3:.1f}, "
              f"{spread['step_s'][1] * 1e3:.1f}] | optimizer {med['optimizer_s'] * 1e3:6.1f} ms "
              f"({100 * med['optimizer_s'] / med['step_s']:4.1f}%) | planning {med['planning_s'] * 1e3:6.2f} ms "
              f"({100 * med['planning_s'] / med['step_s']:4.1f}%)")
    for key in ("step_s", "optimizer_s", "planning_s"):
        print(f"after / before, {key}: {medians['after'][key] / medians['before'][key]:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
