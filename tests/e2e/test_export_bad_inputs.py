"""`loongtrain export` given bad input: --hf by the ownership rule (never a user's files, the run, its
checkpoints), incomplete checkpoints, a changed tokenizer; --overwrite of an earlier export; Ctrl-C and a full
disk keep the earlier export.

The rows, and what each must show: tests/helpers/bad_inputs.py."""

from __future__ import annotations

import pytest

from loongtrain.commands import main
from tests.helpers.bad_inputs import (
    CASES,
    SAFETY,
    case_ids,
    check_bad_input,
    check_ctrl_c,
    check_safety,
    hashes,
    rows_of,
)


@pytest.mark.parametrize("argv, needle", rows_of(CASES, "export"), ids=case_ids(rows_of(CASES, "export")))
def test_bad_input_exits_2_with_one_line(argv, needle, files, capsys, no_workers):
    check_bad_input(argv, needle, files, capsys)


@pytest.mark.parametrize("case", rows_of(SAFETY, "export"), ids=[c.name for c in rows_of(SAFETY, "export")])
def test_data_safety(case, safety, tmp_path, monkeypatch, capsys, reached):
    check_safety(case, safety, tmp_path, monkeypatch, capsys, reached)


def test_export_overwrite_replaces_the_whole_directory(files, tmp_path, capsys):
    """--overwrite of an earlier export: its old files are gone (a stray shard would stop the result from
    loading), and the result loads with transformers."""
    import transformers

    out = tmp_path / "hf"
    assert main(["export", files["ckpt"], "--hf", str(out)]) == 0, capsys.readouterr().err
    for name in ("model-00002-of-00002.safetensors", "tokenizer.json", "model.safetensors"):
        (out / name).write_text("old")
    assert main(["export", files["ckpt"], "--hf", str(out), "--overwrite"]) == 0, capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == [".loongtrain", "config.json", "model.safetensors"]
    assert not list(tmp_path.glob(".hf.export-*")), "a staging directory was left"
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert sum(p.numel() for p in model.parameters()) > 0


def test_ctrl_c_is_one_line(files, tmp_path, capsys, monkeypatch):
    check_ctrl_c("export", files, tmp_path, capsys, monkeypatch)


def test_a_full_disk_in_export_is_one_line_and_keeps_the_earlier_export(files, tmp_path, capsys, monkeypatch):
    import errno

    from loongtrain.train import export

    previous = tmp_path / "hf"
    assert main(["export", files["ckpt"], "--hf", str(previous)]) == 0
    before = hashes(previous)

    def full(model, config, out, **kwargs):
        (out / "model.safetensors").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device", str(out / "model.safetensors"))

    monkeypatch.setattr(export, "export_hf", full)
    assert main(["export", files["ckpt"], "--hf", str(previous), "--overwrite"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.safetensors: no space left on device" in err[0], err
    assert hashes(previous) == before and not list(tmp_path.glob(".hf.export-*"))


def test_exported_files_are_readable_as_the_umask_allows(files, tmp_path, capsys):
    """Every file of an export has the mode a new file of this process gets (0666 less the umask), the weights
    too: safetensors alone leaves them 0600, unreadable to a serving process of another user."""
    import os
    import stat

    out = tmp_path / "hf"
    assert main(["export", files["ckpt"], "--hf", str(out)]) == 0, capsys.readouterr().err
    mask = os.umask(0)
    os.umask(mask)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir() if p.is_file()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o666 & ~mask}, modes
