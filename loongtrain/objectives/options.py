"""Every objective's name and options, and ``loongtrain train``'s objective section made of them, without the
objectives themselves (docs/design.md#how-to-add-an-objective): this module imports neither torch nor an
objective's code, so that ``--help`` and an argument error answer before any heavy import (docs/configuration.md).
The registry (loongtrain/objectives/registry.py) maps each name to its entry and checks that the entry's options
are the ones declared here.

:data:`CATALOGUE` lists the objectives in the order of ``--objective``'s choices: each one's options (a dataclass
of ``option()`` fields: ``--dpo-beta``; options of the same name are shared: ``--chat-template`` is SFT's and
DPO's) and its help line. :data:`ObjectiveSection` is the objective and every objective's options, each once.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any

from loongtrain._options import option
from loongtrain.data.messages import LOSS_ON, ON_LONG

PRETRAIN, SFT, DPO, GRPO = "pretrain", "sft", "dpo", "grpo"


@dataclass
class ChatOptions:
    """The options every objective that reads rows of whole units takes."""

    chat_template: str = option("", "--objective sft/dpo/grpo: a Jinja chat template file to render conversations "
                                "with ('': the tokenizer's own)")
    on_long: str = option("drop", "--objective sft/dpo: a conversation or pair longer than --seq-len is left out "
                          "(drop, counted in the log) or refused (error)", choices=ON_LONG)


@dataclass
class SFTOptions(ChatOptions):
    """``--objective sft``'s options: the chat options and the target rule."""

    loss_on: str = option("assistant", "--objective sft: the targets: assistant (the chat template's generation "
                          "blocks, else each assistant turn and its end-of-turn token) or all (every token)",
                          choices=LOSS_ON)


@dataclass
class DPOOptions(ChatOptions):
    """``--objective dpo``'s options: the chat options, beta and the reference."""

    dpo_beta: float = option(0.1, "--objective dpo: beta, the strength of the KL penalty toward the reference")
    ref_model: str = option("", "--objective dpo/grpo: the frozen reference: a loongtrain run or checkpoint, or a "
                            "Hugging Face model directory, of the policy's architecture and vocabulary ('': the "
                            "policy's initial weights)")


@dataclass
class GRPOOptions:
    """``--objective grpo``'s options: TRL's ``GRPOConfig`` names, prefixed where loongtrain has the word already.
    The loss's, the rewards' and the ratio's choices are checked by the objective (loongtrain/objectives/grpo.py:
    their names live with the code that runs them)."""

    chat_template: str = option("", "--objective sft/dpo/grpo: a Jinja chat template file to render conversations "
                                "with ('': the tokenizer's own)")
    ref_model: str = option("", "--objective dpo/grpo: the frozen reference: a loongtrain run or checkpoint, or a "
                            "Hugging Face model directory, of the policy's architecture and vocabulary ('': the "
                            "policy's initial weights)")
    grpo_loss: str = option("dapo", "--objective grpo: the loss's normalisation: dapo (sum over the step's "
                            "completion tokens / their count), grpo (mean per sequence, then over the step's "
                            "sequences), dr_grpo (sum / (sequences x --max-completion-length))")
    grpo_epsilon: float = option(0.2, "--objective grpo: the ratio's lower clip, 1 - epsilon")
    grpo_epsilon_high: float = option(None, "--objective grpo: the ratio's upper clip, 1 + epsilon_high (default: "
                                      "--grpo-epsilon; DAPO uses 0.28)", kind=float)
    grpo_beta: float = option(0.0, "--objective grpo: the k3 KL penalty's weight toward the reference (0: no "
                              "reference pass)")
    grpo_scale_rewards: str = option("group", "--objective grpo: advantages (r - group mean) divided by the group's "
                                     "std (group), the batch's (batch) or nothing (none)")
    importance_sampling: str = option("token", "--objective grpo: the ratio per token, or per sequence (sequence: "
                                      "GSPO, exp of the mean log-ratio)")
    temperature: float = option(1.0, "--objective grpo: the sampling temperature; log-probabilities are those of "
                                "logits / temperature (TRL's rule)")
    max_completion_length: int = option(256, "--objective grpo: the most tokens a completion is generated with "
                                        "(online), and dr_grpo's constant")
    prompts: str = option("", "--objective grpo online: a .jsonl file of rows {\"prompt\": ...} (strings or "
                          "messages; other columns go to the reward functions) to generate completions for")
    reward: tuple[str, ...] = option((), "--objective grpo online: a reward function FILE.py:FUNC or module:func, "
                                     "TRL's signature f(prompts, completions, **columns) -> list[float] (repeat "
                                     "the option for several)", repeat=True, metavar="FUNC")
    reward_weights: tuple[float, ...] = option((), "--objective grpo online: each reward function's weight (default 1 "
                                               "each)")
    num_generations: int = option(8, "--objective grpo online: completions generated per prompt (a group)")
    generation_batch_size: int = option(64, "--objective grpo online: completions generated per optimizer step (a "
                                        "multiple of --num-generations)")

    def settings(self) -> Any:
        """The loss's settings (:class:`~loongtrain.loss.grpo.GRPOSettings`, their own checks)."""
        from loongtrain.loss.grpo import GRPOSettings

        high = self.grpo_epsilon if self.grpo_epsilon_high is None else self.grpo_epsilon_high
        return GRPOSettings(self.grpo_loss, self.grpo_epsilon, high, self.grpo_beta, self.importance_sampling,
                            self.max_completion_length)


#: every objective: ``name: (its options or None, its help line)``, in the order of ``--objective``'s choices
CATALOGUE: dict[str, tuple[type | None, str]] = {
    PRETRAIN: (None, "pretrain (every token of a text corpus)"),
    SFT: (SFTOptions, "sft (TRL's rows: conversations {\"messages\": [...]} with tool calls and tools, or "
                      "{\"prompt\", \"completion\"}, of .jsonl rows, a saved dataset or a prepared corpus: their "
                      "assistant or completion tokens)"),
    DPO: (DPOOptions, "dpo (preference pairs {\"prompt\", \"chosen\", \"rejected\"}, or {\"chosen\", \"rejected\"} "
                      "with the prompt they share, of .jsonl rows, a saved dataset or a prepared corpus)"),
    GRPO: (GRPOOptions, "grpo (rollouts {\"prompt\", \"completion\", \"reward\"} of --corpus, or generated online from "
                        "--prompts with --reward: the GRPO family's clipped surrogate)"),
}
DEFAULT = PRETRAIN


def objective_names() -> tuple[str, ...]:
    """The objectives' names, in order."""
    return tuple(CATALOGUE)


def _option_fields() -> dict[str, tuple[dataclasses.Field, Any, tuple[str, ...]]]:
    """Every objective option: its field, its type and the objectives it belongs to."""
    out: dict[str, tuple[dataclasses.Field, Any, tuple[str, ...]]] = {}
    for name, (options, _) in CATALOGUE.items():
        if options is None:
            continue
        hints = typing.get_type_hints(options)
        for f in dataclasses.fields(options):
            field, kind, owners = out.get(f.name, (f, hints[f.name], ()))
            out[f.name] = (field, kind, (*owners, name))
    return out


OPTIONS = _option_fields()

#: ``loongtrain train``'s objective section (module docstring)
ObjectiveSection = dataclasses.make_dataclass(
    "ObjectiveSection",
    [("objective", str, option(DEFAULT, group="post-training", help="what the run trains on: " + ", ".join(
        help for _, help in CATALOGUE.values())))]
    + [(name, kind, dataclasses.field(default=field.default, metadata=field.metadata))
       for name, (field, kind, _) in OPTIONS.items()])
ObjectiveSection.__module__ = __name__  # pickled by name (local workers receive the run's config)
ObjectiveSection.__doc__ = "The objective and every objective's options (module docstring)."


def check_objective_section(section: Any) -> None:
    """``--objective`` names an objective, its options' choices hold, and an option given (not its default)
    belongs to the objective chosen; ValueError naming the option (the registry then checks the objective's own
    rules)."""
    from loongtrain._options import flag

    if section.objective not in CATALOGUE:
        raise ValueError(f"--objective={section.objective!r} is not one of {objective_names()}")
    for name, (field, _, owners) in OPTIONS.items():
        value, choices = getattr(section, name), field.metadata.get("choices")
        if choices and value not in choices:
            raise ValueError(f"{flag(name)}={value!r} is not one of {choices}")
        if value != field.default and section.objective not in owners:
            raise ValueError(f"{flag(name)} applies to --objective {' or '.join(owners)}, not "
                             f"--objective {section.objective}")


def option_owners(name: str) -> tuple[str, ...]:
    """The objectives an objective option belongs to."""
    return OPTIONS[name][2]
