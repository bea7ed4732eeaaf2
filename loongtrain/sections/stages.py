"""The seq-len stages (``--seq-len-stages 8K:1000,32K:400``, docs/context-extension.md#seq-len-stages): a run
trained in stages of growing sequence length. The schedule is data of the run's options: the trainer's stream over
the stages is ``loongtrain.train.stages``.

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
- :func:`stage_at`: the stage of an optimizer step.

A stage's data is the stream a run at that stage's length and batch would read at the same optimizer
step (``start_micro_step = step * grad_accum``), so the data position is a function of the step alone and
a resume at any step, also on a stage boundary, continues exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from loongtrain._options import parse_size


class StageOptions(Protocol):
    """The data options the stages read (:class:`~loongtrain.sections.data.DataSection` has them)."""

    seq_len_stages: str
    stage_tokens: str
    seq_len: int
    batch_size: int
    grad_accum: int


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


def check_stages(cfg: StageOptions, steps: int) -> None:
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
    total, longest = stage_totals(cfg.seq_len_stages)
    if steps != total:
        raise ValueError(f"--steps={steps} differs from the {total} steps of --seq-len-stages "
                         f"{cfg.seq_len_stages!r}; leave --steps out (it is the stages' sum)")
    if cfg.seq_len != longest:
        raise ValueError(f"--seq-len={cfg.seq_len} differs from the longest length {longest} of "
                         f"--seq-len-stages {cfg.seq_len_stages!r}; leave --seq-len out")
    run_stages(cfg, steps)


def run_stages(cfg: StageOptions, steps: int) -> tuple[Stage, ...]:
    """The run's stages (module docstring: the batch rule); ValueError naming the stage whose sequences
    per step are not a whole number under ``--stage-tokens constant``."""
    if not cfg.seq_len_stages:
        return (Stage(0, cfg.seq_len, steps, 0, cfg.batch_size, cfg.grad_accum),)
    parsed = parse_stages(cfg.seq_len_stages)
    longest = parsed[-1][0]
    out: list[Stage] = []
    first_step = 0
    for index, (length, count) in enumerate(parsed):
        batch = cfg.batch_size
        if cfg.stage_tokens == "constant":
            batch = _constant_tokens_batch(cfg, longest, length)
        out.append(Stage(index, length, count, first_step, batch, cfg.grad_accum))
        first_step += count
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


def stage_at(stages: tuple[Stage, ...], step: int) -> Stage:
    """The stage that trains optimizer step ``step`` (0-based); the last stage past the end."""
    return next((s for s in stages if step < s.end_step), stages[-1])


def describe(stages: tuple[Stage, ...], dp: int) -> str:
    """One line per run: each stage's length, steps, micro-batch x accumulation and tokens per step."""
    return "; ".join(f"stage {s.index + 1}: {s.seq_len} tokens x {s.steps} steps, batch {s.batch_size} x "
                     f"grad-accum {s.grad_accum} ({dp * s.tokens_per_replica_step()} tokens/step)" for s in stages)


