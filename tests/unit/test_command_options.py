"""The one option generator (loongtrain/commands/parser.py) and the house rules it stands for: every command's
parser comes from its config dataclass, no module outside loongtrain/commands/ builds a parser, and nothing
keeps a second name."""

from __future__ import annotations

import ast
import dataclasses
from dataclasses import dataclass
from pathlib import Path

import pytest

from loongtrain._options import option
from loongtrain.commands import COMMANDS, main
from loongtrain.commands.eval import parse_args as parse_eval
from loongtrain.commands.export import ExportConfig
from loongtrain.commands.parser import build, build_parser, options, parse
from loongtrain.commands.prepare import PrepareConfig
from loongtrain.eval.config import EvalConfig
from loongtrain.launch.config import TrainConfig
from loongtrain.parallel.config import ParallelConfig
from loongtrain.plan.config import PlanConfig

ROOT = Path(__file__).resolve().parents[2] / "loongtrain"


@dataclass(frozen=True)
class Inner:
    a: int = option(1, "a number", at_least=1)
    b: str = option("x", "a choice", choices=("x", "y"))
    c: bool = option(False, "a switch")


@dataclass(kw_only=True)
class Outer:
    name: str = option(positional=True, help="a required positional")
    out: str = option(help="a required option")
    size: int = option(0, "a size", size=True)
    sizes: tuple[int, ...] = option((8,), "sizes", size=True)
    ratios: tuple[float, ...] = option((0.5,), "ratios")
    limit: int | None = option(None, "a filter", kind=int, at_least=0)
    resume: str = option("", "a bare flag means latest", const="latest")
    inner: Inner = option(factory=Inner, help="nested", only=("a", "b"))


def _parse(argv, tmp_path=None, toml=None):
    if toml is not None:
        path = tmp_path / "cfg.toml"
        path.write_text(toml)
        argv = [*argv, "--config", str(path)]
    return build(Outer, parse(Outer, argv, "prog", "a test command", tables=("outer",)))


def test_every_kind_of_field(tmp_path):
    cfg = _parse(["n", "--out", "o", "--size", "128K", "--sizes", "4K,1M", "--ratios", "0,1", "--limit", "3",
                  "--resume", "--a", "2", "--b", "y"])
    assert (cfg.name, cfg.out, cfg.size, cfg.sizes, cfg.ratios, cfg.limit, cfg.resume) == \
        ("n", "o", 131072, (4096, 1 << 20), (0.0, 1.0), 3, "latest")
    assert cfg.inner == Inner(a=2, b="y")  # the nested field's options, over its default
    assert _parse(["n", "--out", "o"]) == Outer(name="n", out="o")  # defaults
    with pytest.raises(ValueError, match="--c"):  # not among the nested field's only=
        _parse(["n", "--out", "o", "--c"])


@pytest.mark.parametrize("argv, needle", [
    (["n"], "missing --out: give it on the command line"),  # required
    ([], "missing NAME, --out: give them"),  # the positional too
    (["n", "--out", "o", "--size", "12x"], "size='12x'"),
    (["n", "--out", "o", "--b", "z"], "invalid choice: 'z'"),
    (["n", "--out", "o", "--a", "0"], "--a=0 must be >= 1"),
    (["n", "--out", "o", "--limit", "-1"], "--limit=-1 must be >= 0"),
    (["n", "--out", "o", "--sizes", "4K,x"], "--sizes='x' is not a length"),
    (["n", "--out", "o", "--bogus"], "--bogus"),
])
def test_usage_errors_are_one_line_value_errors(argv, needle):
    with pytest.raises(ValueError, match=needle) as info:
        _parse(argv)
    assert "\n" not in str(info.value)


def test_toml_file_then_command_line(tmp_path):
    cfg = _parse(["n", "--out", "o", "--a", "3"], tmp_path,
                 'size = "64K"\nsizes = [1, 2]\n[inner]\na = 2\nb = "y"\n[outer]\nlimit = 5\n')
    assert (cfg.size, cfg.sizes, cfg.limit, cfg.inner) == (65536, (1, 2), 5, Inner(a=3, b="y"))  # CLI wins
    for text, needle in (('bogus = 1\n', "unknown option 'bogus'"), ('size = "big"\n', "size='big'"),
                         ('limit = "3"\n', "limit = '3' must be of type int"), ('b = "z"\n', "'z' is not one of"),
                         ('a = 0\n', "--a=0 must be >= 1"), ("a = \n", "not valid TOML")):
        with pytest.raises(ValueError, match=needle) as info:
            _parse(["n", "--out", "o"], tmp_path, text)
        assert "cfg.toml" in str(info.value)  # a file's error names the file


def test_a_required_option_or_positional_may_come_from_the_file(tmp_path):
    """An option without a default (and a positional) is satisfied by the --config file as by the command line;
    the command line still wins; missing from both names the file."""
    assert _parse(["n"], tmp_path, 'out = "o"\n') == Outer(name="n", out="o")
    assert _parse([], tmp_path, 'out = "o"\nname = "m"\n') == Outer(name="m", out="o")
    assert _parse(["n", "--out", "cli"], tmp_path, 'out = "o"\nname = "m"\n') == Outer(name="n", out="cli")
    with pytest.raises(ValueError, match="missing NAME: give it on the command line or in the config file '.*cfg"):
        _parse([], tmp_path, 'out = "o"\n')


def test_every_command_help_lists_every_field():
    for cls in (TrainConfig, PlanConfig, EvalConfig, PrepareConfig, ExportConfig):
        text = build_parser(cls, "x", "").format_help()
        for opt in options(cls):
            shown = opt.name if opt.meta("positional") else opt.flag
            assert shown.upper() in text.upper(), (cls.__name__, shown)
    names = {opt.name for opt in options(EvalConfig)}
    assert {"hp", "cp", "inner_ring", "placement"} <= names and "zero_shard_size" not in names


def test_eval_options_parse_lists_and_the_layout():
    cfg = parse_eval(["run", "--lengths", "4K,16K", "--depths", "0,0.5,1", "--hp", "2", "--inner-ring", "1"])
    assert cfg.lengths == (4096, 16384) and cfg.depths == (0.0, 0.5, 1.0)
    assert cfg.parallel == ParallelConfig(hp=2)


def test_commands_table_matches_the_modules():
    assert sorted(COMMANDS) == sorted(p.stem for p in (ROOT / "commands").glob("*.py")
                                      if p.stem not in ("__init__", "__main__", "parser", "errors"))
    assert main(["--help"]) == 0


def _modules():
    return list(ROOT.rglob("*.py"))


def test_only_commands_build_parsers():
    builders = [str(p.relative_to(ROOT)) for p in _modules() if "argparse" in p.read_text()
                and p.parent.name != "commands"]
    assert not builders, f"modules outside loongtrain/commands/ that build a parser: {builders}"


def test_no_second_names_or_shims():
    texts = {str(p.relative_to(ROOT)): p.read_text() for p in _modules()}
    assert not [n for n, t in texts.items() if "DeprecationWarning" in t]
    assert not [n for n, t in texts.items() if "§" in t], "cite a docs file and its heading, not a section number"
    old = ("ac_mode", "ac_fraction", "plan_cluster", "chunk_layout", "seq_len_schedule", "schedule_tokens")
    for name, text in texts.items():
        tree = ast.parse(text)
        idents = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
            n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} | {
            a.arg for n in ast.walk(tree) if isinstance(n, ast.arguments) for a in n.args + n.kwonlyargs}
        assert not idents & set(old), (name, idents & set(old))
    fields = {f.name for cls in (TrainConfig, PlanConfig, EvalConfig, ParallelConfig) for f in dataclasses.fields(cls)}
    assert not fields & {"window", *old}


def test_a_later_error_names_the_config_file_that_set_the_option(tmp_path):
    """naming_the_file: a check after parsing that names an option the --config file set names the file; the
    same option given on the command line (which wins over the file), or an error naming no such option, is
    left as it was."""
    from loongtrain.commands.parser import naming_the_file
    from loongtrain.launch.config import TrainConfig

    toml = tmp_path / "run.toml"
    toml.write_text("hp = 3\nsteps = 2\n")
    for argv, message, expected in (
        (["--config", str(toml)], "--hp 3 does not divide the heads", f"--hp 3 does not divide the heads (--hp from "
                                                                       f"config file {str(toml)!r})"),
        (["--config", str(toml), "--hp", "3"], "--hp 3 does not divide the heads", "--hp 3 does not divide the heads"),
        (["--config", str(toml)], "--hp-x is unknown", "--hp-x is unknown"),
        (["--hp", "3"], "--hp 3 does not divide the heads", "--hp 3 does not divide the heads"),
    ):
        with pytest.raises(ValueError) as info, naming_the_file(TrainConfig, argv, ("train",)):
            raise ValueError(message)
        assert str(info.value) == expected, (argv, str(info.value))
    # by its quoted value: a command's own check that quotes what the file set (a positional by its name)
    toml.write_text('tokenizer = "nosuch"\nout = "prep"\n')
    with pytest.raises(ValueError) as info, naming_the_file(PrepareConfig, ["c.txt", "--config", str(toml)]):
        raise ValueError("unknown tokenizer 'nosuch'")
    assert str(info.value) == f"unknown tokenizer 'nosuch' (--tokenizer from config file {str(toml)!r})"
    toml.write_text('model = "nowhere"\ntask = "passkey"\n')
    with pytest.raises(ValueError) as info, naming_the_file(EvalConfig, ["--config", str(toml)], ("eval",)):
        raise ValueError("MODEL 'nowhere' is none of: ...")
    assert str(info.value).endswith(f"(model from config file {str(toml)!r})")
