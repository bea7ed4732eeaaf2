"""The bad-input tables of the commands (tests/e2e/test_*_bad_inputs.py, one file per command) and what
their rows share: the fixture files, the checks of one row, hashes of the user's files, a full disk.

Each ``CASES`` row is ``(argv, text the one line must contain)``; each ``SAFETY`` row a :class:`Case`. A row's
command is its ``argv[0]`` (``""`` for the bare ``loongtrain``): :func:`rows_of` selects a command's rows."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import torch

from loongtrain.commands import COMMANDS, main
from tests.helpers.cli_cases import BASE, bpe_tokenizer
from tests.helpers.hf_models import make_hf_dir

ROOT = Path(__file__).resolve().parents[2]


def cut_file(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def hf_config_dir(path: Path, **edit) -> Path:
    """A tiny Llama directory (config only) whose config.json has keys replaced (None: removed)."""
    make_hf_dir(path, weights=False)
    config = json.loads((path / "config.json").read_text())
    for key, value in edit.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))
    return path


def make_files(d: Path) -> dict[str, str]:
    """The fixture files of the bad-input tables in the empty directory ``d``: HF directories that parse but say
    the wrong thing, corpora that are not text, TOML files, a finished run and a damaged copy of it."""
    (d / "corpus.txt").write_text("".join(f"line {i}: the quick brown fox\n" for i in range(50)))
    # --- HF model directories that parse but say the wrong thing
    (d / "hf_minimal").mkdir()
    (d / "hf_minimal" / "config.json").write_text(json.dumps({"model_type": "llama",
                                                              "architectures": ["LlamaForCausalLM"]}))
    hf_config_dir(d / "hf_novocab", vocab_size=None)
    hf_config_dir(d / "hf_act", hidden_act="swishish")
    hf_config_dir(d / "hf_strsize", hidden_size="32")
    hf_config_dir(d / "hf_zerolayers", num_hidden_layers=0)
    hf_config_dir(d / "hf_heads", num_attention_heads=5)  # 32 is not divisible by 5
    (d / "hf_badjson").mkdir()
    (d / "hf_badjson" / "config.json").write_text('{"model_type": "llama",')
    (d / "hf_array").mkdir()
    (d / "hf_array" / "config.json").write_text("[1, 2]")
    make_hf_dir(d / "hf_good")
    for name, damage in [("hf_cut", lambda f: cut_file(f)),
                         ("hf_header", lambda f: f.write_bytes(b"\xff" * 8 + f.read_bytes()[8:])),
                         ("hf_padded", lambda f: f.write_bytes(f.read_bytes() + b"\0" * 16))]:
        make_hf_dir(d / name)
        damage(d / name / "model.safetensors")
    hf_config_dir(d / "hf_tok")
    (d / "hf_tok" / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": ')
    (d / "tok").mkdir()
    (d / "tok" / "tokenizer.json").write_text("not json at all")
    # --- corpora
    (d / "random.txt").write_bytes(bytes(torch.randint(0, 256, (20_000,), generator=torch.Generator().manual_seed(0),
                                                       dtype=torch.uint8).tolist()))
    (d / "latin1.txt").write_bytes("caf\u00e9 ".encode() * 100 + "na\u00efve".encode("latin-1") + b" tail")
    (d / "late.jsonl").write_bytes(b"".join(b'{"text": "doc %d"}\n' % i for i in range(5)) + b'{"text": "\xff"}\n')
    (d / "blank.jsonl").write_text('{"text": ""}\n' * 40)
    (d / "control.txt").write_text("\x01\x02\x03\x04 " * 400)
    # --- TOML files
    (d / "bad.toml").write_text("lr = [unclosed\n")
    (d / "nan.toml").write_text("lr = nan\n")
    (d / "bool.toml").write_text("steps = true\n")
    (d / "binary.toml").write_bytes(b"lr = '\xff'\n")
    good = (ROOT / "loongtrain" / "plan" / "clusters" / "a100.toml").read_text()
    for name, old, new in [("frac", "gpus_per_node = 8", "gpus_per_node = 7.5"),
                           ("negbw", "nic_gbit_s = ", "nic_gbit_s = -"),
                           ("strbw", "intra_node_gbyte_s = ", "intra_node_gbyte_s = '"),
                           ("boolgpu", "gpus_per_node = 8", "gpus_per_node = true"),
                           ("nomem", "\nmemory_gib = ", "\n# memory_gib = "),
                           ("extra", "gpus_per_node = 8", "gpus_per_node = 8\ngpus = 8")]:
        text = good.replace(old, new)
        if name == "strbw":
            line = next(x for x in text.splitlines() if x.startswith("intra_node_gbyte_s"))
            text = text.replace(line, line + "'")
        assert text != good, name
        (d / f"cluster_{name}.toml").write_text(text)
    (d / "cluster_bad.toml").write_text("[cluster\n")
    (d / "plan_frac.toml").write_text('model = "tiny"\nseq_len = "8K"\nnodes = 1.5\n')
    (d / "plan_model.toml").write_text('seq_len = 4096\nnodes = 1\n[model]\nvocab_size = 256\ndim = "big"\n'
                                       'num_layers = 2\nnum_heads = 4\nnum_kv_heads = 4\nffn_dim = 64\n')
    (d / "plan_unknown.toml").write_text('model = "tiny"\nseq_len = 4096\nnodes = 1\nbogus = 4\n')
    (d / "plan_bad.toml").write_text('model = "tiny\n')
    (d / "hp3.toml").write_text("hp = 3\n")  # valid alone; the launcher's check refuses it with the length
    (d / "plan_gpus.toml").write_text('model = "tiny"\nseq_len = "8K"\ngpus = 100000000\n')
    # --- a finished run to export, and a damaged copy of it
    run = d / "run"
    assert main(["train", *BASE, "--corpus", str(d / "corpus.txt"), "--out-dir", str(run)]) == 0
    ckpt = run / "checkpoints" / "step_00000002"
    cut = d / "cutrun" / "checkpoints" / "step_00000002"
    import shutil

    shutil.copytree(ckpt, cut)
    (cut.parent / "latest").write_text("step_00000002\n")
    cut_file(next(cut.glob("*.distcp")), 0.9)
    (d / "hf_out").mkdir()
    (d / "hf_out" / "model.safetensors").write_bytes(b"the user's weights")
    (d / "afile").write_text("x")
    return {"dir": str(d), "corpus": str(d / "corpus.txt"), "run": str(run), "ckpt": str(ckpt)}


D = "{dir}"
TRAIN = ["train", *BASE]
PLAN = ["plan", "--model", "tiny", "--seq-len", "8K", "--nodes", "1"]
EXPORT = ["export", "{ckpt}"]
# (argv, text the one line must contain); {dir}, {corpus}, {run}, {ckpt} are filled in
CASES = [
    # 1. files that parse but say the wrong thing: train and plan alike
    ([*TRAIN, "--model", D + "/hf_minimal"], "does not state ['num_hidden_layers', 'hidden_size'"),
    (["plan", "--model", D + "/hf_minimal", "--seq-len", "8K", "--nodes", "1"], "does not state"),
    (["plan", "--model", D + "/hf_minimal/config.json", "--seq-len", "8K", "--nodes", "1"], "hf_minimal"),
    ([*TRAIN, "--model", D + "/hf_novocab"], "does not state ['vocab_size']"),
    ([*TRAIN, "--model", D + "/hf_act"], "swishish"),
    (["plan", "--model", D + "/hf_act", "--seq-len", "8K", "--nodes", "1"], "swishish"),
    ([*TRAIN, "--model", D + "/hf_strsize"], "hidden_size='32' must be a positive integer"),
    ([*TRAIN, "--model", D + "/hf_zerolayers"], "num_hidden_layers=0"),
    ([*TRAIN, "--model", D + "/hf_heads"], "hf_heads/config.json"),
    ([*TRAIN, "--model", D + "/hf_badjson"], "hf_badjson/config.json' is not a readable JSON file"),
    ([*TRAIN, "--model", D + "/hf_array"], "must hold a JSON object"),
    ([*TRAIN, "--model", D + "/hf_cut"], "hf_cut/model.safetensors"),
    ([*TRAIN, "--model", D + "/hf_header"], "hf_header/model.safetensors"),
    ([*TRAIN, "--model", D + "/hf_padded"], "hf_padded/model.safetensors"),
    ([*TRAIN, "--model", D + "/hf_tok"], "hf_tok/tokenizer.json' cannot be loaded"),
    ([*TRAIN, "--tokenizer", D + "/tok"], "tok/tokenizer.json' cannot be loaded"),
    ([*TRAIN, "--tokenizer", D + "/tok/tokenizer.json"], "tokenizer.json' cannot be loaded"),
    # 2. never destroy files
    ([*EXPORT, "--hf", D + "/hf_out"], "is not an output of `loongtrain export`"),
    ([*EXPORT, "--hf", ""], "--hf '' is empty"),
    ([*EXPORT, "--hf", D + "/afile"], "is a file"),
    ([*EXPORT, "--hf", "{run}/checkpoints/hf"], "inside the run's checkpoints"),
    ([*EXPORT, "--hf", "{run}/checkpoints", "--overwrite"], "inside the run's checkpoints"),
    ([*EXPORT, "--hf", "{run}", "--overwrite"], "holds the checkpoint"),
    (["export", D + "/cutrun", "--hf", D + "/new_hf"], ".distcp"),
    ([*TRAIN, "--corpus", "{corpus}", "--out-dir", ""], "--out-dir '' is empty"),
    ([*TRAIN, "--corpus", "{corpus}", "--out-dir", "{run}/checkpoints/step_00000002"], "inside the checkpoints"),
    ([*TRAIN, "--corpus", "{corpus}", "--out-dir", "{run}/checkpoints/sub"], "inside the checkpoints"),
    # 3. text is text
    ([*TRAIN, "--corpus", D + "/random.txt"], "random.txt: not valid UTF-8 text at byte"),
    ([*TRAIN, "--corpus", D + "/latin1.txt"], "latin1.txt: not valid UTF-8 text at byte 602"),
    ([*TRAIN, "--corpus", D + "/late.jsonl"], "late.jsonl: not valid UTF-8 text at byte 100"),
    ([*TRAIN, "--corpus", D + "/blank.jsonl"], "hold no tokens"),
    ([*TRAIN, "--corpus", "{corpus}", "--decode-errors", "lenient"], "--decode-errors='lenient' is not one of"),
    # 4. one line per usage error, every subcommand; TOML errors name the file and the key
    ([*TRAIN, "--no-such-option"], "--no-such-option"),
    ([*TRAIN, "--hp", "two"], "argument --hp: invalid int value: 'two'"),
    ([*TRAIN, "--lr"], "argument --lr: expected one argument"),
    ([*TRAIN, "--config", D + "/bad.toml"], "bad.toml' is not valid TOML"),
    ([*TRAIN, "--config", D + "/nan.toml"], "nan.toml': lr = nan must be a finite number"),
    ([*TRAIN, "--config", D + "/bool.toml"], "bool.toml': steps = True must be of type int"),
    ([*TRAIN, "--config", D + "/binary.toml"], "binary.toml' is not UTF-8"),
    ([*TRAIN, "--config", D], "is not a file"),
    ([*PLAN, "--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8' (choose from"),
    ([*PLAN, "--zero", "half"], "argument --zero: invalid choice: 'half'"),
    ([*PLAN, "--nodes", "1.5"], "argument --nodes: invalid int value: '1.5'"),
    ([*PLAN, "--bogus"], "unrecognized arguments: --bogus"),
    (["plan", "--seq-len", "8K"], "missing --model, --nodes"),
    ([*PLAN, "--nodes", "0"], "--nodes=0 must be >= 1"),
    ([*PLAN, "--batch-size", "-1"], "--batch-size=-1 must be >= 1"),
    ([*PLAN, "--doc-median", "-5"], "--doc-median=-5 must be >= 0"),
    ([*PLAN, "--seq-len", "lots"], "seq_len='lots'"),
    ([*PLAN, "--cluster", D + "/cluster_frac.toml"], "cluster_frac.toml': gpus_per_node = 7.5 must be of type int"),
    ([*PLAN, "--cluster", D + "/cluster_negbw.toml"], "cluster_negbw.toml': cluster 'a100': nic_gbit_s=-"),
    ([*PLAN, "--cluster", D + "/cluster_strbw.toml"], "cluster_strbw.toml': intra_node_gbyte_s = "),
    ([*PLAN, "--cluster", D + "/cluster_boolgpu.toml"], "gpus_per_node = True must be of type int"),
    ([*PLAN, "--cluster", D + "/cluster_nomem.toml"], "cluster_nomem.toml': missing key(s) ['memory_gib']"),
    ([*PLAN, "--cluster", D + "/cluster_extra.toml"], "cluster_extra.toml': unknown key(s) ['gpus']"),
    ([*PLAN, "--cluster", D + "/cluster_bad.toml"], "cluster_bad.toml' is not valid TOML"),
    ([*PLAN, "--cluster", "h300"], "neither a built-in cluster"),
    ([*TRAIN, "--plan", "auto", "--cluster", D + "/cluster_frac.toml"], "gpus_per_node = 7.5 must be of type int"),
    (["plan", "--config", D + "/plan_frac.toml"], "plan_frac.toml': nodes = 1.5 must be of type int"),
    (["plan", "--config", D + "/plan_model.toml"], "plan_model.toml': [model]: dim = 'big' must be of type int"),
    (["plan", "--config", D + "/plan_unknown.toml"], "plan_unknown.toml': unknown option 'bogus'"),
    (["plan", "--config", D + "/plan_bad.toml"], "plan_bad.toml' is not valid TOML"),
    (["plan", "--config", D + "/missing.toml"], "missing.toml' does not exist"),
    # a later check's error names the config file that set the option (and not when the command line set it)
    (["train", "--config", D + "/hp3.toml"], "(--hp from config file '{dir}/hp3.toml')"),
    (["plan", "--config", D + "/plan_gpus.toml"], "(--gpus from config file '{dir}/plan_gpus.toml')"),
    (["plan", "--calibrate", "--out", D], "is a directory; name the file to write"),
    (["plan", "--calibrate", "--out", D + "/no/such/dir/c.toml"], "does not exist"),
    (["plan", "--calibrate", "--calibrate-world", "0"], "--calibrate-world=0 must be >= 1"),
    (["export", "{ckpt}"], "missing --hf: give it on the command line (or in a --config file)"),
    ([*EXPORT, "--hf", D + "/x", "--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    ([*EXPORT, "--hf", D + "/x", "--bogus"], "unrecognized arguments: --bogus"),
    (["export", D + "/nowhere", "--hf", D + "/x"], "is not a loongtrain checkpoint"),
    (["fly"], f"unknown command 'fly'; choose one of {list(COMMANDS)}"),
    ([], f"no command; choose one of {list(COMMANDS)}"),
]

PREFIX = {"train": "loongtrain train: error: ", "plan": "loongtrain plan: error: ",
          "export": "loongtrain export: error: ", "fly": "loongtrain: error: unknown command",
          "": "loongtrain: error: "}


def fill(argv: list[str], files: dict[str, str]) -> list[str]:
    return [a.format(**files) for a in argv]


def hashes(root: Path) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


def rows_of(table: list, command: str) -> list:
    """The rows of ``table`` (``CASES`` or ``SAFETY``) that run ``command`` (``""``: no known command)."""
    def first(row):
        argv = row.argv if isinstance(row, Case) else row[0]
        return argv[0] if argv and argv[0] in COMMANDS else ""
    return [row for row in table if first(row) == command]


def case_ids(cases: list) -> list[str]:
    return [" ".join(a)[-70:] or "no-command" for a, _ in cases]


def check_bad_input(argv: list[str], needle: str, files: dict[str, str], capsys) -> None:
    """One row of ``CASES``, run in this process: exit 2, one line holding ``needle`` with the command's prefix,
    no traceback, every file of ``files`` untouched (no worker starts: the tests' ``no_workers``)."""
    argv, needle = fill(argv, files), needle.format(**files)
    command = argv[0] if argv else ""
    if command == "train" and "--corpus" not in argv:
        argv += ["--corpus", files["corpus"]]
    if command == "train" and "--out-dir" not in argv:
        argv += ["--out-dir", str(Path(files["dir"], "out"))]
    before = hashes(Path(files["dir"]))
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert needle in err, (needle, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(PREFIX[command]), lines[0]
    assert hashes(Path(files["dir"])) == before, "a file changed"


def check_ctrl_c(command: str, files: dict[str, str], tmp_path: Path, capsys, monkeypatch) -> None:
    """Ctrl-C while ``command`` works (its work replaced by a KeyboardInterrupt): exit 130, one last line
    saying so, no traceback, no partial output and no lock left."""
    from loongtrain.launch import eval_run as eval_launch
    from loongtrain.launch import train_run as launch
    from loongtrain.plan import report as plan_cli
    from loongtrain.train import export

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(eval_launch, "launch", interrupt)
    monkeypatch.setattr(export, "export_hf", interrupt)
    monkeypatch.setattr(plan_cli, "plan", interrupt)
    monkeypatch.setattr(launch, "_launch_local", interrupt)
    argv = {"eval": ["eval", files["run"], "--task", "position-loss", "--nproc", "1", "--out", str(tmp_path / "e")],
            "export": ["export", files["ckpt"], "--hf", str(tmp_path / "hf")],
            "plan": PLAN, "train": [*TRAIN, "--corpus", files["corpus"], "--out-dir", str(tmp_path / "t")]}[command]
    assert main(argv) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"loongtrain {command}: interrupted" and not any("Traceback" in line for line in err), err
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob(".hf.export-*"))
    assert not list(tmp_path.rglob(".loongtrain.lock")), "a lock outlived its command"


# Data safety (docs/launching.md, docs/data.md, docs/evaluation.md): the ownership rule, the output lock, the
# complete-checkpoint rule, corpus identity, manifest counts, the validation checks and the warnings, for prepare,
# train, eval, export and plan. Each row runs `loongtrain.commands.main` in this process (cwd: a scratch directory,
# or a fixture directory the row names), with every worker starter replaced: an error row exits 2 with one line
# and no worker; a warning row (code 0) reaches the workers' start with exactly that one warning line.
# Every fixture file is hashed before and after each row.


def edit_state(ckpt: Path, **changes) -> None:
    """Rewrite a checkpoint's trainer state (``changes``: top-level keys; dotted keys into dicts) and its
    checksums, as a run that recorded other values would have."""
    from loongtrain.train.checkpoint import STATE_FILE, write_checksums

    state = json.loads((ckpt / STATE_FILE).read_text())
    for key, value in changes.items():
        *path, last = key.split(".")
        node = state
        for part in path:
            node = node[int(part)] if isinstance(node, list) else node[part]
        node[last] = value
    (ckpt / STATE_FILE).write_text(json.dumps(state))
    write_checksums(ckpt)


def copy_run(src: Path, dst: Path) -> Path:
    """A copy of a run directory (its checkpoints and ``latest``); returns its checkpoint."""
    import shutil

    shutil.copytree(src, dst)
    return dst / "checkpoints" / "step_00000002"


def edit_manifest(prep: Path, edit) -> None:
    manifest = json.loads((prep / "manifest.json").read_text())
    edit(manifest)
    (prep / "manifest.json").write_text(json.dumps(manifest))


def hold_lock(directory: Path, pid: int, command: str):
    """An open fd holding ``directory``'s lock as a running ``loongtrain command`` of ``pid`` would."""
    import fcntl
    import socket

    directory.mkdir(parents=True, exist_ok=True)
    (directory / ".loongtrain").write_text(json.dumps({"command": command}))
    fd = os.open(directory / ".loongtrain.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, json.dumps({"pid": pid, "host": socket.gethostname(), "command": command}).encode())
    return fd


def make_safety(files: dict[str, str], s: Path) -> tuple[dict[str, str], list[int]]:
    """The fixture files of the data-safety table in the empty directory ``s``, beside ``files``; returns them
    and the file descriptors of the locks it holds (close them when done)."""
    from loongtrain.data.prepare import Sharding, prepare

    docs = [json.dumps({"text": f"document {i}: " + "the quick brown fox " * (1 + i % 4)}) for i in range(200)]
    (s / "docs.jsonl").write_text("\n".join(docs) + "\n")
    (s / "other.jsonl").write_text("".join(json.dumps({"text": f"other {i} " * 9}) + "\n" for i in range(60)))
    for name in ("work", "D", "user_dir"):  # folders holding a corpus and the user's notes
        (s / name).mkdir()
        (s / name / "a.jsonl").write_text('{"text": "hello world one"}\n{"text": "hello world two"}\n')
        (s / name / "notes.txt").write_text("the user's notes")
    (s / "work" / "sub").mkdir()
    (s / "cdir").mkdir()
    (s / "cdir" / "c.txt").write_text("".join(f"corpus directory line {i}\n" for i in range(40)))
    (s / "afile").write_text("x")
    (s / "blank.jsonl").write_text("\n\n\n")
    (s / "empty.jsonl").write_text("")
    (s / "tiny.jsonl").write_text('{"text": "hi"}\n')
    (s / "badbyte.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    (s / "nofield.jsonl").write_text('{"body": "x"}\n')
    (s / "foreign_manifest").mkdir()
    (s / "foreign_manifest" / "manifest.json").write_text('{"name": "my web app"}')
    (s / "tokdir").mkdir()
    bpe_tokenizer(s / "tokdir" / "tok.json")
    # prepared corpora: good, counts its files contradict, a changed source, a running prepare
    prepare([str(s / "docs.jsonl")], s / "prep", "byte", Sharding(shard_bytes=2000), workers=1)
    prepare([str(s / "other.jsonl")], s / "prep_other", workers=1)
    import shutil

    (s / "prep_link").symlink_to(s / "prep")  # one corpus under another name: a link, and a copy
    shutil.copytree(s / "prep", s / "prep_copy")

    for name, edit in [("prep_ntok", lambda m: m.update(num_tokens=m["num_tokens"] + 7)),
                       ("prep_shardtok", lambda m: m["shards"][0].update(num_tokens=m["shards"][0]["num_tokens"] - 1)),
                       ("prep_ndocs", lambda m: m.update(num_documents=m["num_documents"] + 9)),
                       ("prep_noshards", lambda m: m.pop("shards"))]:
        shutil.copytree(s / "prep", s / name)
        edit_manifest(s / name, edit)
    shutil.copytree(s / "prep", s / "prep_index")  # the index's last offset, its digests made to match
    import numpy as np

    from loongtrain.data.prepared import buffer_digests

    index = np.fromfile(s / "prep_index" / "shards" / "documents.idx", dtype="<u8")
    index[-1] -= 3
    index.tofile(s / "prep_index" / "shards" / "documents.idx")
    edit_manifest(s / "prep_index", lambda m: m.update(index=buffer_digests(index)))
    for name in ("grown", "touched"):
        (s / f"{name}.jsonl").write_text(docs[0] + "\n" + docs[1] + "\n")
        prepare([str(s / f"{name}.jsonl")], s / f"prep_{name}", workers=1)
    with open(s / "grown.jsonl", "a") as f:
        f.write(docs[2] + "\n")
    stat = (s / "touched.jsonl").stat()
    os.utime(s / "touched.jsonl", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    running = s / "running"  # a prepare at work: its marker, half its shards, its lock
    (running / ".tmp-4242").mkdir(parents=True)
    (running / ".tmp-4242" / "tokens-00000.bin").write_bytes(b"\0" * 64)
    (running / ".prepare-in-progress").write_text("{}")
    locks = [hold_lock(running, os.getppid(), "prepare"), hold_lock(s / "busy_run", os.getppid(), "train"),
             hold_lock(s / "busy_eval", os.getppid(), "eval"),
             hold_lock(s / ".busy_hf.export-tmp", os.getppid(), "export")]
    # runs: the byte run of `files`, copies of it that are incomplete, damaged or recorded other data
    run = Path(files["run"])
    ckpt = run / "checkpoints" / "step_00000002"
    shutil.copytree(ckpt, s / "tmpckpt" / "checkpoints" / "step_00000002.tmp")
    shutil.copytree(ckpt, s / "latest_tmp" / "checkpoints" / "step_00000002.tmp")
    (s / "latest_tmp" / "checkpoints" / "latest").write_text("step_00000002.tmp\n")
    shutil.copytree(ckpt, s / "nosums" / "checkpoints" / "step_00000002")
    (s / "nosums" / "checkpoints" / "step_00000002" / "checksums.json").unlink()
    flipped = next(copy_run(run, s / "corrupt").glob("*.distcp"))
    flipped.write_bytes(bytes(255 - b for b in flipped.read_bytes()))  # same size, other bytes
    (copy_run(run, s / "norng") / "rng_rank0.pt").unlink()
    edit_state(copy_run(run, s / "changed"), **{"data_identity.corpus.0.content": "0" * 64})
    edit_state(copy_run(run, s / "touchedrun"), **{"data_identity.corpus.0.mtime": "0" * 64})
    edit_state(copy_run(run, s / "tokchanged"), **{"data_identity.tokenizer": "sha256:" + "0" * 64})
    copy_run(run, s / "userrun")
    (s / "userrun" / "notes.txt").write_text("mine")
    copy_run(run, s / "foreignckpt")
    (s / "foreignckpt" / "checkpoints" / "notes.txt").write_text("mine")
    # outputs of other commands, and an earlier export with and without a file of the user's
    for name, command, entries in [("evalout", "eval", ("results.json", "meta.json")),
                                   ("prev_hf", "export", ("config.json", "model.safetensors")),
                                   ("prev_hf_user", "export", ("config.json", "notes.txt"))]:
        (s / name).mkdir()
        (s / name / ".loongtrain").write_text(json.dumps({"command": command}))
        for entry in entries:
            (s / name / entry).write_text("{}")
    # a run trained with a Hugging Face tokenizer on a prepared corpus (1 step), and copies
    tok = str(s / "tokdir" / "tok.json")
    prepare([str(s / "docs.jsonl")], s / "prep_tok", tok, workers=1)
    tokrun = s / "tokrun"
    assert main(["train", *BASE, "--corpus", str(s / "prep_tok"), "--tokenizer", tok, "--out-dir", str(tokrun)]) == 0
    edit_state(copy_run(tokrun, s / "tokgone"), **{"config.tokenizer": str(s / "no_such_tok.json")})
    edit_state(copy_run(tokrun, s / "tokedit"), **{"data_identity.tokenizer": "sha256:" + "1" * 64})
    make_hf_dir(s / "hf_noweights", weights=False)
    # --config files of eval, export and prepare whose value a later check refuses (the error names the file)
    (s / "cfg_export.toml").write_text(f'hf = "{s / "user_dir"}"\n')
    (s / "cfg_eval.toml").write_text(f'model = "{s / "nowhere"}"\ntask = "position-loss"\nnproc = 1\n')
    (s / "cfg_prepare.toml").write_text(f'tokenizer = "nosuch"\nout = "{s / "cfg_prep_out"}"\nworkers = 1\n')
    (s / "cfg_prepare_out.toml").write_text(f'out = "{s / "user_dir"}"\noverwrite = true\nworkers = 1\n')
    return {**files, "S": str(s)}, locks


@dataclasses.dataclass(frozen=True)
class Case:
    """One row: ``argv`` (``{S}``: the safety fixture, ``{run}``, ``{ckpt}``, ``{corpus}``, ``{dir}``: the
    ``files`` fixture, ``{tmp}``: this row's scratch directory), the text the one line must hold, the exit
    code (0: a warning row, the run reaches its workers), the working directory, and a fixture directory
    copied to ``{tmp}/copy`` first (a warning row that goes on to write there)."""

    name: str
    argv: tuple[str, ...]
    needle: str
    code: int = 2
    cwd: str = "{tmp}"
    copy: str = ""


S = "{S}"
TR = ("train", *BASE)
EV = ("eval", "--task", "position-loss", "--nproc", "1")
PREP = ("prepare", "--workers", "1")


def case(name: str, *argv: str, needle: str, **kw) -> Case:
    return Case(name, argv, needle, **kw)


SAFETY = [
    # the cases that once lost or misread data, one row each
    case("prepare-empty-out-overwrite-in-cwd", *PREP, "a.jsonl", "--out", "", "--overwrite", cwd=S + "/work",
          needle="--out '' is empty"),
    case("prepare-into-dir-holding-its-input", *PREP, S + "/D/a.jsonl", "--out", S + "/D", "--overwrite",
          needle="holds '{S}/D/a.jsonl', an input of this command"),
    case("second-prepare-into-a-running-one", *PREP, S + "/docs.jsonl", "--out", S + "/running",
          needle="is in use by `loongtrain prepare` (pid"),
    case("second-prepare-overwrite-a-running-one", *PREP, S + "/docs.jsonl", "--out", S + "/running", "--overwrite",
          needle="is in use by `loongtrain prepare`"),
    case("eval-of-a-tmp-checkpoint", *EV, S + "/tmpckpt/checkpoints/step_00000002.tmp",
          needle="is a save that did not finish (a .tmp directory)"),
    case("export-of-a-tmp-checkpoint", "export", S + "/tmpckpt/checkpoints/step_00000002.tmp", "--hf", "{tmp}/hf",
          needle="is a save that did not finish (a .tmp directory)"),
    case("eval-of-a-truncated-checkpoint", *EV, "{dir}/cutrun", needle=".distcp' has "),
    case("eval-of-a-truncated-checkpoint-2-workers", "eval", "--task", "position-loss", "--nproc", "2", "--hp", "2",
          "{dir}/cutrun", needle=".distcp' has "),
    case("validation-tail-of-a-prepared-corpus", *TR, "--corpus", S + "/prep", "--val-interval", "1",
          "--out-dir", "{tmp}/run", needle="", code=0),
    case("validation-tail-of-a-mixture", *TR, "--corpus", f"{S}/prep=0.5,{S}/docs.jsonl=0.5", "--val-interval", "1",
          "--out-dir", "{tmp}/run", needle="", code=0),
    case("eval-of-a-run-trained-on-a-prepared-corpus", *EV, S + "/tokrun", "--out", "{tmp}/ev", needle="", code=0),
    case("prepare-of-a-grown-source", *PREP, S + "/grown.jsonl", "--out", S + "/prep_grown",
          needle="was prepared from an earlier version of"),
    case("manifest-tokens-contradict-files", *TR, "--corpus", S + "/prep_ntok",
          needle="manifest.json: num_tokens says"),
    case("resume-after-the-corpus-changed", *TR, "--corpus", "{corpus}", "--out-dir", S + "/changed", "--resume",
          "auto", "--steps", "4", needle="changed (then: 1 file(s)"),
    case("prepare-of-an-empty-corpus", *PREP, S + "/empty.jsonl", "--out", "{tmp}/p", needle="holds no documents"),
    case("eval-out-onto-a-file", *EV, "{run}", "--out", S + "/afile", needle="--out '{S}/afile' is a file"),
    case("prepare-utf8-error-names-its-flag", *PREP, S + "/badbyte.jsonl", "--out", "{tmp}/p",
          needle="(--decode-errors replace|ignore reads it anyway)"),
    case("split-too-small", *TR, "--corpus", S + "/docs.jsonl", "--val-fraction", "0.01", "--seq-len", "512",
          "--val-interval", "1", needle="holds less than one global batch"),
    case("warn-eval-batches-past-the-split", *TR, "--corpus", S + "/prep", "--val-fraction", "0.1",
          "--val-interval", "1", "--val-batches", "999", "--out-dir", "{tmp}/run", code=0,
          needle="--val-batches 999: the held-out data holds"),
    case("warn-eval-interval-past-the-run", *TR, "--val-interval", "5", "--out-dir", "{tmp}/run", code=0,
          needle="--val-interval 5 is longer than the run (--steps 2): the run never validates"),
    case("warn-val-corpus-is-the-corpus", *TR, "--val-corpus", "{corpus}", "--val-interval", "1",
          "--out-dir", "{tmp}/run", code=0, needle="is the training corpus"),
    case("warn-hf-directory-without-weights", "eval", "--task", "position-loss", "--nproc", "1", "--seq-len", "32",
          "--corpus", "{corpus}", S + "/hf_noweights", "--out", "{tmp}/ev", code=0,
          needle="has no *.safetensors weights: evaluating randomly initialised weights"),
    # the ownership rule: prepare
    case("prepare-out-cwd", *PREP, "a.jsonl", "--out", ".", cwd=S + "/work", needle="is the current directory"),
    case("prepare-out-parent-of-cwd", *PREP, "../a.jsonl", "--out", "..", cwd=S + "/work/sub",
          needle="is the current directory or a parent of it"),
    case("prepare-out-root", *PREP, S + "/docs.jsonl", "--out", "/",
          needle="'/' is the current directory or a parent"),
    case("prepare-out-a-file", *PREP, S + "/docs.jsonl", "--out", S + "/afile", needle="is a file"),
    case("prepare-out-its-own-input", *PREP, S + "/docs.jsonl", "--out", S + "/docs.jsonl", needle="is a file"),
    case("prepare-out-user-files", *PREP, S + "/docs.jsonl", "--out", S + "/user_dir",
          needle="holds files loongtrain did not write (a.jsonl, notes.txt)"),
    case("prepare-out-user-files-overwrite", *PREP, S + "/docs.jsonl", "--out", S + "/user_dir", "--overwrite",
          needle="holds files loongtrain did not write"),
    case("prepare-out-inside-an-input-dir", *PREP, S + "/cdir", "--out", S + "/cdir/p",
          needle="lies inside '{S}/cdir', an input directory"),
    case("prepare-out-holds-the-tokenizer", *PREP, S + "/docs.jsonl", "--tokenizer", S + "/tokdir/tok.json",
          "--out", S + "/tokdir", needle="holds '{S}/tokdir/tok.json', an input"),
    case("prepare-out-a-foreign-manifest", *PREP, S + "/docs.jsonl", "--out", S + "/foreign_manifest", "--overwrite",
          needle="is not an output of `loongtrain prepare` (without loongtrain's marker"),
    case("prepare-out-a-train-run", *PREP, S + "/docs.jsonl", "--out", "{run}", "--overwrite",
          needle="holds files loongtrain did not write (checkpoints, metrics.jsonl)"),
    case("prepare-out-an-eval-output", *PREP, S + "/docs.jsonl", "--out", S + "/evalout", "--overwrite",
          needle="holds files loongtrain did not write (meta.json, results.json)"),
    case("prepare-touched-source", *PREP, S + "/touched.jsonl", "--out", S + "/prep_touched",
          needle="its modification time changed"),
    case("prepare-other-shard-size", *PREP, S + "/docs.jsonl", "--out", S + "/prep", needle="another shard_bytes"),
    case("prepare-blank-lines-only", *PREP, S + "/blank.jsonl", "--out", "{tmp}/p", needle="holds no documents"),
    case("prepare-no-text-field", *PREP, S + "/nofield.jsonl", "--out", "{tmp}/p", needle="no string field 'text'"),
    case("prepare-bad-decode-errors", *PREP, S + "/docs.jsonl", "--out", "{tmp}/p", "--decode-errors", "lenient",
          needle="argument --decode-errors: invalid choice: 'lenient'"),
    case("prepare-verify-counts", "prepare", "--verify", "--out", S + "/prep_ndocs", needle="num_documents says"),
    case("prepare-verify-not-prepared", "prepare", "--verify", "--out", S + "/user_dir",
          needle="is not a prepared corpus"),
    # the ownership rule and the lock: train
    case("train-out-cwd", *TR, "--out-dir", ".", cwd=S + "/work", needle="is the current directory"),
    case("train-out-parent-of-cwd", *TR, "--out-dir", "..", cwd=S + "/work/sub", needle="or a parent of it"),
    case("train-out-user-files", *TR, "--out-dir", S + "/user_dir", needle="holds files loongtrain did not write"),
    case("train-out-user-files-overwrite", *TR, "--out-dir", S + "/userrun", "--overwrite",
          needle="holds files loongtrain did not write (notes.txt)"),
    case("train-out-holds-the-corpus", *TR, "--corpus", S + "/D/a.jsonl", "--out-dir", S + "/D",
          needle="holds '{S}/D/a.jsonl', an input"),
    case("train-out-inside-a-corpus-dir", *TR, "--corpus", S + "/cdir", "--out-dir", S + "/cdir/run",
          needle="lies inside '{S}/cdir', an input directory"),
    case("train-out-is-the-prepared-corpus", *TR, "--corpus", S + "/prep", "--out-dir", S + "/prep",
          needle="holds '{S}/prep', an input"),
    case("train-out-holds-the-tokenizer", *TR, "--tokenizer", S + "/tokdir/tok.json", "--corpus", S + "/docs.jsonl",
          "--out-dir", S + "/tokdir", needle="holds '{S}/tokdir/tok.json', an input"),
    case("train-out-holds-the-val-corpus", *TR, "--val-corpus", S + "/D/a.jsonl", "--out-dir", S + "/D",
          needle="holds '{S}/D/a.jsonl', an input"),
    case("train-out-an-eval-output", *TR, "--out-dir", S + "/evalout", needle="holds files loongtrain did not write"),
    case("train-out-an-export", *TR, "--out-dir", S + "/prev_hf", needle="holds files loongtrain did not write"),
    case("train-out-a-prepared-dir", *TR, "--out-dir", S + "/prep_other", needle="did not write (manifest.json"),
    case("train-out-foreign-file-in-checkpoints", *TR, "--out-dir", S + "/foreignckpt", "--resume", "auto",
          "--steps", "4", needle="checkpoints' holds files loongtrain did not write (notes.txt)"),
    case("train-out-locked", *TR, "--out-dir", S + "/busy_run", needle="is in use by `loongtrain train` (pid"),
    case("train-resume-a-tmp-checkpoint", *TR, "--out-dir", "{tmp}/r",
          "--resume", S + "/tmpckpt/checkpoints/step_00000002.tmp", "--steps", "4", needle="did not finish"),
    case("train-resume-without-checksums", *TR, "--out-dir", "{tmp}/r", "--resume",
          S + "/nosums/checkpoints/step_00000002", "--steps", "4",
          needle="has no checksums.json"),
    case("train-resume-latest-names-a-tmp", *TR, "--out-dir", "{tmp}/r", "--resume", S + "/latest_tmp",
          "--steps", "4", needle="is a save that did not finish"),
    case("train-resume-corrupt-checkpoint", *TR, "--out-dir", S + "/corrupt", "--resume", "latest", "--steps", "4",
          needle=".distcp' is corrupt"),
    case("train-resume-tokenizer-changed", *TR, "--out-dir", S + "/tokchanged", "--resume", "auto", "--steps", "4",
          needle="its files changed since the checkpoint"),
    case("train-resume-prepared-tokenizer-run-changed", *TR, "--corpus", S + "/prep_tok", "--tokenizer",
          S + "/tokdir/tok.json", "--out-dir", S + "/tokedit", "--resume", "auto", "--steps", "4",
          needle="--tokenizer '{S}/tokdir/tok.json': its files changed"),
    case("warn-resume-corpus-only-touched", *TR, "--out-dir", "{tmp}/copy", "--resume", "auto", "--steps", "4",
          copy=S + "/touchedrun", code=0, needle="its files were modified (same sizes and sampled bytes"),
    # prepared corpora: counts the files contradict, before any worker
    case("prepared-shard-tokens-contradict", *TR, "--corpus", S + "/prep_shardtok",
          needle="tokens, its file holds"),
    case("prepared-documents-contradict", *TR, "--corpus", S + "/prep_ndocs", needle="num_documents says"),
    case("prepared-index-ends-contradict", *TR, "--corpus", S + "/prep_index",
          needle="the document index runs from 0"),
    case("prepared-manifest-without-shards", *TR, "--corpus", S + "/prep_noshards",
          needle="not a complete manifest (no 'shards')"),
    case("prepared-mixture-part-contradicts", *TR, "--corpus", f"{S}/prep=0.5,{S}/prep_ntok=0.5",
          needle="corpus '{S}/prep_ntok': {S}/prep_ntok/manifest.json: num_tokens says"),
    # one corpus, one name: mixture parts compared by the corpus they resolve to, not by spelling
    case("mixture-one-corpus-two-spellings", *TR, "--corpus", "prep=0.5,./prep=0.5", cwd=S,
         needle="'prep' and './prep' are one corpus ({S}/prep); name it once, with its weights summed (prep=1)"),
    case("mixture-one-corpus-and-its-link", *TR, "--corpus", f"{S}/prep=0.5,{S}/prep_link=0.5",
         needle="'{S}/prep' and '{S}/prep_link' are one corpus"),
    case("mixture-one-corpus-and-its-copy", *TR, "--corpus", f"{S}/prep=0.5,{S}/prep_copy=0.25",
         needle="'{S}/prep' and '{S}/prep_copy' hold the same corpus (the same content: prepared"),
    case("mixture-one-corpus-two-spellings-in-eval", *EV, "{run}", "--corpus", "prep=0.5,./prep/=0.5", cwd=S,
         needle="are one corpus"),
    case("prepared-val-corpus-contradicts", *TR, "--val-corpus", S + "/prep_ntok", "--val-interval", "1",
          needle="--val-corpus '{S}/prep_ntok': {S}/prep_ntok/manifest.json: num_tokens says"),
    # validation: split sizes and batches against what the run asks, before any worker
    case("split-leaves-no-training-data", *TR, "--corpus", S + "/tiny.jsonl", "--val-fraction", "0.99",
          "--seq-len", "2", needle="leaves 0 tokens for training"),
    case("split-too-small-prepared", *TR, "--corpus", S + "/prep", "--val-fraction", "0.01", "--seq-len", "512",
          "--val-interval", "1", needle="held-out documents) holds less than one global batch"),
    case("split-too-small-for-the-global-batch", *TR, "--corpus", S + "/prep", "--val-fraction", "0.05",
          "--batch-size", "64", "--val-interval", "1", needle="dp*batch_size = 64 sequences"),
    case("val-corpus-too-small", *TR, "--val-corpus", S + "/prep_other", "--seq-len", "2048", "--val-interval", "1",
          needle="holds"),
    case("split-of-a-mixture-too-small", *TR, "--corpus", f"{S}/prep=0.5,{S}/docs.jsonl=0.5", "--val-fraction",
          "0.01", "--seq-len", "512", "--val-interval", "1", needle="holds less than one global batch"),
    case("warn-tail-repeats-samples", *TR, "--val-interval", "1", "--val-batches", "500", "--out-dir", "{tmp}/run",
          code=0, needle="the validation set repeats samples"),
    case("warn-val-corpus-never-used", *TR, "--val-corpus", S + "/prep", "--out-dir", "{tmp}/run", code=0,
          needle="without --val-interval: the run never validates"),
    # eval: complete checkpoints, verified before any worker; its --out by the ownership rule
    case("eval-latest-names-a-tmp", *EV, S + "/latest_tmp", needle="is a save that did not finish"),
    case("eval-checkpoint-without-checksums", *EV, S + "/nosums/checkpoints/step_00000002",
          needle="has no checksums.json"),
    case("eval-same-size-corruption", *EV, S + "/corrupt", needle=".distcp' is corrupt"),
    case("eval-missing-rng-file", *EV, S + "/norng", needle="rng_rank0.pt' is missing"),
    case("eval-out-empty", *EV, "{run}", "--out", "", needle="--out '' is empty"),
    case("eval-out-cwd", *EV, "{run}", "--out", ".", cwd=S + "/work", needle="is the current directory"),
    case("eval-out-user-files", *EV, "{run}", "--out", S + "/user_dir", needle="holds files loongtrain did not write"),
    case("eval-out-the-run", *EV, "{run}", "--out", "{run}", needle="an input of this command"),
    case("eval-out-inside-the-checkpoint", *EV, "{run}", "--out", "{ckpt}/eval", needle="an input directory"),
    case("eval-out-a-prepared-corpus", *EV, "{run}", "--out", S + "/prep_other",
          needle="did not write (manifest.json"),
    case("eval-out-locked", *EV, "{run}", "--out", S + "/busy_eval", needle="is in use by `loongtrain eval`"),
    case("eval-out-holds-the-corpus", *EV, "{run}", "--corpus", S + "/D/a.jsonl", "--out", S + "/D",
          needle="holds '{S}/D/a.jsonl', an input"),
    case("eval-corpus-counts-contradict", *EV, "{run}", "--corpus", S + "/prep_ntok", "--out", "{tmp}/ev",
          needle="num_tokens says"),
    case("eval-prepared-corpus-too-short", *EV, "{run}", "--corpus", S + "/prep_other", "--seq-len", "4096",
          "--out", "{tmp}/ev", needle="corpus '{S}/prep_other' holds"),
    case("eval-mixture-corpus-too-short", *EV, "{run}", "--corpus", f"{S}/prep_other=0.5,{S}/tiny.jsonl=0.5",
          "--out", "{tmp}/ev", needle="corpus '{S}/tiny.jsonl' holds"),
    # export: complete checkpoints, the run's tokenizer, --hf by the ownership rule and locked
    case("export-checkpoint-without-checksums", "export", S + "/nosums/checkpoints/step_00000002", "--hf", "{tmp}/h",
          needle="has no checksums.json"),
    case("export-latest-names-a-tmp", "export", S + "/latest_tmp", "--hf", "{tmp}/h", needle="did not finish"),
    case("export-hf-cwd", "export", "{ckpt}", "--hf", ".", cwd=S + "/work", needle="is the current directory"),
    case("export-hf-parent-of-cwd", "export", "{ckpt}", "--hf", "..", cwd=S + "/work/sub", needle="or a parent of it"),
    case("export-hf-user-files-overwrite", "export", "{ckpt}", "--hf", S + "/user_dir", "--overwrite",
          needle="holds files loongtrain did not write (a.jsonl, notes.txt)"),
    case("export-hf-earlier-export", "export", "{ckpt}", "--hf", S + "/prev_hf", needle="holds an earlier export"),
    case("export-hf-earlier-export-with-user-file", "export", "{ckpt}", "--hf", S + "/prev_hf_user", "--overwrite",
          needle="holds files loongtrain did not write (notes.txt)"),
    case("export-hf-a-prepared-corpus", "export", "{ckpt}", "--hf", S + "/prep_other", "--overwrite",
          needle="did not write (manifest.json"),
    case("export-hf-an-eval-output", "export", "{ckpt}", "--hf", S + "/evalout", "--overwrite",
          needle="did not write (meta.json, results.json)"),
    case("export-hf-another-export-running", "export", "{ckpt}", "--hf", S + "/busy_hf",
          needle="is in use by `loongtrain export`"),
    case("export-hf-holds-the-tokenizer", "export", S + "/tokrun", "--hf", S + "/tokdir", "--overwrite",
          needle="holds '{S}/tokdir/tok.json', an input"),
    case("export-tokenizer-gone", "export", S + "/tokgone", "--hf", "{tmp}/h", needle="no longer exists"),
    case("export-tokenizer-changed", "export", S + "/tokedit", "--hf", "{tmp}/h",
          needle="changed since training"),
    # a value from a --config file that a later check refuses: the one line names the file and the key
    case("export-hf-from-config-onto-user-files", "export", "{ckpt}", "--config", S + "/cfg_export.toml",
         needle="(--hf from config file '{S}/cfg_export.toml')"),
    case("eval-model-from-config-missing", "eval", "--config", S + "/cfg_eval.toml",
         needle="(model from config file '{S}/cfg_eval.toml')"),
    case("prepare-tokenizer-from-config-unknown", "prepare", S + "/docs.jsonl", "--config", S + "/cfg_prepare.toml",
         needle="(--tokenizer from config file '{S}/cfg_prepare.toml')"),
    case("prepare-out-from-config-user-files", "prepare", S + "/docs.jsonl", "--config",
         S + "/cfg_prepare_out.toml", needle="(--out from config file '{S}/cfg_prepare_out.toml')"),
    case("export-config-of-another-command", "export", "{ckpt}", "--config", S + "/cfg_eval.toml",
         needle="unknown option 'model'"),
]


def stat_hashes(root: Path, cache: dict) -> dict[str, str]:
    """sha256 of every file under ``root`` (directories: "dir"), re-hashed only when its size, mtime or
    ctime changed (a write always changes ctime)."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            st = p.stat()
            key = (str(p), st.st_size, st.st_mtime_ns, st.st_ctime_ns)
            if key not in cache:
                cache[key] = hashlib.sha256(p.read_bytes()).hexdigest()
            out[str(p)] = cache[key]
        else:
            out[str(p)] = "dir"
    return out


HASH_CACHE: dict = {}


def check_safety(case: Case, safety: dict[str, str], tmp_path: Path, monkeypatch, capsys, reached: list[str]) -> None:
    """One row of ``SAFETY``, run in this process (see the table's comment)."""
    import shutil

    fill = {**safety, "tmp": str(tmp_path)}
    if case.copy:
        shutil.copytree(case.copy.format(**fill), tmp_path / "copy")
    argv = [a.format(**fill) for a in case.argv]
    if argv[0] == "train" and "--corpus" not in argv:
        argv += ["--corpus", safety["corpus"]]
    if argv[0] == "train" and "--out-dir" not in argv:
        argv += ["--out-dir", str(tmp_path / "out")]
    monkeypatch.chdir(case.cwd.format(**fill))
    roots = [Path(safety["S"]), Path(safety["dir"])]
    before = [stat_hashes(r, HASH_CACHE) for r in roots]
    code = main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == case.code, err
    assert "Traceback" not in err, err
    if case.code:
        assert reached == [], "the workers' start was reached"
        assert len(lines) == 1 and lines[0].startswith(f"loongtrain {argv[0]}: error: "), err
        assert case.needle.format(**fill) in lines[0], (case.needle, err)
    else:
        assert reached == [argv[0]], "the run did not reach its workers"
        warned = [line for line in lines if "[rank 0]" in line or " loongtrain" not in line]
        assert len(warned) <= 1 and all(case.needle in line for line in warned) and (case.needle or not warned), err
        assert bool(case.needle) == bool(warned), err
    assert [stat_hashes(r, HASH_CACHE) for r in roots] == before, "a fixture file changed"


def full_disk_at(monkeypatch, name: str, keep: int = 10):
    """Writing a file called ``name`` through loongtrain._files fails with ENOSPC after ``keep`` bytes
    (a disk that filled up there)."""
    import builtins
    import errno

    from loongtrain import _files

    class Full:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            self.f.write(bytes(memoryview(data).cast("B")[:keep]))
            raise OSError(errno.ENOSPC, "No space left on device")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def fake_open(path, mode="r"):
        f = builtins.open(path, mode)
        return Full(f) if name in Path(path).name else f

    monkeypatch.setattr(_files, "open", fake_open, raising=False)
