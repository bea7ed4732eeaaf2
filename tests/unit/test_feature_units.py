"""Features as units (docs/design.md#the-package-map), counted on the code's syntax trees so that a later change
cannot quietly undo them: no branch on an objective's name outside ``loongtrain/objectives/`` (its registry is asked
instead), no parameter that takes the whole Trainer (collaborators receive the step context), ``TrainConfig`` in at
most 12 sections, and few functions of 10 or more parameters. Each counter is shown to see what it counts."""

from __future__ import annotations

import ast
import dataclasses
import functools
import typing
from pathlib import Path

from loongtrain.launch.config import TrainConfig
from loongtrain.objectives.registry import objective_names

ROOT = Path(__file__).resolve().parents[2] / "loongtrain"
#: functions of 10 or more parameters allowed (31 before the sections and the registry, 20 before the bundles): the
#: ring attention's two custom ops and their fake implementations take their tensors and scalars flat (torch.library
#: schemas), and loongtrain.attention its keywords as flash-attn's users know them (5). The varlen kernels take
#: ``Seqlens`` and ``VarlenMask`` (attn/kernels.py), the ring one ``RingCall``, a step's pieces one ``PieceCalls``,
#: the corpus readers the data section and prepare its ``Sharding``
MAX_WIDE_FUNCTIONS = 5


def _is_name(node: ast.AST, names: set[str]) -> bool:
    """An objective's name: a string literal of one, a constant named after one (``SFT``), or a tuple of them."""
    if isinstance(node, ast.Constant):
        return node.value in names
    if isinstance(node, ast.Name | ast.Attribute):
        return (node.id if isinstance(node, ast.Name) else node.attr) in {n.upper() for n in names}
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return bool(node.elts) and all(_is_name(e, names) for e in node.elts)
    return False


def _is_objective(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "objective") or (
        isinstance(node, ast.Name) and node.id == "objective")


def objective_branches(tree: ast.AST, names: set[str]) -> list[int]:
    """Lines that compare with an objective's name (or compare ``objective`` with anything) or key a dict by one."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_is_name(s, names) for s in sides) or any(_is_objective(s) for s in sides):
                lines.append(node.lineno)
        elif isinstance(node, ast.Dict) and any(k is not None and _is_name(k, names) for k in node.keys):
            lines.append(node.lineno)
    return lines


def trainer_parameters(tree: ast.AST) -> list[str]:
    """Parameters annotated ``Trainer``, or named ``trainer`` without a narrower annotation than ``Any``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            a = node.args
            for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs):
                annotation = ast.unparse(arg.annotation).strip("'\"") if arg.annotation else ""
                if annotation.split(".")[-1] == "Trainer" or (arg.arg == "trainer" and annotation in ("", "Any")):
                    found.append(f"{node.name}({arg.arg})")
    return found


def wide_functions(tree: ast.AST, limit: int = 10) -> list[str]:
    """Functions with ``limit`` or more named parameters (``self`` and ``cls`` not counted, nor ``*args``)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            a = node.args
            named = [x for x in (*a.posonlyargs, *a.args, *a.kwonlyargs) if x.arg not in ("self", "cls")]
            if len(named) >= limit:
                out.append(f"{node.name} ({len(named)})")
    return out


@functools.cache
def _package() -> dict[Path, ast.AST]:
    return {path: ast.parse(path.read_text()) for path in sorted(ROOT.rglob("*.py"))}


def test_no_objective_name_is_branched_on_outside_the_objectives():
    names = set(objective_names())
    found = [f"{path.relative_to(ROOT.parent)}:{line}" for path, tree in _package().items()
             if "objectives" not in path.relative_to(ROOT).parts for line in objective_branches(tree, names)]
    assert not found, f"objective-name branches outside loongtrain/objectives/: {found}"


def test_no_parameter_takes_the_whole_trainer():
    found = [f"{path.relative_to(ROOT.parent)}: {p}" for path, tree in _package().items()
             for p in trainer_parameters(tree)]
    assert not found, f"parameters taking the Trainer (give them the step context): {found}"


def test_train_config_is_a_few_sections():
    fields = typing.get_type_hints(TrainConfig)
    assert len(fields) <= 12, list(fields)
    assert all(dataclasses.is_dataclass(kind) for kind in fields.values()), fields  # each a section


def test_few_functions_take_ten_or_more_parameters():
    found = [f"{path.relative_to(ROOT.parent)}: {f}" for path, tree in _package().items() for f in wide_functions(tree)]
    assert len(found) <= MAX_WIDE_FUNCTIONS, found


def test_the_counters_see_what_they_count():
    source = ast.parse(
        "def f(cfg, trainer, t: 'Trainer'):\n"
        "    if cfg.objective == 'dpo': pass\n"
        "    if name in (SFT, DPO): pass\n"
        "    x = {'sft': 1}\n"
        "def g(a, b, c, d, e, f, g, h, i, j): pass\n"
        "def h(self, a, b, c, d, e, f, g, h, i): pass\n")
    assert objective_branches(source, {"pretrain", "sft", "dpo"}) == [2, 3, 4]
    assert trainer_parameters(source) == ["f(trainer)", "f(t)"]
    assert wide_functions(source) == ["g (10)"]
