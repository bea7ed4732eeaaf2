"""The docs stay true to their citations and their sizes (issue 37): every ``docs/FILE.md#anchor`` cited in the
code, the tests, the benchmarks, the README and the docs resolves to an existing file and heading (GitHub's
anchors), every relative Markdown link in the README and the docs resolves, the README has at most 250 lines and
no doc more than 400, the README's two quickstart commands are the ones a fresh machine and CI run, and the code
cites no section numbers. Each check is a function of the repository root that returns what is wrong, so the
last tests can show, on a small tree of their own, that every check fails when it should."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: where code and text cite docs (``docs/FILE.md`` or ``docs/FILE.md#anchor``)
CITING = ("loongtrain", "tests", "benchmarks")
CITING_SUFFIXES = (".py", ".md", ".toml", ".txt")
#: a citation of a doc file, with its anchor
CITATION = re.compile(r"\bdocs/([\w-]+\.md)(?:#([\w-]+))?")
#: a Markdown link's target: ``[text](target)``
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")
README_LINES, DOC_LINES = 250, 400
#: the README's first quickstart command: a fresh machine sets up and runs the default embedded training run
FRESH_MACHINE = "python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e . && .venv/bin/loongtrain train"


def prose_lines(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` of the lines outside fenced code blocks."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            out.append((number, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor of a heading's text: lower case, punctuation but ``-`` and ``_`` dropped, spaces as ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of the headings of Markdown file ``path`` (a repeated heading gets ``-1``, ``-2``, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(path.read_text(encoding="utf-8")):
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def _target_problem(target: Path, anchor: str | None, where: str) -> str | None:
    if not target.exists():
        return f"{where}: {target.name} does not exist"
    if anchor and target.suffix == ".md" and anchor not in anchors(target):
        return f"{where}: {target.name} has no heading with anchor #{anchor}"
    return None


def _citing_files(root: Path) -> list[Path]:
    files = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    for top in CITING:
        files += sorted(p for p in (root / top).rglob("*") if p.suffix in CITING_SUFFIXES and p.is_file()
                        and "__pycache__" not in p.parts)
    # this file spells citations of a small tree of its own (the last tests), not of the repository's docs
    return [p for p in files if p.is_file() and p.resolve() != Path(__file__).resolve()]


def broken_citations(root: Path) -> list[str]:
    """Every ``docs/FILE.md[#anchor]`` cited under ``root`` whose file or heading does not exist."""
    problems = []
    for path in _citing_files(root):
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            for m in CITATION.finditer(line):
                where = f"{path.relative_to(root)}:{number}"
                problem = _target_problem(root / "docs" / m.group(1), m.group(2), where)
                if problem:
                    problems.append(problem)
    return problems


def broken_links(root: Path) -> list[str]:
    """Every relative Markdown link of the README and the docs (outside code) whose file or heading does not
    exist; an anchor alone (``#x``) is looked up in the same file."""
    problems = []
    for path in [root / "README.md", *sorted((root / "docs").rglob("*.md"))]:
        for number, line in prose_lines(path.read_text(encoding="utf-8")):
            for m in LINK.finditer(line):
                target = m.group(1)
                if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                    continue
                file, _, anchor = target.partition("#")
                where = f"{path.relative_to(root)}:{number}"
                problem = _target_problem((path.parent / file).resolve() if file else path, anchor or None, where)
                if problem:
                    problems.append(problem)
    return problems


def oversized(root: Path) -> list[str]:
    """The README past 250 lines, and any doc past 400."""
    sizes = [(root / "README.md", README_LINES)] + [(p, DOC_LINES) for p in sorted((root / "docs").rglob("*.md"))]
    return [f"{p.relative_to(root)}: {n} lines > {limit}" for p, limit in sizes
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > limit]


def ci_test_command(root: Path) -> str:
    """The command ``.ci/run`` runs (its last line that is not a comment or a shell setting)."""
    lines = [line.strip() for line in (root / ".ci" / "run").read_text(encoding="utf-8").splitlines()]
    return [line for line in lines if line and not line.startswith(("#", "set ", "cd "))][-1]


def quickstart_commands(root: Path) -> list[list[str]]:
    """The lines of each fenced code block of the README's ``## Quickstart`` section."""
    text = (root / "README.md").read_text(encoding="utf-8")
    m = re.search(r"^## Quickstart\b.*?$(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    if m is None:
        return []
    return [[line for line in block.splitlines() if line.strip()]
            for block in re.findall(r"^```[^\n]*\n(.*?)^```", m.group(1), flags=re.M | re.S)]


def quickstart_problems(root: Path) -> list[str]:
    """The README's quickstart must be two one-line commands: the fresh machine's run, then CI's test command."""
    blocks = quickstart_commands(root)
    want = [[FRESH_MACHINE], [ci_test_command(root)]]
    return [] if blocks[:2] == want else [f"README quickstart blocks {blocks[:2]} != {want}"]


def section_signs(root: Path) -> list[str]:
    """Files under ``loongtrain/`` that cite by section number (``§``): code cites a doc file and a heading."""
    return [str(p.relative_to(root)) for p in sorted((root / "loongtrain").rglob("*"))
            if p.is_file() and p.suffix in CITING_SUFFIXES and "§" in p.read_text(encoding="utf-8", errors="replace")]


def test_cited_docs_resolve():
    assert broken_citations(ROOT) == []


def test_markdown_links_resolve():
    assert broken_links(ROOT) == []


def test_sizes():
    assert oversized(ROOT) == []


def test_quickstart_is_what_ci_and_a_fresh_machine_run():
    assert ci_test_command(ROOT).endswith(".venv/bin/python -m pytest")
    assert quickstart_problems(ROOT) == []


def test_no_section_numbers_in_the_code():
    assert section_signs(ROOT) == []


def _tree(root: Path, readme: str) -> Path:
    """A repository of its own: one doc with two headings (one repeated), a module citing it, README and CI."""
    (root / "docs").mkdir(parents=True)
    (root / "docs" / "topic.md").write_text("# Topic\n\n## Real heading\n\n## Real heading\n\n"
                                            "```\n## Not a heading\n```\n")
    (root / "loongtrain").mkdir()
    cite = "docs/topic.md"
    (root / "loongtrain" / "mod.py").write_text(f'"""{cite}#real-heading, {cite}#real-heading-1."""\n')
    for top in ("tests", "benchmarks"):
        (root / top).mkdir()
    (root / ".ci").mkdir()
    (root / ".ci" / "run").write_text("#!/bin/sh\nset -e\ncd x\npython3 -m venv .venv && .venv/bin/python -m pytest\n")
    (root / "README.md").write_text(readme)
    return root


GOOD_README = (f"# x\n\n## Quickstart\n\n```bash\n{FRESH_MACHINE}\n```\n\n```bash\n"
               "python3 -m venv .venv && .venv/bin/python -m pytest\n```\n\n## Next\n\n[t](docs/topic.md#topic)\n")


def test_the_checks_pass_a_good_tree(tmp_path):
    root = _tree(tmp_path, GOOD_README)
    assert anchors(root / "docs" / "topic.md") == {"topic", "real-heading", "real-heading-1"}
    for check in (broken_citations, broken_links, oversized, quickstart_problems, section_signs):
        assert check(root) == [], check.__name__


def test_the_checks_fail_where_they_should(tmp_path):
    cite = "docs/topic.md"
    root = _tree(tmp_path, GOOD_README + "[gone](docs/gone.md) [bad](docs/topic.md#not-a-heading) [self](#none)\n"
                 + "x\n" * README_LINES)
    (root / "tests" / "test_x.py").write_text(f"# {cite}#no-such-heading\n# docs/missing.md\n")
    (root / "loongtrain" / "old.py").write_text('"""design.md §4"""\n')
    (root / "docs" / "long.md").write_text("# Long\n" + "x\n" * DOC_LINES)

    assert broken_citations(root) == [
        "README.md:16: gone.md does not exist",
        "README.md:16: topic.md has no heading with anchor #not-a-heading",
        "tests/test_x.py:1: topic.md has no heading with anchor #no-such-heading",
        "tests/test_x.py:2: missing.md does not exist",
    ]
    assert broken_links(root) == [
        "README.md:16: gone.md does not exist",
        "README.md:16: topic.md has no heading with anchor #not-a-heading",
        "README.md:16: README.md has no heading with anchor #none",
    ]
    assert oversized(root) == [f"README.md: {16 + README_LINES} lines > {README_LINES}",
                               f"docs/long.md: {1 + DOC_LINES} lines > {DOC_LINES}"]
    assert section_signs(root) == ["loongtrain/old.py"]

    (root / "README.md").write_text(GOOD_README.replace("-e . &&", "-e '.[dev]' &&"))
    assert len(quickstart_problems(root)) == 1
    (root / "README.md").write_text(GOOD_README.replace("## Quickstart", "## Start"))
    assert len(quickstart_problems(root)) == 1
