"""The one parser generator of every ``loongtrain`` command (docs/configuration.md).

A command's options are the fields of its config dataclass, declared with :func:`loongtrain._options.option`.
:func:`parse` turns them into an argparse parser (one ``--option`` per field, its help line and default, a
section of ``--help`` where a field says ``group=``) and a TOML reader (``--config FILE``: the same names,
with ``-`` or ``_``), and returns the values given, flat: field default < TOML file < command line. A field
whose type is a dataclass (a section: ``TrainConfig.data``, ``TrainConfig.parallel``) contributes its own fields as
options (``--seq-len``, ``--hp``), with the outer default's values; its TOML keys may also sit in a table of its name
(``[parallel]``). Another command reuses some of a section's options with ``only=(...)`` and may word their help
for itself with ``helps={name: text}``.

Every usage error is a one-line ValueError naming the option and, for a choice, the valid values
(:class:`OneLineParser`); values from a TOML file are checked against the field's type
(:func:`~loongtrain._options.check_value`), its choices and its lower bound, with the file and key named.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import re
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from loongtrain._options import check_fields, check_value, parse_size, read_toml

__all__ = ["OneLineParser", "Option", "build", "build_parser", "check_given", "options", "parse", "read_config"]


class OneLineParser(argparse.ArgumentParser):
    """argparse that raises ValueError with its one-line message (the option, the value and the expected
    type or choices) instead of printing the whole usage and exiting 2. ``--help`` still exits 0."""

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        raise ValueError(f"{message} (run `{self.prog} --help` for the options)")


@dataclass(frozen=True)
class Option:
    """One option: the field, its type, its default (the outer default's value for a nested field) and the
    nested field it sits in (``""``: the config's own)."""

    field: dataclasses.Field
    kind: Any
    default: Any
    parent: str = ""
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.field.name

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def meta(self, key: str, default: Any = None) -> Any:
        if key in self.overrides:
            return self.overrides[key]
        return self.field.metadata.get(key, default)


def _value_type(kind: Any) -> Any:
    """``X`` of ``X | None``; else ``kind``."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return next(k for k in typing.get_args(kind) if k is not type(None))
    return kind


def options(cls: type) -> list[Option]:
    """The options of config dataclass ``cls``, in ``--help`` order: its fields, each nested dataclass field
    replaced by its own (or those its ``only=`` names)."""
    hints = typing.get_type_hints(cls)
    out: list[Option] = []
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING)
        if dataclasses.is_dataclass(kind):
            inner = typing.get_type_hints(kind)
            only, helps = f.metadata.get("only"), f.metadata.get("helps", {})
            for g in dataclasses.fields(kind):
                if only is None or g.name in only:
                    overrides = {} if only is None else {"group": None}  # a subset joins the command's groups
                    if g.name in helps:
                        overrides["help"] = helps[g.name]
                    out.append(Option(g, inner[g.name], getattr(default, g.name), f.name, overrides))
            continue
        out.append(Option(f, kind, default))
    return out


def _list_of(item: Callable[[str], Any], name: str) -> Callable[[str], tuple]:
    def parse_list(text: str) -> tuple:
        try:
            return tuple(item(part.strip()) for part in str(text).split(",") if part.strip())
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{name} {text!r}: {exc}") from None

    return parse_list


def _size(name: str) -> Callable[[str], int]:
    def size(text: str) -> int:
        try:
            return parse_size(text, name)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return size


def _converter(opt: Option) -> Callable[[str], Any]:
    """The command-line text of ``opt`` -> its value."""
    kind = opt.meta("kind") or _value_type(opt.kind)
    if typing.get_origin(kind) is tuple:
        (item,) = {k for k in typing.get_args(kind) if k is not Ellipsis}
        item_parse = _size(opt.flag) if opt.meta("size") else item
        return _list_of(item_parse, opt.flag)
    return _size(opt.name) if opt.meta("size") else kind


def _help(opt: Option) -> str:
    text = opt.meta("help", "")
    shown = opt.default not in (dataclasses.MISSING, None, "", ())
    return text + (f" (default: {_shown(opt.default)})" if shown else "")


def _shown(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in value)
    return repr(value)


class _Repeated(argparse.Action):
    """A repeatable option (``repeat=True``): each occurrence adds its value to the tuple."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, (*getattr(namespace, self.dest, ()), values))


_ABSENT = "\0absent"  # the default of a positional the command line left out (str: argparse converts it)


def build_parser(cls: type, prog: str, description: str) -> OneLineParser:
    """The argparse parser of config ``cls`` (defaults suppressed in the namespace, so only the options given
    on the command line override the TOML file)."""
    parser = OneLineParser(prog=prog, description=description, argument_default=argparse.SUPPRESS,
                           allow_abbrev=False)
    parser.add_argument("--config", metavar="FILE", help="TOML file setting any of the options below (the same "
                        "names, with - or _); the command line wins")
    group: Any = parser
    for opt in options(cls):
        if opt.meta("command_line", True) is False:
            continue
        if opt.meta("group"):
            group = parser.add_argument_group(opt.meta("group"))
        kind = _value_type(opt.kind)
        common: dict[str, Any] = {"dest": opt.name, "help": _help(opt)}
        if opt.meta("positional"):  # optional here: the --config file may give it (the check is parse's)
            nargs = "*" if typing.get_origin(kind) is tuple else "?"
            group.add_argument(opt.name, metavar=opt.meta("metavar", opt.name.upper()), nargs=nargs,
                               type=_converter(opt) if nargs == "?" else str, help=common["help"],
                               default=_ABSENT)
            continue
        if kind is bool:
            group.add_argument(opt.flag, action=argparse.BooleanOptionalAction, **common)
            continue
        extra: dict[str, Any] = {"metavar": opt.meta("metavar", opt.name.upper())}
        if opt.meta("const") is not None:
            extra.update(nargs="?", const=opt.meta("const"))
        if opt.meta("repeat"):  # a tuple option given once per value: --reward a.py:f --reward b:g
            group.add_argument(opt.flag, action=_Repeated, type=str, **common, **extra)
            continue
        if opt.meta("choices") and typing.get_origin(kind) is not tuple:
            extra.update(choices=opt.meta("choices"), metavar=opt.meta("metavar"))
        group.add_argument(opt.flag, type=_converter(opt), **common, **extra)
    return parser


def read_config(path: str, cls: type, tables: Sequence[str] = ()) -> dict[str, Any]:
    """The options of TOML file ``path`` as flat values of config ``cls``, types checked. Keys may sit at the top
    or in a table named in ``tables`` or after a nested field (``[parallel]``); a field with ``toml_table=T``
    also takes a table of ``T``'s fields. ValueError naming the file and the key otherwise."""
    where = f"config file {str(path)!r}"
    data = read_toml(path)
    by_name = {opt.name: opt for opt in options(cls)}
    nested = {opt.parent for opt in by_name.values() if opt.parent}
    flat: dict[str, Any] = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if isinstance(value, dict) and (name in tables or name in nested):
            flat.update({k: v for k, v in value.items()})
        else:
            flat[key] = value
    out: dict[str, Any] = {}
    for key, value in flat.items():
        name = key.replace("-", "_")
        opt = by_name.get(name)
        if opt is None:
            raise ValueError(f"{where}: unknown option {key!r}; valid: {sorted(by_name)}")
        table = opt.meta("toml_table")
        if table is not None and isinstance(value, dict):
            values = check_fields(f"{where}: [{key}]", value, table)
            try:
                out[name] = table(**values)
            except ValueError as exc:
                raise ValueError(f"{where}: [{key}]: {exc}") from None
            continue
        kind = opt.meta("kind") or opt.kind
        try:
            if opt.meta("size") and isinstance(value, str):
                value = parse_size(value, name)
            elif typing.get_origin(_value_type(kind)) is tuple and isinstance(value, str):
                value = _converter(opt)(value)
        except (ValueError, argparse.ArgumentTypeError) as exc:
            raise ValueError(f"{where}: {exc}") from None
        out[name] = check_value(where, key, value, kind)
    check_given(cls, out, where)
    return out


def check_given(cls: type, values: Mapping[str, Any], where: str = "") -> None:
    """Choices and lower bounds of the given ``values`` (the same messages for a TOML file, named by ``where``,
    as for the command line); ValueError naming the option."""
    prefix = f"{where}: " if where else ""
    for opt in options(cls):
        value = values.get(opt.name)
        if value is None:
            continue
        low, allowed = opt.meta("at_least"), opt.meta("choices")
        if low is not None and value < low:
            raise ValueError(f"{prefix}{opt.flag}={value} must be >= {low}")
        items = value if isinstance(value, tuple) else (value,)
        if allowed and any(v not in allowed for v in items):
            raise ValueError(f"{prefix}{opt.flag}={value!r} is not one of {list(allowed)}")


def parse(cls: type, argv: Sequence[str], prog: str, description: str, tables: Sequence[str] = ()) -> dict[str, Any]:
    """The options given on the command line ``argv`` (and in the TOML file its ``--config`` names) as flat
    values of config ``cls``; ``--help`` exits 0 (SystemExit). ValueError on bad input, also for an option
    without a default that neither gives."""
    given, path, from_file = _read(cls, argv, prog, description, tables)
    values = {**from_file, **given}
    missing = [opt.meta("metavar", opt.name.upper()) if opt.meta("positional") else opt.flag for opt in options(cls)
               if opt.default is dataclasses.MISSING and opt.name not in values]
    if missing:
        where = f" or in the config file {str(path)!r}" if path is not None else " (or in a --config file)"
        raise ValueError(f"missing {', '.join(missing)}: give {'them' if len(missing) > 1 else 'it'} on the command "
                         f"line{where} (run `{prog} --help` for the options)")
    return values


def _read(cls: type, argv: Sequence[str], prog: str, description: str,
          tables: Sequence[str]) -> tuple[dict[str, Any], str | None, dict[str, Any]]:
    """``(the options the command line gives, its --config file, the options that file gives)``."""
    given = {k: v for k, v in vars(build_parser(cls, prog, description).parse_args(list(argv))).items()
             if v is not _ABSENT}
    path = given.pop("config", None)
    check_given(cls, given)
    return given, path, read_config(path, cls, tables) if path is not None else {}


def set_in_file(cls: type, argv: Sequence[str], tables: Sequence[str] = ()) -> tuple[str | None, dict[str, Any]]:
    """``(the --config file of argv, {flag: value} of the options it sets that the command line does not (a
    positional by its name))``;
    ``(None, {})`` without a file or when argv does not parse."""
    try:
        given, path, from_file = _read(cls, argv, "", "", tables)
    except (ValueError, OSError):
        return None, {}
    flags = {opt.name: opt.name if opt.meta("positional") else opt.flag for opt in options(cls)}
    return path, {flags[name]: value for name, value in from_file.items() if name not in given and name in flags}


@contextlib.contextmanager
def naming_the_file(cls: type, argv: Sequence[str], tables: Sequence[str] = ()) -> Iterator[None]:
    """A ValueError raised inside (a check after parsing: the launcher's, the planner's, a command's) that names
    an option the ``--config`` file set, by its flag or by its quoted value, says so, naming the file:
    ``... (--hp from config file 'run.toml')``."""
    try:
        yield
    except ValueError as exc:
        path, values = set_in_file(cls, argv, tables)
        text = str(exc)
        named = [f for f, v in values.items() if (f.startswith("--") and re.search(rf"{re.escape(f)}(?![\w-])", text))
                 or (isinstance(v, str) and len(v) > 1 and repr(v) in text)]
        if not named or path is None or str(path) in text:
            raise
        raise ValueError(f"{text} ({', '.join(named)} from config file {str(path)!r})") from None


def build(cls: type, values: Mapping[str, Any]) -> Any:
    """An instance of config ``cls`` from flat ``values``: each nested dataclass field is its default with the
    given fields of it replaced. ValueError for a value the dataclass refuses."""
    by_name = {opt.name: opt for opt in options(cls)}
    own: dict[str, Any] = {}
    inner: dict[str, dict[str, Any]] = {}
    for name, value in values.items():
        parent = by_name[name].parent
        (inner.setdefault(parent, {}) if parent else own)[name] = value
    defaults = {f.name: f for f in dataclasses.fields(cls)}
    for parent, given in inner.items():
        f = defaults[parent]
        start = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        own[parent] = dataclasses.replace(start, **given)
    try:
        return cls(**own)
    except TypeError as exc:
        raise ValueError(f"invalid option: {exc}") from None
