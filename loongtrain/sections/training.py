"""The sections only ``loongtrain train`` has: the optimisation, the processes, the output and the evaluation in
the loop (docs/configuration.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from loongtrain._options import flag, option, parse_size

PROGRESS = ("auto", "on", "off")
#: the evaluation tasks (``loongtrain eval --task``, ``loongtrain train --eval-tasks``)
EVAL_TASKS = ("passkey", "position-loss")


def check_ranges(section: object, ranges: dict[str, tuple[float, float, bool, bool]]) -> None:
    """Float options of ``section``: finite and inside their range, ``name: (low, high, low inclusive?, high
    inclusive?)`` (AdamW's own checks miss inf and NaN); ValueError naming the option."""
    for name, (low, high, low_in, high_in) in ranges.items():
        value = getattr(section, name)
        inside = (value >= low if low_in else value > low) and (value <= high if high_in else value < high)
        if not (math.isfinite(value) and inside):
            rule = f"{'[' if low_in else '('}{low:g}, {high:g}{']' if high_in else ')'}"
            raise ValueError(f"{flag(name)}={value} must be finite and in {rule}")


def check_counts(section: object, positive: tuple[str, ...], non_negative: tuple[str, ...] = ()) -> None:
    """Integer options of ``section``: ``positive`` ones >= 1, ``non_negative`` ones >= 0; ValueError naming it."""
    for name in positive:
        if getattr(section, name) < 1:
            raise ValueError(f"{flag(name)}={getattr(section, name)} must be a positive integer")
    for name in non_negative:
        if getattr(section, name) < 0:
            raise ValueError(f"{flag(name)}={getattr(section, name)} must be >= 0")


@dataclass
class OptimSection:
    """The optimisation: steps, AdamW and its schedule, clipping, seeds and determinism."""

    steps: int = option(40, group="optimisation", help="optimizer steps of the whole run (the learning-rate "
                        "scheduler spans them; with --seq-len-stages, the sum of its stages' steps)", resume="free")
    lr: float = option(3e-3, "peak learning rate (AdamW)", resume="keep")
    min_lr_ratio: float = option(0.1, "final learning rate of the cosine schedule as a fraction of --lr", resume="free")
    warmup: int = option(5, "linear warmup steps", resume="free")
    weight_decay: float = option(0.1, "AdamW weight decay (not applied to norm weights)", resume="keep")
    beta1: float = option(0.9, "AdamW beta1", resume="keep")
    beta2: float = option(0.95, "AdamW beta2", resume="keep")
    eps: float = option(1e-8, "AdamW epsilon", resume="keep")
    clip: float = option(1.0, "gradient clipping max global L2 norm (0 disables)", resume="free")
    seed: int = option(0, "seed for weights, data order and torch RNGs", resume="keep")
    deterministic: bool = option(False, "torch.use_deterministic_algorithms(True): bit-identical reruns and "
                                 "resumes on the same GPUs and layout, at some speed (docs/launching.md#determinism)",
                                 resume="free")

    def validate(self) -> None:
        check_counts(self, ("steps",), ("warmup",))
        check_ranges(self, {"lr": (0.0, math.inf, False, False), "min_lr_ratio": (0.0, 1.0, True, True),
                            "beta1": (0.0, 1.0, True, False), "beta2": (0.0, 1.0, True, False),
                            "eps": (0.0, math.inf, False, False), "weight_decay": (0.0, math.inf, True, False),
                            "clip": (0.0, math.inf, True, False)})


@dataclass
class RuntimeSection:
    """The processes: how many, the planned layout, threads, timeouts, restarts, and when a run stops early."""

    nproc: int = option(0, group="processes", help="local worker processes to spawn (0: CUDA device count, or "
                        "hp*cp without GPUs: 4 by default); ignored under torchrun. Without --hp and --cp the layout "
                        "follows the world size: hp=2 x cp=2 for a multiple of 4, cp=2 for an even one, else hp=cp=1 "
                        "(one GPU)")
    plan: str = option("", "'auto': let the planner (loongtrain plan) choose hp, cp, inner_ring, placement, zero and "
                       "recompute for this world size and seq-len, overriding those options")
    cluster: str = option("auto", "cluster for --plan auto: a preset (a100, h100, h200), a TOML path, or "
                          "auto (the CUDA device's preset; on CPU this machine, measured)")
    threads: int = option(0, "torch threads per worker (0: 1 when several CPU workers share a machine)")
    memory_report: bool = option(True, "at start, measure per-rank params, grads, optimizer state and saved "
                                 "activations (one extra forward+backward), log them and add them to metrics")
    timeout: float = option(600.0, "seconds a collective may wait for its peers before the run fails")
    heartbeat_timeout: float = option(60.0, "local workers: seconds without a heartbeat (a stopped or frozen "
                                      "worker) before the run ends naming the rank")
    max_restarts: int = option(0, "local workers: restart the job from its newest checkpoint up to N times "
                               "after a worker failure")
    stop_after: int = option(0, "stop this run after N optimizer steps (simulates an interruption; 0: run all)")
    max_bad_steps: int = option(5, "stop the run (exit 1) after N consecutive steps skipped because the loss or "
                                "gradient norm was NaN/inf (0: never stop)")

    def validate(self) -> None:
        check_counts(self, (), ("nproc", "threads", "stop_after", "max_bad_steps", "max_restarts"))
        check_ranges(self, {"timeout": (0.0, math.inf, False, False),
                            "heartbeat_timeout": (0.0, math.inf, False, False)})


@dataclass
class OutputSection:
    """The output directory, checkpoints and logging."""

    out_dir: str = option("runs/train", group="output, checkpoints and logging",
                          help="directory for metrics.jsonl, checkpoints, TensorBoard and plots")
    ckpt_interval: int = option(0, "checkpoint every N steps (0: only at the end); always one at the end")
    keep_checkpoints: int = option(0, "keep only the newest N checkpoints (0: keep all)")
    resume: str = option(
        "", "resume from a checkpoint: a checkpoint directory, 'latest' (OUT_DIR/checkpoints/latest), or "
        "'auto' (the newest complete checkpoint if there is one, else start fresh; the default when torchrun "
        "restarts the job); bare --resume means latest", const="latest")
    overwrite: bool = option(False, "start afresh in an --out-dir that already holds checkpoints, deleting them "
                             "(without it, such a run needs --resume)")
    log_interval: int = option(1, "log metrics every N steps")
    peak_tflops: float = option(0.0, "peak TFLOP/s of one device for MFU (0: table by CUDA device name; on CPU "
                                "measured)")
    progress: str = option("auto", "progress bar: auto (when stdout is a terminal), on, off")
    tensorboard: bool = option(True, "write TensorBoard events when tensorboard is installed")
    plot: bool = option(True, "write loss_curve.png at the end when matplotlib is installed")
    log_all_ranks: bool = option(False, "log from every rank, not only rank 0")

    def validate(self) -> None:
        check_counts(self, ("log_interval",), ("ckpt_interval", "keep_checkpoints"))
        check_ranges(self, {"peak_tflops": (0.0, math.inf, True, False)})
        if self.progress not in PROGRESS:
            raise ValueError(f"--progress={self.progress!r} is not one of {PROGRESS}")


@dataclass
class EvaluationSection:
    """Validation and the evaluation tasks in the loop (docs/evaluation.md)."""

    val_interval: int = option(0, group="evaluation", help="validation loss (forward only, the run's layout) every "
                               "N optimizer steps, logged as val_loss (0: never), on --val-fraction / --val-corpus, "
                               "or without them the corpus's last packed samples (docs/evaluation.md)")
    val_batches: int = option(4, "batches (of --batch-size sequences per replica) per validation")
    eval_tasks: str = option("", "evaluation tasks run at every --val-interval, sharded on the training layout: "
                             "passkey, position-loss, or both comma-separated (as `loongtrain eval`; metrics "
                             "eval/passkey/<length>, eval/position_loss/<start>-<end>; docs/evaluation.md)")
    eval_lengths: str = option("", "lengths of the --eval-tasks, comma-separated (4K = 4096; each divisible by "
                               "2*hp*cp; '': the run's --seq-len): passkey at each, position-loss at the longest")
    eval_trials: int = option(3, "--eval-tasks passkey: prompts per (length, depth) cell (depths 0, 0.25, 0.5, "
                              "0.75, 1)")
    eval_docs: int = option(4, "--eval-tasks position-loss: sequences of the held-out data (--val-fraction / "
                            "--val-corpus), else of the corpus in its order")

    def validate(self) -> None:
        """--eval-tasks are known tasks, run at a validation interval; --eval-lengths parse."""
        check_counts(self, ("val_batches", "eval_trials", "eval_docs"), ("val_interval",))
        tasks = self.tasks()
        unknown = [t for t in tasks if t not in EVAL_TASKS]
        if unknown or (self.eval_tasks.strip() and not tasks):
            raise ValueError(f"--eval-tasks {self.eval_tasks!r}: {unknown or 'no task'}; choose from {EVAL_TASKS}")
        self.lengths(1)  # they parse (ValueError naming a bad one)
        if self.eval_lengths.strip() and not tasks:
            raise ValueError(f"--eval-lengths {self.eval_lengths!r} gives the lengths of --eval-tasks, and none is "
                             f"given")
        if tasks and not self.val_interval:
            raise ValueError(f"--eval-tasks {self.eval_tasks!r} run at every --val-interval N; give N > 0")

    def tasks(self) -> tuple[str, ...]:
        """``--eval-tasks`` as a tuple of task names (empty: none)."""
        return tuple(dict.fromkeys(t.strip() for t in self.eval_tasks.split(",") if t.strip()))

    def lengths(self, seq_len: int) -> tuple[int, ...]:
        """``--eval-lengths`` as token counts (``''``: the run's ``seq_len``); ValueError naming a bad one."""
        parts = [p for p in self.eval_lengths.split(",") if p.strip()]
        if not parts:
            return (seq_len,)
        lengths = tuple(parse_size(p, "--eval-lengths") for p in parts)
        if min(lengths) < 1:
            raise ValueError(f"--eval-lengths {self.eval_lengths!r}: every length must be a positive integer")
        return tuple(dict.fromkeys(lengths))
