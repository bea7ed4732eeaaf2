"""`loongtrain eval` given bad input: incomplete or damaged checkpoints, --out by the ownership rule and the lock,
corpora too short or contradicting their manifest; Ctrl-C.

The rows, and what each must show: tests/helpers/bad_inputs.py."""

from __future__ import annotations

import pytest

from tests.helpers.bad_inputs import (
    SAFETY,
    check_ctrl_c,
    check_safety,
    rows_of,
)


@pytest.mark.parametrize("case", rows_of(SAFETY, "eval"), ids=[c.name for c in rows_of(SAFETY, "eval")])
def test_data_safety(case, safety, tmp_path, monkeypatch, capsys, reached):
    check_safety(case, safety, tmp_path, monkeypatch, capsys, reached)


def test_ctrl_c_is_one_line(files, tmp_path, capsys, monkeypatch):
    check_ctrl_c("eval", files, tmp_path, capsys, monkeypatch)
