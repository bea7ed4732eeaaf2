"""Options as dataclass fields, and the typed values users write (docs/configuration.md).

Every command's options are the fields of one dataclass (``TrainConfig``, ``PlanConfig``, ``EvalConfig``,
...), each declared with :func:`option`: its default and a one-line help, plus what the parser generator
(:mod:`loongtrain.commands.parser`) needs to know about it (a size like ``128K``, choices, a lower bound,
a positional argument). Values from TOML files are checked against the field's type with
:func:`check_value` / :func:`check_fields`, whose errors name the file, the key, the value and the type.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

try:
    import tomllib  # novermin
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

__all__ = ["check_fields", "check_value", "flag", "option", "parse_size", "read_toml", "tomllib"]


def option(default: Any = dataclasses.MISSING, help: str = "", *, factory: Any = None, **extra: Any) -> Any:
    """A dataclass field that is a command-line option (and a TOML key) of the same name.

    ``extra`` (all optional): ``size=True`` (an int written as ``131072``, ``128K`` or ``1M``),
    ``choices=(...)``, ``at_least=N``, ``kind=T`` (the value's type when the default is None),
    ``item=T`` (a tuple's item type, written comma-separated on the command line), ``repeat=True`` (a tuple
    given one value per occurrence of the flag instead), ``const=V`` (the value of
    the bare flag), ``positional=True`` (``nargs`` with it), ``metavar``, ``group`` (the --help section
    this field opens), ``only=(...)`` (a nested dataclass: the fields of it that are options),
    ``command_line=False`` (a TOML key only). No default: a required option."""
    metadata = {"help": help, **extra}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def flag(name: str) -> str:
    """The command-line flag of option ``name``: ``seq_len`` -> ``--seq-len``."""
    return "--" + name.replace("_", "-")


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


# Token counts as users write them: 131072, 128K or 1M (binary); the one size parser of every command
_UNITS = {"": 1, "k": 1024, "m": 1024**2}


def parse_size(text: str | int, name: str = "seq_len") -> int:
    """``131072``, ``128K`` or ``1M`` -> int; ValueError naming ``name`` and the value otherwise."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    m = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", str(text))
    if not m:
        raise ValueError(f"{name}={text!r} is not a length like 131072, 128K or 1M")
    return int(m.group(1)) * _UNITS[m.group(2).lower()]
