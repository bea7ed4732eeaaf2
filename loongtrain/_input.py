"""Reading what users type and write (docs/design.md §8): one-line argparse errors, TOML files whose
errors name the file and the key, and typed fields checked against a dataclass.

Every ``loongtrain`` subcommand parses with :class:`OneLineParser` (a usage error is a ValueError of
one line naming the option and, for a choice, the valid values) and reads TOML with :func:`read_toml`
and :func:`check_fields` (a ValueError naming the file, the key, the value and the expected type).
A user error prints one line (:func:`user_error`, exit 2); Ctrl-C and SIGTERM print one line too
(:func:`stop_on_sigterm`, :func:`interrupted`: exit 130 or 143), for every subcommand.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import re
import signal
import sys
import threading
import types
import typing
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from loongtrain._toml import tomllib


class OneLineParser(argparse.ArgumentParser):
    """argparse that raises ValueError with its one-line message (the option, the value and the expected
    type or choices) instead of printing the whole usage and exiting 2. ``--help`` still exits 0."""

    def error(self, message: str) -> typing.NoReturn:  # type: ignore[override]
        raise ValueError(f"{message} (run `{self.prog} --help` for the options)")


def one_line(exc: BaseException | str) -> str:
    """An error message on one line (libraries' multi-line messages joined with " | "), for the CLIs'
    ``loongtrain CMD: error: ...`` line."""
    return " | ".join(line.strip() for line in str(exc).strip().splitlines() if line.strip())


def user_error(command: str, exc: BaseException | str) -> int:
    """Print ``loongtrain COMMAND: error: MESSAGE`` (:func:`one_line`) to stderr; the exit code of a user
    error, 2."""
    print(f"loongtrain {command}: error: {one_line(exc)}", file=sys.stderr)
    return 2


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread like SIGINT's KeyboardInterrupt (so ``finally`` blocks remove
    temporary files and workers are stopped)."""


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """While inside: SIGTERM raises :class:`Terminated` in the main thread. Elsewhere (a thread), and
    under torchrun (its agent owns the signals), nothing changes."""
    if threading.current_thread() is not threading.main_thread() or ("RANK" in os.environ
                                                                      and "WORLD_SIZE" in os.environ):
        yield
        return

    def _raise(signum: int, frame: Any) -> None:
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, _raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def interrupted(command: str, exc: BaseException, detail: str = "") -> int:
    """Print ``loongtrain COMMAND: interrupted`` (SIGINT) or ``terminated (SIGTERM)``, plus ``detail``, on
    one line; the exit code, 128 + the signal (130 or 143)."""
    term = isinstance(exc, Terminated)
    what = "terminated (SIGTERM)" if term else "interrupted"
    print(f"loongtrain {command}: {what}{'; ' + detail if detail else ''}", file=sys.stderr)
    return 128 + (signal.SIGTERM if term else signal.SIGINT)


def failure(command: str, exc: BaseException | str) -> int:
    """Print ``loongtrain COMMAND: failed: MESSAGE`` (:func:`one_line`; e.g. a full disk); exit code 1."""
    print(f"loongtrain {command}: failed: {one_line(exc)}", file=sys.stderr)
    return 1


def read_toml(path: str | Path, what: str = "config file") -> dict[str, Any]:
    """The table of TOML file ``path``; ValueError naming the file (and line and column) when it is
    missing, unreadable, not UTF-8 or not TOML."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{what} {str(path)!r} does not exist" if not path.exists() else
                         f"{what} {str(path)!r} is not a file")
    try:
        return tomllib.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"{what} {str(path)!r} is not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise ValueError(f"{what} {str(path)!r} cannot be read: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{what} {str(path)!r} is not valid TOML: {exc}") from None


def _kind_name(kind: Any) -> str:
    return getattr(kind, "__name__", str(kind))


def check_value(where: str, key: str, value: Any, kind: Any) -> Any:
    """``value`` checked against the annotation ``kind`` (int, float, str, bool, ``tuple[X, ...]``,
    ``X | None``); ints are accepted for floats (returned as float), bools never for numbers, floats
    must be finite. ValueError ``"{where}: {key} = value must be ..."`` otherwise."""
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(kind)
        if value is None and type(None) in options:
            return None
        (kind,) = [k for k in options if k is not type(None)]
        origin = typing.get_origin(kind)
    if origin is tuple:
        (item,) = {k for k in typing.get_args(kind) if k is not Ellipsis}
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{where}: {key} = {value!r} must be a list of {_kind_name(item)}")
        return tuple(check_value(where, f"{key}[{i}]", v, item) for i, v in enumerate(value))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind in (int, float) and isinstance(value, bool)):
        raise ValueError(f"{where}: {key} = {value!r} must be of type {_kind_name(kind)}")
    if kind is float and not math.isfinite(value):
        raise ValueError(f"{where}: {key} = {value!r} must be a finite number")
    return value


def check_fields(where: str, data: Mapping[str, Any], cls: type, *, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """``data`` as keyword arguments of dataclass ``cls``: unknown keys, missing required fields and
    values of the wrong type are ValueErrors naming ``where`` (the file) and the key. Fields in ``skip``
    are passed through unchecked."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; valid keys: {sorted(fields)}")
    hints = typing.get_type_hints(cls)
    missing = [name for name, f in fields.items() if name not in data and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ValueError(f"{where}: missing key(s) {missing}")
    return {key: value if key in skip else check_value(where, key, value, hints[key]) for key, value in data.items()}


# Token counts as users write them: 131072, 128K or 1M (binary); the one size parser of train and plan
_UNITS = {"": 1, "k": 1024, "m": 1024**2}


def parse_size(text: str | int, name: str = "seq_len") -> int:
    """``131072``, ``128K`` or ``1M`` -> int; ValueError naming ``name`` and the value otherwise."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    m = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", str(text))
    if not m:
        raise ValueError(f"{name}={text!r} is not a length like 131072, 128K or 1M")
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


def size_argument(text: str) -> int:
    """:func:`parse_size` as an argparse ``type`` (its message becomes argparse's)."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
