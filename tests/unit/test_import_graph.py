"""The package's import graph (docs/design.md): every import, at module level or inside a function,
goes from a higher floor to a lower one or stays inside its own package, and no modules import each
other in a circle. Floors: ``model, data, parallel < loss, attn < hf < parallelize < sections < plan < train
< objectives, eval < launch < commands``; ``loongtrain/__init__.py`` sits below the commands, ``_options`` and
``_files`` below everything."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "loongtrain"
FLOORS = {"_options": 0, "_files": 0, "model": 1, "data": 1, "parallel": 1, "loss": 2, "attn": 2, "hf": 3,
          "parallelize": 4, "sections": 5, "plan": 6, "train": 7, "objectives": 8, "eval": 8, "launch": 9,
          "__init__": 10, "commands": 11}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every loongtrain module ``path`` imports (``from X import name`` counts X.name when that is a module)."""
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("loongtrain")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("loongtrain"):
            if node.module != "loongtrain":  # ``from loongtrain import data`` imports loongtrain.data only
                out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    return {name: {m for m in _imports(path) if m in modules and m != name} for name, path in modules.items()}


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_package_has_a_floor():
    missing = sorted({_package(m) for m in _graph()} - set(FLOORS))
    assert not missing, f"packages without a floor in FLOORS: {missing}"


def test_imports_go_down_or_stay_inside_their_package():
    wrong = []
    for module, deps in _graph().items():
        for dep in deps:
            here, there = _package(module), _package(dep)
            if here != there and FLOORS[there] >= FLOORS[here]:
                wrong.append(f"{module} -> {dep}")
    assert not wrong, "imports that go sideways or up: " + ", ".join(sorted(wrong))


def test_no_circles():
    graph = _graph()
    state: dict[str, int] = {}
    circles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                circles.append(path[path.index(dep):] + [dep] if dep in path else [node, dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not circles, f"import circles: {circles}"


@pytest.mark.parametrize("bad", ["loongtrain.train.trainer"])
def test_the_check_sees_an_upward_import(tmp_path, bad):
    """The walker finds an import inside a function body (where lazy imports hide)."""
    src = tmp_path / "m.py"
    src.write_text(f"def f():\n    from {bad} import Trainer\n")
    assert f"{bad}" in _imports(src)
