"""``TrainConfig``: the single source of every ``loongtrain train`` option (docs/design.md §8).

The command-line parser, its ``--help`` text, and the TOML config file are all generated from the
fields below and from :class:`~loongtrain.parallel.config.ParallelConfig`'s (carried as
``TrainConfig.parallel``; its options keep their flat names: ``--hp``, ``--zero``, ``--ac-mode``, ...),
so a new option is one new field. Precedence: field default < TOML file < command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from loongtrain._input import OneLineParser, check_value, parse_size, read_toml, size_argument
from loongtrain.attn.kernel_choice import bf16_supported
from loongtrain.data.corpus import DECODE_ERRORS
from loongtrain.data.split import check_fraction
from loongtrain.data.tokenizer import Tokenizer
from loongtrain.model.config import ModelConfig
from loongtrain.model.rope_scaling import RopeChange, rope_change
from loongtrain.parallel.config import ParallelConfig
from loongtrain.parallel.documents import CHUNK_LAYOUTS
from loongtrain.train.stages import check_schedule, schedule_totals
from loongtrain.wrap.compile import COMPILE_MODES

log = logging.getLogger("loongtrain.train")

DTYPES = ("auto", "fp32", "bf16", "fp64")
#: the evaluation tasks (``loongtrain eval --task``, ``loongtrain train --eval-tasks``)
EVAL_TASKS = ("passkey", "position-loss")
PROGRESS = ("auto", "on", "off")
DOC_MASK = ("on", "off")
#: ``loongtrain train``'s parallel defaults: 4 workers as hp=2 x cp=2 (ParallelConfig's own are 1 x 1)
DEFAULT_PARALLEL = ParallelConfig(hp=2, cp=2)
PARALLEL_FIELDS = {f.name: f for f in fields(ParallelConfig)}


def _opt(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class TrainConfig:
    """Every option of a training run: one field = one ``--option`` = one TOML key, except ``parallel``,
    whose fields are options of their own (``--hp`` sets ``parallel.hp``)."""

    # model and data
    model: str = _opt("tiny", "model preset (tiny, 1b, 7b-mha, 7b-gqa, 13b) or a local Hugging Face model "
                      "directory (config.json + optional *.safetensors; Llama, Mistral, Qwen2, Qwen3)")
    rope_theta: float = _opt(0.0, "RoPE base (0: the model's own: the preset's, config.json's, or the --init-from "
                             "checkpoint's), e.g. raised to extend the context")
    rope_scaling: str = _opt("", "RoPE scaling as TYPE:key=value,... with Hugging Face's types (linear, yarn, "
                             "llama3) and keys (factor, original_max_position_embeddings, low_freq_factor, "
                             "high_freq_factor, beta_fast, beta_slow, attention_factor), e.g. "
                             "yarn:factor=4,original_max_position_embeddings=8192; 'default': plain RoPE; '': the "
                             "model's own (README: Context extension)")
    init_from: str = _opt("", "start this run from the weights of a loongtrain checkpoint (a checkpoint, "
                          "checkpoints or run directory: its latest), with a fresh optimizer, schedule and data "
                          "stream; the model and its RoPE are the checkpoint's, changed by --rope-theta / "
                          "--rope-scaling; --seq-len may differ. A run that has checkpoints of its own resumes "
                          "those instead (--resume)")
    corpus: str = _opt(
        "stdlib", "corpus: 'stdlib' (this Python's standard-library sources, no download), a .txt/.jsonl "
        "file, a directory of them, a saved Hugging Face dataset, a directory made by `loongtrain prepare` "
        "(memory-mapped), or a mixture NAME=WEIGHT,... of these (e.g. a=0.7,b=0.3)"
    )
    val_fraction: float = _opt(0.0, "hold out this fraction of the corpus's documents for validation, chosen "
                               "by a hash of the document number and --seed (0: none; else in (0, 1))")
    val_corpus: str = _opt("", "validation corpus of its own (any --corpus form; instead of --val-fraction)")
    tokenizer: str = _opt("auto", "tokenizer: 'auto' (the --model directory's Hugging Face tokenizer when it "
                          "has one, else 'byte'), 'byte' (UTF-8 bytes, vocab 256) or a local Hugging Face "
                          "tokenizer path")
    decode_errors: str = _opt("strict", "corpus bytes that are not UTF-8: strict (an error naming the file and "
                              "byte offset), replace (U+FFFD) or ignore (dropped)")
    seq_len: int = _opt(8192, "tokens per sequence, e.g. 131072, 128K, 1M (must be divisible by 2*hp*cp); "
                        "with --seq-len-schedule, its longest length", size=True)
    seq_len_schedule: str = _opt(
        "", "train in stages of increasing length: LENGTH:STEPS,... e.g. 8K:1000,32K:400,128K:100 (--steps is "
        "their sum; every length must suit the layout; docs/design.md §10)")
    schedule_tokens: str = _opt(
        "constant", "with --seq-len-schedule: constant (every stage keeps the first stage's tokens per step: "
        "fewer sequences per micro-step or fewer micro-steps as the length grows) or free (every stage "
        "keeps --batch-size and --grad-accum)")
    doc_mask: str = _opt("on", "on: in packed corpora a token attends only inside its own document (block-"
                         "skipping ring attention; MFU counts only visible pairs); off: causal over the whole "
                         "packed sequence (loongtrain's decoder and Hugging Face models)")
    position_reset: bool = _opt(True, "with --doc-mask on, position ids restart at 0 in each document")
    chunk_layout: str = _opt("zigzag", "how each sequence is laid on the context ranks: zigzag, or balanced "
                             "(with --doc-mask on and cp > 1: per batch, chunks go to the ranks by their "
                             "documents' visible-pair work, so no rank waits for a busier one; batches "
                             "without document marks stay zigzag)")
    batch_size: int = _opt(1, "sequences per data-parallel replica per micro-step (with --seq-len-schedule: in "
                           "the first stage)")
    grad_accum: int = _opt(1, "micro-steps accumulated per optimizer step (with --seq-len-schedule: in the first "
                           "stage)")
    # optimisation
    steps: int = _opt(40, "optimizer steps of the whole run (the learning-rate schedule spans them; with "
                      "--seq-len-schedule, the sum of its stages' steps)")
    lr: float = _opt(3e-3, "peak learning rate (AdamW)")
    min_lr_ratio: float = _opt(0.1, "final learning rate of the cosine schedule as a fraction of --lr")
    warmup: int = _opt(5, "linear warmup steps")
    weight_decay: float = _opt(0.1, "AdamW weight decay (not applied to norm weights)")
    beta1: float = _opt(0.9, "AdamW beta1")
    beta2: float = _opt(0.95, "AdamW beta2")
    eps: float = _opt(1e-8, "AdamW epsilon")
    clip: float = _opt(1.0, "gradient clipping max global L2 norm (0 disables)")
    dtype: str = _opt(
        "auto", "compute dtype: auto (bf16 on CUDA devices with native bf16, else fp32), fp32, bf16 (fp32 "
        "weights, bf16 compute: FSDP2 gathers bf16 weights under ZeRO, autocast otherwise), fp64"
    )
    compile: str = _opt("auto", "torch.compile each decoder block: on, off, or auto (on a CUDA device on which "
                        "a GPU run measured it faster, wrap/compile.py COMPILE_FASTER_ON; none has yet, so "
                        "auto is off everywhere; CPU compiles only with on)")
    seed: int = _opt(0, "seed for weights, data order and torch RNGs")
    deterministic: bool = _opt(False, "torch.use_deterministic_algorithms(True): bit-identical reruns and "
                               "resumes on the same GPUs and layout, at some speed (README: Determinism)")
    # parallelism and memory: --hp, --cp, --window, --placement, --interleaved, --zero,
    # --zero-shard-size, --reshard-after-forward, --ac-mode, --ac-fraction (ParallelConfig's fields)
    parallel: ParallelConfig = _opt(DEFAULT_PARALLEL, "degrees, placement, ZeRO and activation checkpointing")
    nproc: int = _opt(
        0, "local worker processes to spawn (0: CUDA device count, or hp*cp without GPUs); "
        "ignored under torchrun"
    )
    plan: str = _opt("", "'auto': let the planner (loongtrain plan) choose hp, cp, window, placement, zero and "
                     "ac-mode for this world size and seq-len, overriding those options")
    plan_cluster: str = _opt("auto", "cluster for --plan auto: a preset (a100, h100, h200), a TOML path, or "
                             "auto (the CUDA device's preset; on CPU this machine, measured)")
    threads: int = _opt(0, "torch threads per worker (0: 1 when several CPU workers share a machine)")
    memory_report: bool = _opt(True, "at start, measure per-rank params, grads, optimizer state and saved "
                               "activations (one extra forward+backward), log them and add them to metrics")
    # output, checkpoints, logging
    out_dir: str = _opt("runs/train", "directory for metrics.jsonl, checkpoints, TensorBoard and plots")
    ckpt_interval: int = _opt(0, "checkpoint every N steps (0: only at the end); always one at the end")
    keep_checkpoints: int = _opt(0, "keep only the newest N checkpoints (0: keep all)")
    resume: str = _opt(
        "", "resume from a checkpoint: a checkpoint directory, 'latest' (OUT_DIR/checkpoints/latest), or "
        "'auto' (the newest complete checkpoint if there is one, else start fresh; the default when torchrun "
        "restarts the job); bare --resume means latest", const="latest"
    )
    overwrite: bool = _opt(False, "start afresh in an --out-dir that already holds checkpoints, deleting them "
                           "(without it, such a run needs --resume)")
    stop_after: int = _opt(0, "stop this run after N optimizer steps (simulates an interruption; 0: run all)")
    max_bad_steps: int = _opt(5, "stop the run (exit 1) after N consecutive steps skipped because the loss or "
                              "gradient norm was NaN/inf (0: never stop)")
    timeout: float = _opt(600.0, "seconds a collective may wait for its peers before the run fails")
    heartbeat_timeout: float = _opt(60.0, "local workers: seconds without a heartbeat (a stopped or frozen "
                                    "worker) before the run ends naming the rank")
    max_restarts: int = _opt(0, "local workers: restart the job from its newest checkpoint up to N times "
                             "after a worker failure")
    log_interval: int = _opt(1, "log metrics every N steps")
    val_interval: int = _opt(0, "validation loss (forward only, the run's layout) every N optimizer steps, "
                              "logged as val_loss (0: never), on --val-fraction / --val-corpus, or without "
                              "them the corpus's last packed samples (docs/design.md §14)")
    val_batches: int = _opt(4, "batches (of --batch-size sequences per replica) per validation")
    eval_tasks: str = _opt("", "evaluation tasks run at every --val-interval, sharded on the training layout: "
                           "passkey, position-loss, or both comma-separated (as `loongtrain eval`; metrics "
                           "eval/passkey/<length>, eval/position_loss/<start>-<end>; docs/design.md §14)")
    eval_lengths: str = _opt("", "lengths of the --eval-tasks, comma-separated (4K = 4096; each divisible by "
                             "2*hp*cp; '': the run's --seq-len): passkey at each, position-loss at the longest")
    eval_trials: int = _opt(3, "--eval-tasks passkey: prompts per (length, depth) cell (depths 0, 0.25, 0.5, "
                            "0.75, 1)")
    eval_docs: int = _opt(4, "--eval-tasks position-loss: sequences of the held-out data (--val-fraction / "
                          "--val-corpus), else of the corpus in its order")
    peak_tflops: float = _opt(
        0.0, "peak TFLOP/s of one device for MFU (0: table by CUDA device name; on CPU measured)"
    )
    progress: str = _opt("auto", "progress bar: auto (when stdout is a terminal), on, off")
    tensorboard: bool = _opt(True, "write TensorBoard events when tensorboard is installed")
    plot: bool = _opt(True, "write loss_curve.png at the end when matplotlib is installed")
    log_all_ranks: bool = _opt(False, "log from every rank, not only rank 0")

    def validate(self) -> None:
        """Raise ValueError for values that are wrong whatever the machine (ranges, choices)."""
        if not isinstance(self.parallel, ParallelConfig):  # a ParallelConfig validated itself when built
            raise ValueError(f"parallel={self.parallel!r} must be a ParallelConfig")
        positive = ("seq_len", "batch_size", "grad_accum", "steps", "log_interval", "val_batches", "eval_trials",
                    "eval_docs")
        for name in positive:
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"--{_flag(name)}={value} must be a positive integer")
        for name in ("warmup", "nproc", "threads", "ckpt_interval", "keep_checkpoints", "stop_after",
                     "max_bad_steps", "max_restarts", "val_interval"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{_flag(name)}={getattr(self, name)} must be >= 0")
        self._validate_ranges()
        self.rope_change()
        check_fraction(self.val_fraction)
        if self.val_fraction and self.val_corpus:
            raise ValueError(f"--val-fraction={self.val_fraction} and --val-corpus={self.val_corpus!r}: give "
                             f"one of them")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype={self.dtype!r} is not one of {DTYPES}")
        if self.progress not in PROGRESS:
            raise ValueError(f"--progress={self.progress!r} is not one of {PROGRESS}")
        if self.decode_errors not in DECODE_ERRORS:
            raise ValueError(f"--decode-errors={self.decode_errors!r} is not one of {DECODE_ERRORS}")
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"--compile={self.compile!r} is not one of {COMPILE_MODES}")
        if self.doc_mask not in DOC_MASK:
            raise ValueError(f"--doc-mask={self.doc_mask!r} is not one of {DOC_MASK}")
        if self.chunk_layout not in CHUNK_LAYOUTS:
            raise ValueError(f"--chunk-layout={self.chunk_layout!r} is not one of {CHUNK_LAYOUTS}")
        if self.chunk_layout == "balanced" and self.doc_mask != "on":
            raise ValueError("--chunk-layout=balanced balances packed documents' attention work and needs "
                             f"--doc-mask on (got --doc-mask {self.doc_mask})")
        check_schedule(self)  # --seq-len-schedule, --schedule-tokens, and what they make of --steps, --seq-len
        self._validate_eval_tasks()

    def _validate_eval_tasks(self) -> None:
        """--eval-tasks are known tasks, run at a validation interval; --eval-lengths parse."""
        tasks = eval_task_list(self)
        unknown = [t for t in tasks if t not in EVAL_TASKS]
        if unknown or (self.eval_tasks.strip() and not tasks):
            raise ValueError(f"--eval-tasks {self.eval_tasks!r}: {unknown or 'no task'}; choose from {EVAL_TASKS}")
        eval_length_list(self)  # they parse (ValueError naming a bad one)
        if self.eval_lengths.strip() and not tasks:
            raise ValueError(f"--eval-lengths {self.eval_lengths!r} gives the lengths of --eval-tasks, and none is "
                             f"given")
        if tasks and not self.val_interval:
            raise ValueError(f"--eval-tasks {self.eval_tasks!r} run at every --val-interval N; give N > 0")

    def _validate_ranges(self) -> None:
        """Float options: finite and inside their range (AdamW's own checks miss inf and NaN)."""
        ranges = {  # name: (low, high, low inclusive?, high inclusive?)
            "lr": (0.0, math.inf, False, False), "min_lr_ratio": (0.0, 1.0, True, True),
            "beta1": (0.0, 1.0, True, False), "beta2": (0.0, 1.0, True, False),
            "eps": (0.0, math.inf, False, False), "weight_decay": (0.0, math.inf, True, False),
            "clip": (0.0, math.inf, True, False), "peak_tflops": (0.0, math.inf, True, False),
            "timeout": (0.0, math.inf, False, False), "heartbeat_timeout": (0.0, math.inf, False, False),
        }
        for name, (low, high, low_in, high_in) in ranges.items():
            value = getattr(self, name)
            inside = (value >= low if low_in else value > low) and (value <= high if high_in else value < high)
            if not (math.isfinite(value) and inside):
                rule = f"{'[' if low_in else '('}{low:g}, {high:g}{']' if high_in else ')'}"
                raise ValueError(f"--{_flag(name)}={value} must be finite and in {rule}")

    def rope_change(self) -> RopeChange:
        """``--rope-theta`` / ``--rope-scaling`` parsed (:func:`loongtrain.model.rope_scaling.rope_change`)."""
        return rope_change(self.rope_theta, self.rope_scaling)

    def to_dict(self) -> dict[str, Any]:
        """Plain values, ``parallel`` as a nested dict (what checkpoints record; :meth:`from_dict` reads it)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> TrainConfig:
        """A TrainConfig from option names (underscores): its own fields, ParallelConfig's fields given
        flat (``hp``, ``zero``, ...) and/or a ``parallel`` mapping of them (flat names win). Options not
        given keep their defaults (``DEFAULT_PARALLEL`` for the parallel ones). Raises ValueError."""
        own: dict[str, Any] = {}
        nested: dict[str, Any] = {}
        flat: dict[str, Any] = {}
        for key, value in _renamed(values).items():
            if key == "parallel":
                nested.update(dataclasses.asdict(value) if isinstance(value, ParallelConfig) else value)
            elif key in PARALLEL_FIELDS:
                flat[key] = value
            else:
                own[key] = value
        unknown = sorted(set(nested) - set(PARALLEL_FIELDS))
        if unknown:
            raise ValueError(f"unknown parallel option(s) {unknown}; valid: {sorted(PARALLEL_FIELDS)}")
        parallel = dataclasses.replace(DEFAULT_PARALLEL, **{**nested, **flat})
        if isinstance(own.get("seq_len_schedule"), str) and own["seq_len_schedule"]:
            steps, longest = schedule_totals(own["seq_len_schedule"])  # what a schedule makes of --steps, --seq-len
            own.setdefault("steps", steps)
            own.setdefault("seq_len", longest)
        try:
            return cls(**own, parallel=parallel)
        except TypeError as exc:
            raise ValueError(f"invalid TrainConfig option: {exc}") from None


@dataclass(frozen=True)
class Run:
    """A run resolved once by the launcher before any worker starts (docs/design.md §10): the options, the
    model's shape, the tokenizer (None: the batch source needs none), the checkpoint to resume from
    ("" for a fresh start), the in-loop evaluations (``--eval-tasks``: callables the launch path builds
    from the evaluation tasks, :class:`~loongtrain.train.validation.Evaluation`; ``train`` does not import
    them) and the identity of its data (the corpus's content and the tokenizer's, which every checkpoint
    records and a resume compares; None when not known). :class:`~loongtrain.train.trainer.Trainer` is
    built from it."""

    cfg: TrainConfig
    model_config: ModelConfig
    tokenizer: Tokenizer | None = None
    resume: str = ""
    evaluations: tuple[Any, ...] = ()
    data_identity: dict[str, Any] | None = None


def eval_task_list(cfg: TrainConfig) -> tuple[str, ...]:
    """``--eval-tasks`` as a tuple of task names (empty: none)."""
    return tuple(dict.fromkeys(t.strip() for t in cfg.eval_tasks.split(",") if t.strip()))


def eval_length_list(cfg: TrainConfig) -> tuple[int, ...]:
    """``--eval-lengths`` as token counts (``''``: the run's ``--seq-len``); ValueError naming a bad one."""
    parts = [p for p in cfg.eval_lengths.split(",") if p.strip()]
    if not parts:
        return (cfg.seq_len,)
    lengths = tuple(parse_size(p, "--eval-lengths") for p in parts)
    if min(lengths) < 1:
        raise ValueError(f"--eval-lengths {cfg.eval_lengths!r}: every length must be a positive integer")
    return tuple(dict.fromkeys(lengths))


def param_dtype(cfg: TrainConfig) -> torch.dtype:
    """Storage dtype of the weights (and optimizer state): float64 for --dtype fp64, else float32."""
    return torch.float64 if cfg.dtype == "fp64" else torch.float32


def autocast_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype | None:
    """The low-precision compute dtype: bf16 for --dtype bf16, and for --dtype auto on a CUDA device
    with native bf16 (``bf16_supported``: sm80+); None: compute in :func:`param_dtype`.

    How it is applied (:class:`Trainer`): under FSDP2 the weights are gathered in bf16
    (``MixedPrecisionPolicy``) and the forward runs WITHOUT autocast, since autocast would cache a bf16
    copy of every gathered fp32 weight until the region ends, i.e. a whole unsharded bf16 model;
    without FSDP (replicated weights) it is ``torch.autocast``. Either way norms, RoPE, the softmax
    statistics and the loss are computed in fp32 by the model and loss themselves.
    """
    if cfg.dtype == "bf16" or (cfg.dtype == "auto" and device.type == "cuda" and bf16_supported(device)):
        return torch.bfloat16
    return None


#: option names before validation and eval got names of their own -> the names now (kept for one release:
#: on the command line, in TOML files and in the options a checkpoint records)
ALIASES = {"eval_interval": "val_interval", "eval_batches": "val_batches"}


def _renamed(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` with :data:`ALIASES` replaced by their new names (a warning for each one used)."""
    out = {}
    for key, value in values.items():
        name = key.replace("-", "_")
        if name in ALIASES:
            log.warning("--%s is now --%s (the old name goes in the next release)", _flag(name), _flag(ALIASES[name]))
            key = ALIASES[name]
        out[key] = value
    return out


# --help sections: the option that opens each one
GROUPS = {
    "model": "model and data",
    "steps": "optimisation",
    "hp": "parallelism and processes",
    "zero": "memory (ZeRO / activation checkpointing)",
    "out_dir": "output, checkpoints and logging",
}


def options() -> list[tuple[dataclasses.Field, Any]]:
    """Every command-line option as (field, default), in --help order: TrainConfig's fields, with
    ParallelConfig's layout fields (hp ... interleaved) in place of ``parallel`` and its memory fields
    (zero ... ac_fraction) opening the memory section; defaults from :data:`DEFAULT_PARALLEL`."""
    par = [(p, getattr(DEFAULT_PARALLEL, p.name)) for p in fields(ParallelConfig)]
    split = [p.name for p, _ in par].index("zero")
    out: list[tuple[dataclasses.Field, Any]] = []
    for f in fields(TrainConfig):
        if f.name == "parallel":
            out += par[:split]
            continue
        if f.name == "memory_report":
            out += par[split:]
        out.append((f, f.default))
    return out


def _flag(name: str) -> str:
    return name.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    """An argparse parser generated from :class:`TrainConfig`; every option shows its default.

    Defaults are suppressed in the parsed namespace so that only options given on the command line
    override the TOML file.
    """
    parser = OneLineParser(
        prog="loongtrain train",
        description="Train a LLaMA-style model with 2D-Attention (hp x cp sequence parallelism, dp "
        "replicas on top). Options may also be set in a TOML file (--config) with the same names "
        "(dashes or underscores); command-line options win over the file.",
        argument_default=argparse.SUPPRESS,
        allow_abbrev=False,
    )
    parser.add_argument("--config", metavar="FILE", help="TOML file setting any of the options below")
    group: Any = parser
    for f, default in options():
        if f.name in GROUPS:
            group = parser.add_argument_group(GROUPS[f.name])
        flags = ["--" + _flag(f.name)] + ["--" + _flag(old) for old, new in ALIASES.items() if new == f.name]
        help_text = f"{f.metadata['help']} (default: {default!r})"
        kind = type(default)
        if kind is bool:
            group.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction, help=help_text)
        elif "const" in f.metadata:
            group.add_argument(*flags, dest=f.name, nargs="?", const=f.metadata["const"], type=kind,
                               metavar=f.name.upper(), help=help_text)
        else:
            kind = size_argument if f.metadata.get("size") else kind  # 128K, 1M: the one size parser
            group.add_argument(*flags, dest=f.name, type=kind, metavar=f.name.upper(), help=help_text)
    return parser


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML file of options (flat keys; ``[train]`` and ``[parallel]`` tables are also accepted)
    as a flat dict of option names with checked types."""
    data = read_toml(path)
    for table in ("train", "parallel"):
        if isinstance(data.get(table), dict):
            data = {**{k: v for k, v in data.items() if k != table}, **data[table]}
    known = {f.name: type(default) for f, default in options()}
    sizes = {f.name for f, _ in options() if f.metadata.get("size")}
    out: dict[str, Any] = {}
    for key, value in _renamed(data).items():
        name = key.replace("-", "_")
        if name not in known:
            raise ValueError(f"config file {str(path)!r}: unknown option {key!r}; valid: {sorted(known)}")
        if name in sizes and isinstance(value, str):
            value = parse_size(value, name)
        out[name] = check_value(f"config file {str(path)!r}", key, value, known[name])
    return out


def parse_args(argv: list[str]) -> TrainConfig:
    """TrainConfig from command-line arguments (and the TOML file they name). Raises ValueError."""
    parser = build_parser()
    try:
        namespace, unknown = parser.parse_known_args(argv)
    except SystemExit as exc:  # --help exits 0; argparse reports bad values by exiting non-zero
        if not exc.code:
            raise
        raise ValueError(f"invalid arguments: {' '.join(argv)}") from exc
    if unknown:
        raise ValueError(
            f"unknown option(s) {unknown}; run `loongtrain train --help` for the list of options"
        )
    for old in ALIASES:
        if any(arg == f"--{_flag(old)}" or arg.startswith(f"--{_flag(old)}=") for arg in argv):
            _renamed({old: None})  # the warning
    given = vars(namespace)
    values: dict[str, Any] = {}
    config_file = given.pop("config", None)
    if config_file is not None:
        values.update(load_toml(config_file))
    values.update(given)
    cfg = TrainConfig.from_dict(values)
    cfg.validate()
    return cfg
