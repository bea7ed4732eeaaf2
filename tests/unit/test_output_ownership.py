"""The ownership rule all the way down (loongtrain/_files.py; docs/files-and-checkpoints.md#one-ownership-rule):
for every command that writes a directory, a file of the user's at any depth of it (``adapter/``, ``base/``,
``checkpoints/step_N/``, ``tensorboard/``, ``shards/``) is refused by the check, naming the folder and the file,
and kept by every deletion (``--overwrite``, a replaced checkpoint, pruning, a stale save, an interrupted
prepare). The commands' own rows are in tests/e2e/test_ownership_and_identity.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loongtrain._files import MARKER, check_output, foreign_entries, remove_output, remove_owned
from loongtrain.data.prepare import OUTPUT as PREPARE
from loongtrain.eval.config import OUTPUT as EVAL
from loongtrain.train.checkpoint import CHECKPOINTS_FOLDER, RUN_OUTPUT, remove_stale_tmp
from loongtrain.train.export import OUTPUT as EXPORT

#: what each command writes (a file per name) in a directory it owns
TREES = {
    "train": (RUN_OUTPUT, ["metrics.jsonl", "loss_curve.png", "checkpoints/latest",
                           "checkpoints/step_00000002/__0_0.distcp", "checkpoints/step_00000002/.metadata",
                           "checkpoints/step_00000002/trainer_state.json", "checkpoints/step_00000002/rng_rank0.pt",
                           "checkpoints/step_00000002/checksums.json", "checkpoints/step_00000003.tmp/__1_0.distcp",
                           "tensorboard/events.out.tfevents.1.host.2.0"]),
    "prepare": (PREPARE, ["manifest.json", "shards/tokens-00000.bin", "shards/targets-00000.bin",
                          "shards/documents.idx", ".tmp-42/tokens-00001.bin"]),
    "export": (EXPORT, ["config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja",
                        "adapter/adapter_config.json", "adapter/adapter_model.safetensors", "base/config.json",
                        "base/model.safetensors"]),
    "eval": (EVAL, ["results.json", "meta.json", "passkey.png"]),
}
#: a file of the user's planted inside each: (command, its path, the entry the refusal names)
PLANTED = [("train", "checkpoints/step_00000002/notes.txt", "checkpoints/step_00000002/notes.txt"),
           ("train", "checkpoints/notes.txt", "checkpoints/notes.txt"),
           ("train", "tensorboard/my_plots.ipynb", "tensorboard/my_plots.ipynb"),
           ("train", "checkpoints/step_00000003.tmp/keep.me", "checkpoints/step_00000003.tmp/keep.me"),
           ("prepare", "shards/README.md", "shards/README.md"), ("prepare", ".tmp-42/mine.bin", ".tmp-42/mine.bin"),
           ("export", "adapter/README.md", "adapter/README.md"), ("export", "base/NOTES.md", "base/NOTES.md"),
           ("eval", "notes/eval.txt", "notes")]

def _tree(root: Path, command: str) -> Path:
    output, names = TREES[command]
    root.mkdir()
    (root / MARKER).write_text(json.dumps({"command": output.command}))
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(name)
    return root


@pytest.mark.parametrize("command", sorted(TREES))
def test_a_command_owns_what_it_writes_all_the_way_down(tmp_path, command):
    output, names = TREES[command]
    out = _tree(tmp_path / "out", command)
    assert foreign_entries(output, out) == []
    assert check_output(output, out) == out
    assert remove_output(output, out) and not out.exists()


@pytest.mark.parametrize("command, planted, named", PLANTED, ids=[p for _, p, _ in PLANTED])
def test_a_file_of_the_users_at_any_depth_is_refused_and_kept(tmp_path, command, planted, named):
    output, names = TREES[command]
    out = _tree(tmp_path / "out", command)
    mine = out / planted
    mine.parent.mkdir(parents=True, exist_ok=True)
    mine.write_text("the user's")
    folder = (out / named).parent
    inside = "" if folder == out else f": '{folder}'"
    with pytest.raises(ValueError) as err:
        check_output(output, out)
    assert str(err.value).startswith(f"{output.flag} '{out}'{inside} holds files loongtrain did not write "
                                     f"({Path(named).name}); they are never written over or deleted"), str(err.value)
    remove_output(output, out)  # every deletion keeps it, and what holds it
    assert mine.read_text() == "the user's"
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()) == [planted]


def test_a_link_inside_an_output_is_not_loongtrains(tmp_path):
    """A link where loongtrain writes a folder or a file (loongtrain writes none) is refused, and deleting the
    output leaves it and its target alone."""
    out = _tree(tmp_path / "out", "export")
    user = tmp_path / "user"
    user.mkdir()
    (user / "adapter_config.json").write_text("the user's")
    (out / "adapter").rename(tmp_path / "old_adapter")
    (out / "adapter").symlink_to(user)
    with pytest.raises(ValueError, match=r"holds files loongtrain did not write \(adapter\)"):
        check_output(EXPORT, out)
    assert not remove_output(EXPORT, out)
    assert (out / "adapter").is_symlink() and (user / "adapter_config.json").read_text() == "the user's"


def test_a_file_where_a_folder_belongs_is_not_loongtrains(tmp_path):
    out = _tree(tmp_path / "out", "prepare")
    (out / "shards" / "documents.idx").unlink()
    (out / "shards" / "documents.idx").mkdir()  # a folder where loongtrain writes a file
    assert [p.name for p in foreign_entries(PREPARE, out)] == ["documents.idx"]


def test_overwrite_of_checkpoints_and_stale_saves_keep_the_users_files(tmp_path):
    """``train --overwrite`` (remove_owned of checkpoints/) and the removal of a save that died keep a file the
    user put there, and the folder holding it."""
    out = _tree(tmp_path / "out", "train")
    (out / "checkpoints" / "step_00000002" / "eval.md").write_text("the user's")
    (out / "checkpoints" / "step_00000003.tmp" / "keep.me").write_text("the user's")
    removed = remove_owned(CHECKPOINTS_FOLDER, out / "checkpoints")
    assert removed == ["latest"]
    assert sorted(p.name for p in (out / "checkpoints").rglob("*")) == [
        "eval.md", "keep.me", "step_00000002", "step_00000003.tmp"]
    assert remove_stale_tmp(out / "checkpoints") == []
    assert (out / "checkpoints" / "step_00000003.tmp" / "keep.me").is_file()
