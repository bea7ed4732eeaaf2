"""An evaluation's options (:class:`EvalConfig`), their checks (:func:`eval_run_config`, then
:func:`resolve_job` once the launcher has fixed the world size and the plan:
``loongtrain.launch.eval_run.prepare`` composes them before any worker starts) into a :class:`Job`, and
:func:`evaluate`, one rank's evaluation of a built model (docs/evaluation.md).

Every user error is a ValueError naming the value: a MODEL that is none of the three kinds, or an
incomplete or damaged checkpoint (the bad file named); lengths not divisible by ``2*hp*cp``; depths
outside [0, 1]; a tokenizer that cannot encode the key's digits; an eval corpus shorter than the longest
length; a layout the model's heads or the world size do not allow; an ``--out`` that the ownership rule
refuses (:mod:`loongtrain._files`: a file, the current directory, a directory holding an input or files
loongtrain did not write, one another eval is writing). A length past the model's
``max_position_embeddings`` (or trained ``--seq-len``) is allowed, with one warning naming both numbers;
so is a Hugging Face directory without weights (one warning: its weights are random). The eval corpus
(``--corpus``, default the run's) is read like the training data
(:func:`~loongtrain.data.sources.open_dataset`: raw, prepared or a mixture).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from loongtrain._files import Folder, Output, check_output
from loongtrain._options import flag, option
from loongtrain.data.sources import parse_corpus_spec
from loongtrain.eval.passkey import DEPTHS, KEY_DIGITS, PasskeyTokens, passkey, passkey_tokens
from loongtrain.eval.position_loss import position_loss
from loongtrain.eval.source import ModelSource, model_config, resolve_model, trained_length
from loongtrain.parallel.config import ZERO_MODES, ParallelConfig, validate_parallel
from loongtrain.parallel.mesh import Mesh
from loongtrain.parallel.zigzag import check_sequence_length
from loongtrain.parallelize.zero import uses_zero
from loongtrain.sections.data import DOC_MASK, DataSection
from loongtrain.sections.model import DTYPES, ModelSection, autocast_dtype
from loongtrain.sections.training import EVAL_TASKS
from loongtrain.train.config import TrainSections
from loongtrain.train.model_setup import tokenizer_spec

log = logging.getLogger("loongtrain.eval")

TASKS = EVAL_TASKS
FILLERS = ("text", "corpus")


@dataclass
class EvalConfig:
    """Every option of ``loongtrain eval`` (``""`` / 0: take the value the model was trained with). It reuses
    ``train``'s model section (``--tokenizer``, ``--dtype``: one rule, :mod:`loongtrain.sections.model`) and data
    section (``--seq-len``, ``--corpus``, ``--doc-mask``), by default the run's own values."""

    model: str = option(positional=True, help="a run directory (its checkpoints/latest), a checkpoint directory, "
                        "or a Hugging Face model directory")
    task: str = option("passkey", "passkey (retrieval by depth x length) or position-loss", choices=TASKS)
    out: str = option("runs/eval", "output directory (results.json, meta.json, a PNG)")
    data: DataSection = option(factory=lambda: DataSection(corpus="", seq_len=0, doc_mask=""),
                               only=("seq_len", "corpus", "doc_mask"), helps={
                                   "seq_len": "position-loss: tokens per sequence (0: the checkpoint's trained "
                                              "--seq-len)",
                                      "corpus": "eval corpus (default: the run's --corpus)",
                                      "doc_mask": "position-loss: document masking of packed sequences (default: as "
                                                  "trained)"})
    lengths: tuple[int, ...] = option((4096, 16384), "passkey: comma-separated prompt lengths (4K = 4096)",
                                      size=True)
    depths: tuple[float, ...] = option(DEPTHS, "passkey: comma-separated key depths in [0, 1]")
    trials: int = option(3, "passkey: prompts per (length, depth) cell")
    docs: int = option(4, "position-loss: sequences from the corpus")
    key_digits: int = option(KEY_DIGITS, "passkey: digits of the key")
    filler: str = option("text", "passkey: a fixed text repeated, or the corpus's tokens", choices=FILLERS)
    model_options: ModelSection = option(factory=lambda: ModelSection(tokenizer="", dtype=""),
                                         only=("tokenizer", "dtype"), helps={
        "tokenizer": "tokenizer (default: the run's, or the Hugging Face directory's)",
        "dtype": "compute dtype: auto, fp32, bf16, fp64 (as loongtrain train --dtype; default: as trained)"})
    seed: int = option(0, "passkey keys")
    parallel: ParallelConfig = option(factory=ParallelConfig, help="the layout, as for train",
                                      only=("hp", "cp", "inner_ring", "placement"))
    zero: str = option("", "ZeRO of the weights (default: as trained; none for a Hugging Face directory)",
                       choices=("", *ZERO_MODES))
    plan: str = option("", "'auto': the planner chooses the layout", choices=("", "auto"))
    cluster: str = option("auto", "cluster for --plan auto (as for train)")
    nproc: int = option(0, "local workers (0: GPUs, or hp*cp); ignored under torchrun")
    threads: int = option(0, "torch threads per worker (0: as train)")
    timeout: float = option(600.0, "seconds a collective may wait")

    def validate(self) -> None:
        """ValueError for values that are wrong whatever the model (choices, ranges)."""
        choices = (("task", self.task, TASKS), ("filler", self.filler, FILLERS),
                   ("dtype", self.model_options.dtype, ("", *DTYPES)),
                   ("doc_mask", self.data.doc_mask, ("", *DOC_MASK)))
        for name, value, allowed in choices:
            if value not in allowed:
                raise ValueError(f"{flag(name)}={value!r} is not one of {allowed}")
        bad_depths = [d for d in self.depths if not (math.isfinite(d) and 0.0 <= d <= 1.0)]
        if bad_depths or not self.depths:
            raise ValueError(f"--depths {bad_depths or '(none)'}: every depth must be in [0, 1]")
        bad_lengths = [n for n in self.lengths if n < 1]
        if bad_lengths or not self.lengths:
            raise ValueError(f"--lengths {bad_lengths or '(none)'}: every length must be a positive integer")
        for name in ("trials", "docs", "key_digits"):
            if getattr(self, name) < 1:
                raise ValueError(f"{flag(name)}={getattr(self, name)} must be a positive integer")
        for name, value in (("seq_len", self.data.seq_len), ("nproc", self.nproc), ("threads", self.threads)):
            if value < 0:
                raise ValueError(f"{flag(name)}={value} must be >= 0")



@dataclass
class Job:
    """A checked evaluation: the options, the model, the run's sections it evaluates under (the model's tokenizer
    and dtype, the corpus, ``--doc-mask``, the layout, ``seq_len`` = the longest length), the world size, the
    lengths, and the task's inputs (passkey prompt pieces, or position-loss batches)."""

    options: EvalConfig
    source: ModelSource
    run: TrainSections
    world: int
    lengths: tuple[int, ...]
    tokens: PasskeyTokens | None = None
    batches: list[Any] = field(default_factory=list)


def _wrote_eval(path: Path) -> bool:
    return (path / "meta.json").is_file() and (path / "results.json").is_file()


#: what `loongtrain eval` writes into --out (loongtrain._files: the ownership rule); an earlier
#: evaluation's results there are replaced
OUTPUT = Output("eval", "--out", Folder(("results.json", "meta.json", "passkey.png", "position_loss.png")),
                _wrote_eval)


def eval_run_config(options: EvalConfig) -> tuple[ModelSource, tuple[int, ...], TrainSections]:
    """Check ``options`` alone and resolve the model, the lengths and the run config the evaluation runs
    under (before the world size and the plan are known; ValueError on bad input)."""
    options.validate()
    if not options.out.strip():
        raise ValueError("--out '' is empty: name the output directory")
    source = resolve_model(options.model)
    lengths = _lengths(options, source)
    return source, lengths, _run_config(options, source, max(lengths))


def resolve_job(options: EvalConfig, source: ModelSource, lengths: tuple[int, ...], run: TrainSections,
                world: int) -> Job:
    """Check the run config (planned for ``world`` ranks) against the model and the task, and build the
    task's inputs into a :class:`Job` (ValueError on bad input)."""
    run = dataclasses.replace(run, parallel=dataclasses.replace(run.parallel, recompute="none"))
    _check_layout(run, source, world, lengths)
    from loongtrain import data

    tokenizer = data.build_tokenizer(tokenizer_spec(run.model))
    vocab = model_config(source).vocab_size
    if tokenizer.vocab_size > vocab:
        raise ValueError(f"tokenizer {tokenizer.name!r} has {tokenizer.vocab_size} tokens but the model has a "
                         f"vocabulary of {vocab}: pass a --tokenizer that fits the model")
    uses_corpus = options.task == "position-loss" or options.filler == "corpus"
    inputs = [str(source.path)] + [n for n, _ in parse_corpus_spec(run.data.corpus) if uses_corpus and n != "stdlib"]
    check_output(OUTPUT, options.out, inputs=inputs + ([tokenizer.name] if tokenizer.name != "byte" else []))
    job = Job(options, source, run, world, lengths)
    longest = max(lengths)
    if options.task == "passkey":
        filler = _corpus_tokens(run, tokenizer, longest + 1, "length") if options.filler == "corpus" else None
        job.tokens = passkey_tokens(tokenizer, filler)
        shortest = job.tokens.overhead(options.key_digits)
        if min(lengths) < shortest:
            raise ValueError(f"--lengths {min(lengths)}: a passkey prompt needs at least {shortest} tokens with "
                             f"this tokenizer (needle, question and a {options.key_digits}-digit answer)")
    else:
        samples = _samples(run, tokenizer, longest, options.docs, "--seq-len", "; lower --docs")
        job.batches = [{key: value[None] for key, value in sample.items()} for sample in samples]
    _warn_past_trained(source, longest)
    return job


def _lengths(options: EvalConfig, source: ModelSource) -> tuple[int, ...]:
    if options.task == "passkey":
        return tuple(options.lengths)
    if options.data.seq_len:
        return (options.data.seq_len,)
    if source.kind == "checkpoint":
        return (source.run.data.seq_len,)
    raise ValueError("--task position-loss on a Hugging Face directory needs --seq-len")


def _run_config(options: EvalConfig, source: ModelSource, seq_len: int) -> TrainSections:
    run = source.run
    doc_mask = options.data.doc_mask or run.data.doc_mask
    zero = {"zero": options.zero} if options.zero else {  # default: the weights sharded as in training
        name: getattr(run.parallel, name) for name in ("zero", "zero_shard_size", "reshard_after_forward")}
    parallel = dataclasses.replace(options.parallel, **zero)
    model = options.model_options
    return dataclasses.replace(run.replace(
        seq_len=seq_len, batch_size=1, grad_accum=1, seq_len_stages="", stage_tokens="constant",
        eval_tasks="", eval_lengths="", tokenizer=model.tokenizer or run.model.tokenizer,
        corpus=options.data.corpus or run.data.corpus, dtype=model.dtype or run.model.dtype,
        doc_mask=doc_mask, plan=options.plan,
        cluster=options.cluster, nproc=options.nproc, threads=options.threads,
        timeout=options.timeout, memory_report=False,
        # the run's layout; "balanced" only orders documents, so without --doc-mask on it is zigzag (as in training)
        chunk_order=run.data.chunk_order if doc_mask == "on" else "zigzag"), parallel=parallel)


def _check_layout(run: TrainSections, source: ModelSource, world: int, lengths: tuple[int, ...]) -> None:
    p, shape = run.parallel, model_config(source)
    try:
        validate_parallel(p, world, num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads)
    except ValueError as exc:
        raise ValueError(f"--nproc/world size {world}, --hp {p.hp} --cp {p.cp}: {exc}") from None
    for n in lengths:
        try:
            check_sequence_length(n, p.hp, p.cp)
        except ValueError as exc:
            raise ValueError(f"length {n}: {exc}") from None


def _samples(run: TrainSections, tokenizer, seq_len: int, count: int, what: str, hint: str = "") -> list[dict]:
    """The first ``count`` packed samples of ``seq_len`` of the eval corpus (the one corpus reader:
    raw, prepared or a mixture, corpus order); ValueError naming the corpus when it holds fewer."""
    from loongtrain.data.sources import first_samples, open_dataset

    try:
        dataset = open_dataset(run.data.corpus, tokenizer, seq_len, seed=run.optim.seed,
                               decode_errors=run.data.decode_errors, shuffle=False)
        return first_samples(dataset, count)
    except (ImportError, ValueError) as exc:
        raise ValueError(f"eval corpus {run.data.corpus!r} ({what} {seq_len}): {exc}{hint}") from None


def _corpus_tokens(run: TrainSections, tokenizer, need: int, what: str) -> list[int]:
    """``need`` tokens of the eval corpus from its start (the passkey filler)."""
    (sample,) = _samples(run, tokenizer, need - 1, 1, what)
    return sample["input_ids"].tolist() + sample["labels"][-1:].tolist()


def _warn_past_trained(source: ModelSource, longest: int) -> None:
    limit, what = trained_length(source)
    if longest > limit:
        log.warning("length %d is past the model's %s %d: measuring beyond the trained length", longest, what, limit)


def evaluate(job: Job, model: nn.Module, mesh: Mesh, device: torch.device) -> list[dict]:
    """The task's rows (passkey cells or position buckets) for ``model`` on ``mesh`` (collective)."""
    o, run = job.options, job.run
    amp = None if uses_zero(run.parallel) else autocast_dtype(run.model.dtype, device)  # FSDP2 casts the weights
    if o.task == "passkey":
        assert job.tokens is not None
        return passkey(model, job.tokens, job.lengths, o.depths, o.trials, mesh, device, key_digits=o.key_digits,
                       seed=o.seed, amp_dtype=amp)
    return position_loss(model, job.batches, mesh, device, job.lengths[0], amp_dtype=amp, doc_mask=run.data.doc_mask,
                         position_reset=run.data.position_reset, chunk_order=run.data.chunk_order,
                         sliding_window=model_config(job.source).sliding_window)
