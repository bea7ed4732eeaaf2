"""The ``loongtrain`` command: one module per subcommand in this package, each a ``main(argv) -> exit code``
(docs/configuration.md). This module dispatches; ``python -m loongtrain.commands`` is the same command."""

from __future__ import annotations

import importlib
import signal
import sys
from typing import NoReturn

#: subcommand -> (module, one line for ``loongtrain --help``)
COMMANDS = {
    "train": ("loongtrain.commands.train", "Train a LLaMA-style or Hugging Face model with 2D-Attention."),
    "plan": ("loongtrain.commands.plan", "Rank 2D-Attention configurations for a cluster with the cost model."),
    "export": ("loongtrain.commands.export", "Write a training checkpoint as a Hugging Face model directory."),
    "prepare": ("loongtrain.commands.prepare", "Tokenize corpora once into a memory-mapped training directory."),
    "eval": ("loongtrain.commands.eval", "Evaluate long context sharded: loss by position, passkey retrieval."),
}


def main(argv: list[str] | None = None) -> int:
    """``loongtrain COMMAND [options]``; the command's exit code (2 for an unknown one)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print("usage: loongtrain {" + ",".join(COMMANDS) + "} [options]\n")
        for name, (_, text) in COMMANDS.items():
            print(f"  {name:8s} {text}")
        print("\nRun `loongtrain <command> --help` for the options of a command.")
        return 0
    if not argv:
        print(f"loongtrain: error: no command; choose one of {list(COMMANDS)} (run `loongtrain --help`)",
              file=sys.stderr)
        return 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"loongtrain: error: unknown command {name!r}; choose one of {list(COMMANDS)}", file=sys.stderr)
        return 2
    from loongtrain.commands.errors import guarded

    # importing a command imports torch: Ctrl-C there is one line too
    module = None

    def load() -> None:
        nonlocal module
        module = importlib.import_module(COMMANDS[name][0])

    code = guarded(name, load)
    return code if module is None else int(module.main(rest) or 0)


def cli() -> NoReturn:
    """The console script (and ``python -m loongtrain.commands``): :func:`main`'s exit code. Once the command
    has ended, Ctrl-C no longer interrupts the interpreter's exit (torch's finalizers, a worker pool's shutdown),
    which would print a traceback after the command's last line or end a finished command as interrupted."""
    try:
        code = main()
    except KeyboardInterrupt:  # between the command's own handler and here
        print("loongtrain: interrupted", file=sys.stderr)
        code = 130
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(code)
