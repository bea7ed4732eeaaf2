"""`loongtrain` itself given bad input (no command, an unknown one), and the size of the commands' tables.

The rows, and what each must show: tests/helpers/bad_inputs.py."""

from __future__ import annotations

import pytest

from tests.helpers.bad_inputs import (
    CASES,
    SAFETY,
    case_ids,
    check_bad_input,
    rows_of,
)


@pytest.mark.parametrize("argv, needle", rows_of(CASES, ""), ids=case_ids(rows_of(CASES, "")))
def test_bad_input_exits_2_with_one_line(argv, needle, files, capsys, no_workers):
    check_bad_input(argv, needle, files, capsys)


def test_every_command_has_its_table():
    assert len(CASES) >= 60 and len(SAFETY) >= 60 + 22 and len({c.name for c in SAFETY}) == len(SAFETY)
    for command, at_least in (("train", 20), ("plan", 20), ("export", 5)):
        assert len(rows_of(CASES, command)) >= at_least, command
    for command in ("train", "eval", "prepare", "export"):
        assert len(rows_of(SAFETY, command)) >= 10, command
