"""The seq-len stages (``--seq-len-stages 8K:1000,32K:400``, docs/context-extension.md#seq-len-stages):
a run trained in stages of growing sequence length.

- :func:`parse_stages`: ``LENGTH:STEPS,...`` -> ``((length, steps), ...)``; lengths strictly increasing.
- :func:`run_stages`: the run's :class:`Stage` list, each with its optimizer steps, micro-batch and
  gradient accumulation. Without stages: one stage of ``--seq-len``, ``--batch-size``, ``--grad-accum``
  for ``--steps`` steps (the run as it always was).
- Tokens per optimizer step (``--stage-tokens``; docs/context-extension.md#seq-len-stages): ``constant``
  (default) counts from the **longest** stage, as Llama 3's recipe does: ``--batch-size`` and
  ``--grad-accum`` describe the longest stage, and a shorter stage of length ``L`` puts ``longest / L``
  times as many sequences into each micro-batch (``batch_size * longest / L``, the same ``grad_accum``),
  so every micro-batch holds ``batch_size * longest`` tokens and every step the same number. A stage whose
  length does not divide the longest is a ValueError naming ``--stage-tokens free``, which keeps
  ``--batch-size`` and ``--grad-accum`` in every stage.
- :func:`stage_at` / :func:`stage_config`: the stage of an optimizer step, and the run's options with
  that stage's ``seq_len``, ``batch_size`` and ``grad_accum`` (what the data, the validation and the
  layout checks of that stage use).

A stage's data is the stream a run at that stage's length and batch would read at the same optimizer
step (``start_micro_step = step * grad_accum``), so the data position is a function of the step alone and
a resume at any step, also on a stage boundary, continues exactly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from loongtrain._options import parse_size
from loongtrain.parallel.config import ParallelConfig, validate_parallel


class StageOptions(Protocol):
    """The options the stages read (:class:`~loongtrain.train.config.TrainConfig` has them; that module
    imports this one for its checks)."""

    seq_len_stages: str
    stage_tokens: str
    seq_len: int
    steps: int
    batch_size: int
    grad_accum: int


Options = TypeVar("Options", bound=StageOptions)

STAGE_TOKENS = ("constant", "free")


@dataclass(frozen=True)
class Stage:
    """Stage ``index`` trains optimizer steps ``[first_step, first_step + steps)`` (0-based) at ``seq_len``
    tokens per sequence, ``batch_size`` sequences per replica per micro-step, ``grad_accum`` micro-steps."""

    index: int
    seq_len: int
    steps: int
    first_step: int
    batch_size: int
    grad_accum: int

    @property
    def end_step(self) -> int:
        return self.first_step + self.steps

    def tokens_per_replica_step(self) -> int:
        return self.batch_size * self.grad_accum * self.seq_len


def parse_stages(text: str) -> tuple[tuple[int, int], ...]:
    """``"8K:1000,32K:400"`` -> ``((8192, 1000), (32768, 400))``. ValueError naming the part when a part is
    not ``LENGTH:STEPS`` with positive numbers, or when the lengths do not strictly increase."""
    stages: list[tuple[int, int]] = []
    for part in (p.strip() for p in text.split(",")):
        length_text, sep, steps_text = part.partition(":")
        try:
            length = parse_size(length_text, "length")
            steps = int(steps_text) if steps_text.strip().isdigit() else -1
        except ValueError:
            length, steps = 0, -1
        if not sep or length < 1 or steps < 1:
            raise ValueError(f"--seq-len-stages {text!r}: stage {part!r} is not LENGTH:STEPS with a positive "
                             f"length (e.g. 8192, 8K) and a positive number of steps, e.g. 8K:1000,32K:400")
        if stages and length <= stages[-1][0]:
            raise ValueError(f"--seq-len-stages {text!r}: stage lengths must increase; {part!r} follows "
                             f"length {stages[-1][0]}")
        stages.append((length, steps))
    return tuple(stages)


def stage_totals(text: str) -> tuple[int, int]:
    """``(total steps, longest length)`` of the stages: what ``--steps`` and ``--seq-len`` become."""
    stages = parse_stages(text)
    return sum(steps for _, steps in stages), stages[-1][0]


def check_stages(cfg: StageOptions) -> None:
    """ValueError naming the value: ``--stage-tokens`` not a choice (or given without stages), stages
    that do not parse or increase, ``--steps`` / ``--seq-len`` other than its total / longest
    length, a stage whose sequences per step are not whole (:func:`run_stages`)."""
    if cfg.stage_tokens not in STAGE_TOKENS:
        raise ValueError(f"--stage-tokens={cfg.stage_tokens!r} is not one of {STAGE_TOKENS}")
    if not cfg.seq_len_stages:
        if cfg.stage_tokens != "constant":
            raise ValueError(f"--stage-tokens {cfg.stage_tokens} applies to a --seq-len-stages, and none "
                             f"is given")
        return
    steps, longest = stage_totals(cfg.seq_len_stages)
    if cfg.steps != steps:
        raise ValueError(f"--steps={cfg.steps} differs from the {steps} steps of --seq-len-stages "
                         f"{cfg.seq_len_stages!r}; leave --steps out (it is the stages' sum)")
    if cfg.seq_len != longest:
        raise ValueError(f"--seq-len={cfg.seq_len} differs from the longest length {longest} of "
                         f"--seq-len-stages {cfg.seq_len_stages!r}; leave --seq-len out")
    run_stages(cfg)


def run_stages(cfg: StageOptions) -> tuple[Stage, ...]:
    """The run's stages (module docstring: the batch rule); ValueError naming the stage whose sequences
    per step are not a whole number under ``--stage-tokens constant``."""
    if not cfg.seq_len_stages:
        return (Stage(0, cfg.seq_len, cfg.steps, 0, cfg.batch_size, cfg.grad_accum),)
    parsed = parse_stages(cfg.seq_len_stages)
    longest = parsed[-1][0]
    out: list[Stage] = []
    first_step = 0
    for index, (length, steps) in enumerate(parsed):
        batch = cfg.batch_size
        if cfg.stage_tokens == "constant":
            batch = _constant_tokens_batch(cfg, longest, length)
        out.append(Stage(index, length, steps, first_step, batch, cfg.grad_accum))
        first_step += steps
    return tuple(out)


def _constant_tokens_batch(cfg: StageOptions, longest: int, length: int) -> int:
    """The micro-batch of a stage of ``length`` holding the longest stage's ``batch_size * longest`` tokens."""
    if longest % length:
        raise ValueError(
            f"--seq-len-stages {cfg.seq_len_stages!r}: the stage of length {length} does not divide the longest, "
            f"{longest}: --stage-tokens constant puts longest/length times --batch-size {cfg.batch_size} sequences "
            f"into its micro-batches, which must be whole; choose lengths that divide {longest} (e.g. powers of "
            f"two), or pass --stage-tokens free (every stage keeps --batch-size and --grad-accum)")
    return cfg.batch_size * (longest // length)


def check_stage_layouts(cfg: StageOptions, parallel: ParallelConfig, world: int, num_heads: int,
                        num_kv_heads: int, model: str) -> None:
    """Every stage's length suits the one layout of the run (:func:`~loongtrain.parallel.config.validate_parallel`:
    divisible by ``2*hp*cp``, and by the MLP tiles); ValueError naming the stage and the rule."""
    for stage in run_stages(cfg):
        where = f"--seq-len {stage.seq_len}" if not cfg.seq_len_stages else \
            f"--seq-len-stages stage {stage.index + 1} ({stage.seq_len} tokens)"
        try:
            validate_parallel(parallel, world, seq_len=stage.seq_len, num_heads=num_heads, num_kv_heads=num_kv_heads)
        except ValueError as exc:
            raise ValueError(f"--nproc/world size {world}, --hp {parallel.hp} --cp {parallel.cp}, {where}, "
                             f"model {model!r}: {exc}") from exc


def stage_at(stages: tuple[Stage, ...], step: int) -> Stage:
    """The stage that trains optimizer step ``step`` (0-based); the last stage past the end."""
    return next((s for s in stages if step < s.end_step), stages[-1])


def stage_config(cfg: Options, stage: Stage) -> Options:
    """``cfg`` with the stage's ``seq_len``, ``batch_size`` and ``grad_accum`` (``cfg`` itself when equal)."""
    if (cfg.seq_len, cfg.batch_size, cfg.grad_accum) == (stage.seq_len, stage.batch_size, stage.grad_accum):
        return cfg
    return dataclasses.replace(cfg, seq_len=stage.seq_len, batch_size=stage.batch_size, grad_accum=stage.grad_accum)


def describe(stages: tuple[Stage, ...], dp: int) -> str:
    """One line per run: each stage's length, steps, micro-batch x accumulation and tokens per step."""
    return "; ".join(f"stage {s.index + 1}: {s.seq_len} tokens x {s.steps} steps, batch {s.batch_size} x "
                     f"grad-accum {s.grad_accum} ({dp * s.tokens_per_replica_step()} tokens/step)" for s in stages)


#: ``(stage_cfg, start_micro_step) -> iterator of this replica's micro-batches`` (the trainer's batch source)
OpenStream = Callable[[Any, int], Iterator[Any]]


class StageStream:
    """This replica's micro-batches across the stages: the stream of the stage being trained, opened at the
    step it starts from (``step * grad_accum``, module docstring) and replaced at each stage boundary.

    It also keeps ``tokens_seen`` (input tokens each corpus supplied to all replicas): the closed stages'
    tokens plus the open stream's since its stage began (a stream counts from its own step 0). A
    checkpoint records the stage and that total (:meth:`state`), so :meth:`start` continues it."""

    def __init__(self, cfg: StageOptions, stages: tuple[Stage, ...], open_stream: OpenStream) -> None:
        self.cfg, self.stages, self.open_stream = cfg, stages, open_stream
        self.stage = stages[0]
        self.batches: Iterator[Any] = iter(())
        self._closed: dict[str, int] = {}  # tokens of the stages before this one
        self._opened_at: dict[str, int] = {}  # the open stream's count at its stage's first step

    def start(self, step: int, state: dict[str, Any]) -> None:
        """Open the stream of optimizer step ``step`` (0-based); ``state``: the checkpoint's trainer state
        (``{}`` fresh). Its saved data position is checked and restored when it is this stage's (a
        checkpoint on a boundary holds the previous stage's, and the new stream starts from the step)."""
        self._open(stage_at(self.stages, step), step)
        if state.get("data") is not None and state.get("stage", 0) == self.stage.index \
                and hasattr(self.batches, "load_state_dict"):
            self.batches.load_state_dict(state["data"])  # checks the global batch and seed did not change
        if "tokens_seen" in state:
            mine = self._stage_tokens(step)
            self._closed = {k: v - mine.get(k, 0) for k, v in state["tokens_seen"].items()}

    def at(self, step: int) -> Stage:
        """The stage of optimizer step ``step``, its stream opened (the next stage's, past a boundary)."""
        if step >= self.stage.end_step and self.stage.index + 1 < len(self.stages):
            done = self._stage_tokens(step)
            self._closed = {k: self._closed.get(k, 0) + done.get(k, 0) for k in [*done, *self._closed]}
            self._open(stage_at(self.stages, step), step)
        return self.stage

    def micro_batches(self) -> list[Any]:
        """The next optimizer step's ``grad_accum`` micro-batches."""
        return [next(self.batches) for _ in range(self.stage.grad_accum)]

    def peek(self, step: int) -> Any | None:
        """The first micro-batch of optimizer step ``step`` without advancing (None: the source cannot)."""
        batch = getattr(self.batches, "batch", None)
        return batch(step * self.stage.grad_accum) if batch is not None else None

    def tokens_seen(self) -> dict[str, int] | None:
        """Input tokens each corpus supplied to all replicas so far (None: the source does not count)."""
        if not hasattr(self.batches, "tokens_by_corpus"):
            return None
        now = self.batches.tokens_by_corpus()
        names = [*now, *(k for k in self._closed if k not in now)]
        return {k: self._closed.get(k, 0) + now.get(k, 0) - self._opened_at.get(k, 0) for k in names}

    def state(self) -> dict[str, Any]:
        """What a checkpoint records: the stream's position, its stage and ``tokens_seen``."""
        data = self.batches.state_dict() if hasattr(self.batches, "state_dict") else None
        seen = self.tokens_seen()
        return {"data": data, "stage": self.stage.index, **({"tokens_seen": seen} if seen is not None else {})}

    def _open(self, stage: Stage, step: int) -> None:
        self.stage = stage
        self.batches = self.open_stream(stage_config(self.cfg, stage), step * stage.grad_accum)
        self._opened_at = self._count_at(stage.first_step)

    def _stage_tokens(self, step: int) -> dict[str, int]:
        """The open stream's tokens from its stage's first step to ``step``."""
        now = self._count_at(step)
        return {k: v - self._opened_at.get(k, 0) for k, v in now.items()}

    def _count_at(self, step: int) -> dict[str, int]:
        count = getattr(self.batches, "tokens_by_corpus", None)
        return count(step * self.stage.grad_accum) if count is not None else {}
