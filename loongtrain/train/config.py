"""``TrainConfig``: the single source of every ``loongtrain train`` option (docs/configuration.md).

The command-line parser, its ``--help`` text, and the TOML config file are all generated from the
fields below (:mod:`loongtrain.commands.parser`) and from :class:`~loongtrain.parallel.config.ParallelConfig`'s
(carried as ``TrainConfig.parallel``; its options keep their flat names: ``--hp``, ``--zero``,
``--recompute``, ...), so a new option is one new field. Precedence: field default < TOML file < command line.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

from loongtrain._options import flag, option, parse_size
from loongtrain.attn.kernel_choice import bf16_supported
from loongtrain.data.chat import LOSS_ON
from loongtrain.data.corpus import DECODE_ERRORS
from loongtrain.data.post_training import OBJECTIVES, PRETRAIN
from loongtrain.data.split import check_fraction
from loongtrain.data.tokenizer import Tokenizer
from loongtrain.data.whole_packing import ON_LONG
from loongtrain.model.config import ModelConfig
from loongtrain.model.lora import LoraConfig, parse_lora
from loongtrain.model.rope_scaling import RopeChange, rope_change
from loongtrain.parallel.config import ParallelConfig
from loongtrain.parallel.documents import CHUNK_ORDERS
from loongtrain.parallelize.compile import COMPILE_MODES
from loongtrain.train.stages import check_stages, stage_totals

log = logging.getLogger("loongtrain.train")

DTYPES = ("auto", "fp32", "bf16", "fp64")
#: the evaluation tasks (``loongtrain eval --task``, ``loongtrain train --eval-tasks``)
EVAL_TASKS = ("passkey", "position-loss")
PROGRESS = ("auto", "on", "off")
DOC_MASK = ("on", "off")
#: ``loongtrain train``'s parallel defaults: 4 workers as hp=2 x cp=2 (ParallelConfig's own are 1 x 1)
DEFAULT_PARALLEL = ParallelConfig(hp=2, cp=2)
PARALLEL_FIELDS = {f.name: f for f in fields(ParallelConfig)}


@dataclass
class TrainConfig:
    """Every option of a training run: one field = one ``--option`` = one TOML key, except ``parallel``,
    whose fields are options of their own (``--hp`` sets ``parallel.hp``)."""

    # model and data
    model: str = option("tiny", group="model and data", help="model preset (tiny, 1b, 7b-mha, 7b-gqa, 13b) or a "
                        "local Hugging Face model directory (config.json + optional *.safetensors; Llama, Mistral, "
                        "Qwen2, Qwen3)")
    rope_theta: float = option(0.0, "RoPE base (0: the model's own: the preset's, config.json's, or the --init-from "
                             "checkpoint's), e.g. raised to extend the context")
    rope_scaling: str = option("", "RoPE scaling as TYPE:key=value,... with Hugging Face's types (linear, yarn, "
                             "llama3) and keys (factor, original_max_position_embeddings, low_freq_factor, "
                             "high_freq_factor, beta_fast, beta_slow, attention_factor), e.g. "
                             "yarn:factor=4,original_max_position_embeddings=8192; 'default': plain RoPE; '': the "
                             "model's own (docs/context-extension.md)")
    init_from: str = option("", "start this run from the weights of a loongtrain checkpoint (a checkpoint, "
                          "checkpoints or run directory: its latest), with a fresh optimizer, lr scheduler and data "
                          "stream; the model and its RoPE are the checkpoint's, changed by --rope-theta / "
                          "--rope-scaling; --seq-len may differ. A run that has checkpoints of its own resumes "
                          "those instead (--resume)")
    lora: str = option("", "train LoRA adapters on a frozen base instead of every weight: "
                       "r=16,alpha=32,dropout=0,targets=q_proj,k_proj,v_proj,o_proj (each key optional, these are the "
                       "defaults; targets: Hugging Face's module names, or all-linear; loongtrain's decoder also "
                       "takes its own, wq,wk,wv,wo,w1,w2,w3); checkpoints hold only the adapters, export also "
                       "writes them in PEFT's format (docs/lora.md); '': off")
    corpus: str = option(
        "stdlib", "corpus: 'stdlib' (this Python's standard-library sources, no download), a .txt/.jsonl "
        "file, a directory of them, a saved Hugging Face dataset, a directory made by `loongtrain prepare` "
        "(memory-mapped), or a mixture NAME=WEIGHT,... of these (e.g. a=0.7,b=0.3)"
    )
    val_fraction: float = option(0.0, "hold out this fraction of the corpus's documents for validation, chosen "
                               "by a hash of the document number and --seed (0: none; else in (0, 1))")
    val_corpus: str = option("", "validation corpus of its own (any --corpus form; instead of --val-fraction)")
    tokenizer: str = option("auto", "tokenizer: 'auto' (the --model directory's Hugging Face tokenizer when it "
                          "has one, else 'byte'), 'byte' (UTF-8 bytes, vocab 256) or a local Hugging Face "
                          "tokenizer path")
    decode_errors: str = option("strict", "corpus bytes that are not UTF-8: strict (an error naming the file and "
                              "byte offset), replace (U+FFFD) or ignore (dropped)")
    seq_len: int = option(8192, "tokens per sequence, e.g. 131072, 128K, 1M (must be divisible by 2*hp*cp); "
                        "with --seq-len-stages, its longest length", size=True)
    seq_len_stages: str = option(
        "", "train in stages of increasing length: LENGTH:STEPS,... e.g. 8K:1000,32K:400,128K:100 (--steps is "
        "their sum; every length must suit the layout; docs/context-extension.md#seq-len-stages)")
    stage_tokens: str = option(
        "constant", "with --seq-len-stages: constant (every step holds the longest stage's tokens: a shorter "
        "stage puts longest/length times --batch-size sequences into a micro-step; its length must divide the "
        "longest) or free (every stage keeps --batch-size and --grad-accum)")
    doc_mask: str = option("on", "on: in packed corpora a token attends only inside its own document (block-"
                         "skipping ring attention; MFU counts only visible pairs); off: causal over the whole "
                         "packed sequence (loongtrain's decoder and Hugging Face models)")
    position_reset: bool = option(True, "with --doc-mask on, position ids restart at 0 in each document")
    chunk_order: str = option("zigzag", "how each sequence is laid on the context ranks: zigzag, or balanced "
                             "(with --doc-mask on and cp > 1: per batch, chunks go to the ranks by their "
                             "documents' visible-pair work, so no rank waits for a busier one; batches "
                             "without document marks stay zigzag)")
    batch_size: int = option(1, "sequences per data-parallel replica per micro-step (with --seq-len-stages: in "
                           "the longest stage)")
    grad_accum: int = option(1, "micro-steps accumulated per optimizer step (with --seq-len-stages: in the longest "
                           "stage)")
    # optimisation
    steps: int = option(40, group="optimisation", help="optimizer steps of the whole run (the learning-rate "
                        "scheduler spans them; with "
                      "--seq-len-stages, the sum of its stages' steps)")
    lr: float = option(3e-3, "peak learning rate (AdamW)")
    min_lr_ratio: float = option(0.1, "final learning rate of the cosine schedule as a fraction of --lr")
    warmup: int = option(5, "linear warmup steps")
    weight_decay: float = option(0.1, "AdamW weight decay (not applied to norm weights)")
    beta1: float = option(0.9, "AdamW beta1")
    beta2: float = option(0.95, "AdamW beta2")
    eps: float = option(1e-8, "AdamW epsilon")
    clip: float = option(1.0, "gradient clipping max global L2 norm (0 disables)")
    dtype: str = option(
        "auto", "compute dtype: auto (bf16 on CUDA devices with native bf16, else fp32), fp32, bf16 (fp32 "
        "weights, bf16 compute: FSDP2 gathers bf16 weights under ZeRO, autocast otherwise), fp64"
    )
    compile: str = option("off", "torch.compile each decoder block: off or on (docs/compile.md)")
    seed: int = option(0, "seed for weights, data order and torch RNGs")
    deterministic: bool = option(False, "torch.use_deterministic_algorithms(True): bit-identical reruns and "
                               "resumes on the same GPUs and layout, at some speed (docs/launching.md#determinism)")
    nproc: int = option(0, group="processes", help="local worker processes to spawn (0: CUDA device count, or "
                        "hp*cp without GPUs); ignored under torchrun")
    plan: str = option("", "'auto': let the planner (loongtrain plan) choose hp, cp, inner_ring, placement, zero and "
                     "recompute for this world size and seq-len, overriding those options")
    cluster: str = option("auto", "cluster for --plan auto: a preset (a100, h100, h200), a TOML path, or "
                             "auto (the CUDA device's preset; on CPU this machine, measured)")
    threads: int = option(0, "torch threads per worker (0: 1 when several CPU workers share a machine)")
    # layout and memory: --hp, --cp, --inner-ring, --placement, --interleaved, --zero, --zero-shard-size,
    # --reshard-after-forward, --recompute, ... (ParallelConfig's fields, each an option of its own)
    parallel: ParallelConfig = option(DEFAULT_PARALLEL, "degrees, placement, ZeRO and recompute")
    memory_report: bool = option(True, "at start, measure per-rank params, grads, optimizer state and saved "
                               "activations (one extra forward+backward), log them and add them to metrics")
    # output, checkpoints, logging
    out_dir: str = option("runs/train", group="output, checkpoints and logging",
                          help="directory for metrics.jsonl, checkpoints, TensorBoard and plots")
    ckpt_interval: int = option(0, "checkpoint every N steps (0: only at the end); always one at the end")
    keep_checkpoints: int = option(0, "keep only the newest N checkpoints (0: keep all)")
    resume: str = option(
        "", "resume from a checkpoint: a checkpoint directory, 'latest' (OUT_DIR/checkpoints/latest), or "
        "'auto' (the newest complete checkpoint if there is one, else start fresh; the default when torchrun "
        "restarts the job); bare --resume means latest", const="latest"
    )
    overwrite: bool = option(False, "start afresh in an --out-dir that already holds checkpoints, deleting them "
                           "(without it, such a run needs --resume)")
    stop_after: int = option(0, "stop this run after N optimizer steps (simulates an interruption; 0: run all)")
    max_bad_steps: int = option(5, "stop the run (exit 1) after N consecutive steps skipped because the loss or "
                              "gradient norm was NaN/inf (0: never stop)")
    timeout: float = option(600.0, "seconds a collective may wait for its peers before the run fails")
    heartbeat_timeout: float = option(60.0, "local workers: seconds without a heartbeat (a stopped or frozen "
                                    "worker) before the run ends naming the rank")
    max_restarts: int = option(0, "local workers: restart the job from its newest checkpoint up to N times "
                             "after a worker failure")
    log_interval: int = option(1, "log metrics every N steps")
    val_interval: int = option(0, "validation loss (forward only, the run's layout) every N optimizer steps, "
                              "logged as val_loss (0: never), on --val-fraction / --val-corpus, or without "
                              "them the corpus's last packed samples (docs/evaluation.md)")
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
    peak_tflops: float = option(
        0.0, "peak TFLOP/s of one device for MFU (0: table by CUDA device name; on CPU measured)"
    )
    progress: str = option("auto", "progress bar: auto (when stdout is a terminal), on, off")
    tensorboard: bool = option(True, "write TensorBoard events when tensorboard is installed")
    plot: bool = option(True, "write loss_curve.png at the end when matplotlib is installed")
    log_all_ranks: bool = option(False, "log from every rank, not only rank 0")
    # post-training (docs/post-training.md)
    objective: str = option(PRETRAIN, group="post-training", help="what the run trains on: pretrain (every token "
                            "of a text corpus), sft (conversations {\"messages\": [...]} of .jsonl rows or a "
                            "prepared corpus: their assistant tokens), dpo (preference pairs {\"prompt\", "
                            "\"chosen\", \"rejected\"})")
    loss_on: str = option("assistant", "--objective sft: the targets: assistant (the chat template's generation "
                          "blocks, else each assistant turn and its end-of-turn token) or all (every token)")
    chat_template: str = option("", "--objective sft/dpo: a Jinja chat template file to render conversations with "
                                "('': the tokenizer's own)")
    on_long: str = option("drop", "--objective sft/dpo: a conversation or pair longer than --seq-len is left out "
                          "(drop, counted in the log) or refused (error)")
    dpo_beta: float = option(0.1, "--objective dpo: beta, the strength of the KL penalty toward the reference")
    ref_model: str = option("", "--objective dpo: the frozen reference: a loongtrain run or checkpoint, or a Hugging "
                            "Face model directory, of the policy's architecture and vocabulary ('': the policy's "
                            "initial weights)")

    def validate(self) -> None:
        """Raise ValueError for values that are wrong whatever the machine (ranges, choices)."""
        if not isinstance(self.parallel, ParallelConfig):  # a ParallelConfig validated itself when built
            raise ValueError(f"parallel={self.parallel!r} must be a ParallelConfig")
        positive = ("seq_len", "batch_size", "grad_accum", "steps", "log_interval", "val_batches", "eval_trials",
                    "eval_docs")
        for name in positive:
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{flag(name)}={value} must be a positive integer")
        for name in ("warmup", "nproc", "threads", "ckpt_interval", "keep_checkpoints", "stop_after",
                     "max_bad_steps", "max_restarts", "val_interval"):
            if getattr(self, name) < 0:
                raise ValueError(f"{flag(name)}={getattr(self, name)} must be >= 0")
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
        if self.chunk_order not in CHUNK_ORDERS:
            raise ValueError(f"--chunk-order={self.chunk_order!r} is not one of {CHUNK_ORDERS}")
        if self.chunk_order == "balanced" and self.doc_mask != "on":
            raise ValueError("--chunk-order=balanced balances packed documents' attention work and needs "
                             f"--doc-mask on (got --doc-mask {self.doc_mask})")
        check_stages(self)  # --seq-len-stages, --stage-tokens, and what they make of --steps, --seq-len
        self._validate_eval_tasks()
        self._validate_lora()
        self._validate_objective()

    def _validate_lora(self) -> None:
        """--lora parses; it composes with the other options (its targets are checked against the model by
        the launcher: loongtrain.train.model_setup.lora_targets)."""
        lora = self.lora_config()
        if lora is None:
            return
        if self.init_from:
            raise ValueError(f"--lora with --init-from {self.init_from!r}: a LoRA run's base is a preset or a Hugging "
                             f"Face directory; export the checkpoint (loongtrain export) and pass it as --model")
        mlp = {"gate_proj", "up_proj", "down_proj", "w1", "w2", "w3", "all-linear"}
        if lora.dropout and str(self.parallel.mlp_tiles) != "1" and mlp & set(lora.targets):
            raise ValueError(f"--lora dropout={lora.dropout:g} on MLP modules with --mlp-tiles "
                             f"{self.parallel.mlp_tiles}: the tiles' recompute would draw new dropout masks; use "
                             f"--mlp-tiles 1, dropout=0, or attention targets only")

    def lora_config(self) -> LoraConfig | None:
        """``--lora`` parsed (:func:`loongtrain.model.lora.parse_lora`; None without adapters)."""
        return parse_lora(self.lora)


    def _validate_objective(self) -> None:
        """--objective and the options that belong to it (docs/post-training.md)."""
        for name, choices in (("objective", OBJECTIVES), ("loss_on", LOSS_ON), ("on_long", ON_LONG)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{flag(name)}={getattr(self, name)!r} is not one of {choices}")
        if not (math.isfinite(self.dpo_beta) and self.dpo_beta > 0):
            raise ValueError(f"--dpo-beta={self.dpo_beta} must be finite and > 0")
        given = {"loss_on": self.loss_on != "assistant", "chat_template": bool(self.chat_template),
                 "on_long": self.on_long != "drop", "dpo_beta": self.dpo_beta != 0.1, "ref_model": bool(self.ref_model)}
        applies = {"loss_on": ("sft",), "chat_template": ("sft", "dpo"), "on_long": ("sft", "dpo"),
                   "dpo_beta": ("dpo",), "ref_model": ("dpo",)}
        for name, used in given.items():
            if used and self.objective not in applies[name]:
                raise ValueError(f"{flag(name)} applies to --objective {' or '.join(applies[name])}, not "
                                 f"--objective {self.objective}")
        if self.objective == PRETRAIN:
            return
        if self.doc_mask != "on" or not self.position_reset:
            raise ValueError(f"--objective {self.objective} packs conversations and pairs as documents: it needs "
                             f"--doc-mask on and --position-reset (got --doc-mask {self.doc_mask}, --position-reset "
                             f"{self.position_reset})")
        if self.seq_len_stages:
            raise ValueError(f"--seq-len-stages applies to --objective pretrain, not --objective {self.objective}")
        if "position-loss" in eval_task_list(self):
            raise ValueError(f"--eval-tasks position-loss measures plain text; with --objective {self.objective} "
                             f"use --eval-tasks passkey (and val_loss: --val-interval)")

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
                raise ValueError(f"{flag(name)}={value} must be finite and in {rule}")

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
        for key, value in values.items():
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
        if isinstance(own.get("seq_len_stages"), str) and own["seq_len_stages"]:
            steps, longest = stage_totals(own["seq_len_stages"])  # what the stages make of --steps, --seq-len
            own.setdefault("steps", steps)
            own.setdefault("seq_len", longest)
        try:
            return cls(**own, parallel=parallel)
        except TypeError as exc:
            raise ValueError(f"invalid TrainConfig option: {exc}") from None


@dataclass(frozen=True)
class Run:
    """A run resolved once by the launcher before any worker starts (docs/launching.md): the options, the
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
