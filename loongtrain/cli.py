"""`loongtrain` command line: dispatches to the subcommands' own modules."""

from __future__ import annotations

import sys

SUBCOMMANDS = {
    "train": ("loongtrain.launch.train_cli", "Train a LLaMA-style or Hugging Face model with 2D-Attention."),
    "plan": ("loongtrain.plan.cli", "Rank 2D-Attention configurations for a cluster with the cost model."),
    "export": ("loongtrain.train.export", "Write a training checkpoint as a Hugging Face model directory."),
    "prepare": ("loongtrain.data.cli", "Tokenize corpora once into a memory-mapped training directory."),
    "eval": ("loongtrain.launch.eval_cli", "Evaluate long context sharded: loss by position, passkey retrieval."),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print("usage: loongtrain {" + ",".join(SUBCOMMANDS) + "} [options]\n")
        for name, (_, text) in SUBCOMMANDS.items():
            print(f"  {name:8s} {text}")
        print("\nRun `loongtrain <command> --help` for the options of a command.")
        return 0
    if not argv:
        print(f"loongtrain: error: no command; choose one of {list(SUBCOMMANDS)} (run `loongtrain --help`)",
              file=sys.stderr)
        return 2
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"loongtrain: unknown command {name!r}; choose one of {list(SUBCOMMANDS)}", file=sys.stderr)
        return 2
    import importlib

    from loongtrain._input import interrupted, stop_on_sigterm

    try:  # Ctrl-C or SIGTERM anywhere in a command: one line, exit 130 or 143 (temporary files removed)
        with stop_on_sigterm():
            module = importlib.import_module(SUBCOMMANDS[name][0])
            if name == "plan":  # plan sits below train: the trainer's step for --simulate is handed down from here
                from loongtrain.train.simulate import simulate_candidate

                return int(module.main(rest, simulate=simulate_candidate) or 0)
            return int(module.main(rest) or 0)
    except KeyboardInterrupt as exc:
        return interrupted(name, exc)


if __name__ == "__main__":
    sys.exit(main())
