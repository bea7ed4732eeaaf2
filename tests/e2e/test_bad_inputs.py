"""Bad inputs a new user writes: files that parse but say the wrong thing, outputs that would
destroy files, bytes that are not text, usage and TOML errors of every subcommand. Each one exits 2
before any worker starts (within 10 s), with one line on stderr naming the file or option, no
traceback, and every file of the fixture untouched (hashed before and after).

Most cases run ``loongtrain.cli.main(argv)`` in this process with the worker starters replaced by a
function that fails the test; a few run the real command in a subprocess. The rest: the units behind
them (cu_seqlens, the restart rule, SIGTERM, the per-call agreement of attention arguments)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from loongtrain.commands import COMMANDS, main
from loongtrain.data.tokenizer import ByteTokenizer
from tests.helpers.cli_cases import BASE, bpe_tokenizer, live_workers
from tests.helpers.hf_models import make_hf_dir

ROOT = Path(__file__).resolve().parents[2]


def _cut(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _hf_config_dir(path: Path, **edit) -> Path:
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


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("bad_inputs")
    (d / "corpus.txt").write_text("".join(f"line {i}: the quick brown fox\n" for i in range(50)))
    # --- HF model directories that parse but say the wrong thing
    (d / "hf_minimal").mkdir()
    (d / "hf_minimal" / "config.json").write_text(json.dumps({"model_type": "llama",
                                                              "architectures": ["LlamaForCausalLM"]}))
    _hf_config_dir(d / "hf_novocab", vocab_size=None)
    _hf_config_dir(d / "hf_act", hidden_act="swishish")
    _hf_config_dir(d / "hf_strsize", hidden_size="32")
    _hf_config_dir(d / "hf_zerolayers", num_hidden_layers=0)
    _hf_config_dir(d / "hf_heads", num_attention_heads=5)  # 32 is not divisible by 5
    (d / "hf_badjson").mkdir()
    (d / "hf_badjson" / "config.json").write_text('{"model_type": "llama",')
    (d / "hf_array").mkdir()
    (d / "hf_array" / "config.json").write_text("[1, 2]")
    make_hf_dir(d / "hf_good")
    for name, damage in [("hf_cut", lambda f: _cut(f)),
                         ("hf_header", lambda f: f.write_bytes(b"\xff" * 8 + f.read_bytes()[8:])),
                         ("hf_padded", lambda f: f.write_bytes(f.read_bytes() + b"\0" * 16))]:
        make_hf_dir(d / name)
        damage(d / name / "model.safetensors")
    _hf_config_dir(d / "hf_tok")
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
    # --- a finished run to export, and a damaged copy of it
    run = d / "run"
    assert main(["train", *BASE, "--corpus", str(d / "corpus.txt"), "--out-dir", str(run)]) == 0
    ckpt = run / "checkpoints" / "step_00000002"
    cut = d / "cutrun" / "checkpoints" / "step_00000002"
    import shutil

    shutil.copytree(ckpt, cut)
    (cut.parent / "latest").write_text("step_00000002\n")
    _cut(next(cut.glob("*.distcp")), 0.9)
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
    (["plan", "--calibrate", "--out", D], "is a directory; name the cluster TOML file"),
    (["plan", "--calibrate", "--out", D + "/no/such/dir/c.toml"], "does not exist"),
    (["plan", "--calibrate", "--calibrate-world", "0"], "--calibrate-world=0 must be >= 1"),
    (["export", "{ckpt}"], "the following arguments are required: --hf"),
    ([*EXPORT, "--hf", D + "/x", "--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    ([*EXPORT, "--hf", D + "/x", "--bogus"], "unrecognized arguments: --bogus"),
    (["export", D + "/nowhere", "--hf", D + "/x"], "is not a loongtrain checkpoint"),
    (["fly"], f"unknown command 'fly'; choose one of {list(COMMANDS)}"),
    ([], f"no command; choose one of {list(COMMANDS)}"),
]

PREFIX = {"train": "loongtrain train: error: ", "plan": "loongtrain plan: error: ",
          "export": "loongtrain export: error: ", "fly": "loongtrain: error: unknown command",
          "": "loongtrain: error: "}


def _fill(argv: list[str], files: dict[str, str]) -> list[str]:
    return [a.format(**files) for a in argv]


def _hashes(root: Path) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


@pytest.fixture
def no_workers(monkeypatch):
    """Starting a worker, or training in this process, fails the test."""
    def started(*args, **kwargs):
        raise AssertionError("a worker was started")

    from loongtrain.launch import train_run as launch
    from loongtrain.parallel import workers

    for module, name in ((workers, "run_local"), (launch, "run_local"), (launch, "run_worker")):
        monkeypatch.setattr(module, name, started)


def test_enough_cases():
    assert len(CASES) >= 60


@pytest.mark.parametrize("argv, needle", CASES, ids=[" ".join(a)[-70:] or "no-command" for a, _ in CASES])
def test_bad_input_exits_2_with_one_line(argv, needle, files, capsys, no_workers):
    argv, needle = _fill(argv, files), needle.format(**files)
    command = argv[0] if argv else ""
    if command == "train" and "--corpus" not in argv:
        argv += ["--corpus", files["corpus"]]
    if command == "train" and "--out-dir" not in argv:
        argv += ["--out-dir", str(Path(files["dir"], "out"))]
    before = _hashes(Path(files["dir"]))
    t0 = time.perf_counter()
    code = main(argv)
    elapsed = time.perf_counter() - t0
    err = capsys.readouterr().err
    assert code == 2, err
    assert elapsed < 10, f"{elapsed:.1f} s"
    assert needle in err, (needle, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(PREFIX[command]), lines[0]
    assert _hashes(Path(files["dir"])) == before, "a file changed"


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


def test_decode_errors_opt_in_and_control_bytes_warn(files, caplog):
    """--decode-errors replace reads random bytes (with a warning naming their share); the strict
    default refuses them (the table above); a corpus of control characters warns."""
    from loongtrain.data.tokenizer import ByteTokenizer
    from loongtrain.launch.preflight import check_corpus
    from loongtrain.train.config import TrainConfig

    caplog.set_level(logging.INFO, logger="loongtrain")
    logging.getLogger("loongtrain").addHandler(caplog.handler)  # the CLI's logger does not propagate
    for corpus, errors in (("random.txt", "replace"), ("random.txt", "ignore"), ("control.txt", "strict")):
        caplog.clear()
        cfg = TrainConfig(corpus=str(Path(files["dir"], corpus)), seq_len=16, decode_errors=errors)
        check_corpus(cfg, ByteTokenizer())
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warned) == 1 and "% of its first" in warned[0] and corpus in warned[0], warned
    caplog.clear()
    check_corpus(TrainConfig(corpus=files["corpus"], seq_len=16), ByteTokenizer())
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    logging.getLogger("loongtrain").removeHandler(caplog.handler)


@pytest.mark.parametrize("cu, needle", [
    ([0.0, 4.0, 8.0], r"cu_seqlens\[0\]\[0\] = 0.0 \(float\)"),
    ([0, 4.5, 8], r"cu_seqlens\[0\]\[1\] = 4.5"),
    ([0, True, 8], r"cu_seqlens\[0\]\[1\] = True"),
    (torch.tensor([0, 4, 8], device="meta"), "meta device"),
    (torch.tensor([0.0, 4.0, 8.0]), "1-D integer tensor"),
    ("0,4,8", "got str"),
    ([[0, 4, 8], [0, 8.0]], r"cu_seqlens\[1\]\[1\] = 8.0"),
])
def test_cu_seqlens_of_the_wrong_kind_raise_value_error(cu, needle):
    from loongtrain import attention

    q = torch.randn(1 if not isinstance(cu, list) or not isinstance(cu[0], list) else 2, 8, 2, 4)
    with pytest.raises(ValueError, match=needle):
        attention(q, q, q, None, cu_seqlens=cu)


def test_restart_rule_and_one_line_report(monkeypatch, files, capsys):
    """A failure a restart cannot fix (a full disk, even wrapped by DCP; a ValueError; NonFiniteError)
    is not retried by --max-restarts, and the launcher prints its cause once."""
    import errno

    from loongtrain.launch import train_run as launch
    from loongtrain.parallel.failures import restartable
    from loongtrain.parallel.workers import WorkerError
    from loongtrain.train.checkpoint import NonFiniteError

    full = OSError(errno.ENOSPC, "No space left on device")

    class Wrapper(BaseException):  # like DCP's CheckpointException: {rank: (exception, trace)}
        failures = {1: (full, None)}

    for exc, again in ((full, False), (Wrapper(), False), (ValueError("x"), False), (NonFiniteError("x"), False),
                       (RuntimeError("connection reset by peer"), True), (OSError(errno.EIO, "io"), True)):
        assert restartable(exc)[0] is again, exc
    try:
        raise RuntimeError("save failed") from full
    except RuntimeError as exc:
        assert restartable(exc) == (False, full)

    calls = []

    def failing(*args, **kwargs):
        calls.append(1)
        raise WorkerError(1, 2, "Traceback ...\nOSError: [Errno 28] No space left on device",
                          "OSError: [Errno 28] No space left on device", "OSError", restartable=False)

    monkeypatch.setattr(launch, "run_local", failing)
    argv = ["train", *BASE, "--nproc", "2", "--hp", "2", "--max-restarts", "3", "--corpus", files["corpus"],
            "--out-dir", str(Path(files["dir"], "full"))]
    assert main(argv) == 1
    assert calls == [1], "retried a failure a restart cannot fix"
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "loongtrain train: failed: rank 1 of 2: OSError: [Errno 28] No space left on device"
    assert not any("Traceback" in line for line in err), err


@pytest.mark.distributed  # starts processes
@pytest.mark.parametrize("argv, needle", [
    # `plan` through the real entry point (its row is in the table above too; `train`'s subprocess case is
    # tests/e2e/test_cli_errors.py's): each subprocess costs an interpreter start and the imports
    ([*PLAN, "--cluster", D + "/cluster_frac.toml"], "gpus_per_node = 7.5"),
])
def test_bad_input_in_a_subprocess(argv, needle, files):
    argv = _fill(argv, files)
    if argv[0] == "train":
        argv += ["--corpus", files["corpus"], "--out-dir", str(Path(files["dir"], "out"))]
    before = _hashes(Path(files["dir"]))
    # the time bound is the in-process table's; here interpreter start and imports dominate (~3 s on
    # quiet cores, over 30 s measured on the shared 2-core machine), so only the timeout bounds it
    proc = subprocess.run([sys.executable, "-m", "loongtrain.commands", *argv], cwd=ROOT, capture_output=True,
                          text=True,
                          timeout=180, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert _hashes(Path(files["dir"])) == before


@pytest.mark.distributed
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_is_handled_like_sigint(files, tmp_path, capsys):
    """SIGTERM to the launcher: one line, exit 143, no worker left, no partial checkpoint."""
    out = tmp_path / "run"
    argv = ["train", *BASE, "--nproc", "2", "--hp", "2", "--steps", "200", "--ckpt-interval", "1",
            "--corpus", files["corpus"], "--out-dir", str(out)]
    seen: list[int] = []

    def terminate_when_training():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (out / "metrics.jsonl").is_file():
            time.sleep(0.05)
        seen.extend(live_workers(os.getpid()).values())
        os.kill(os.getpid(), signal.SIGTERM)

    killer = threading.Thread(target=terminate_when_training, daemon=True)
    killer.start()
    code = main(argv)
    killer.join(5)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 128 + signal.SIGTERM, err
    assert err[-1].startswith("loongtrain train: terminated (SIGTERM)"), err
    assert not any("Traceback" in line for line in err), err
    assert seen, "no worker was seen"
    time.sleep(0.2)
    assert not live_workers(os.getpid()), "a worker outlived the launcher"
    assert not list((out / "checkpoints").glob("*.tmp")), "a partial checkpoint was left"


def _attention_changes_later(rank: int, world_size: int) -> list[str]:
    """Agreed calls, then one rank changes its document boundaries (and, later, its dtype): every rank
    must raise, naming the field, however many calls came before."""
    from loongtrain import attention, shard_sequence
    from loongtrain.parallel.mesh import init_mesh

    mesh = init_mesh(1, 2)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (shard_sequence(torch.randn(1, 16, 2, 4, generator=gen, dtype=torch.float64), mesh, dim=1)
               for _ in range(3))
    cu = torch.tensor([0, 8, 16])
    for _ in range(3):
        attention(q, k, v, mesh, cu_seqlens=cu)
    errors = []
    for bad in (lambda: attention(q, k, v, mesh, cu_seqlens=torch.tensor([0, 4 if rank else 8, 16])),
                lambda: attention(q, k, v, mesh, cu_seqlens=[0.0, 8.0, 16.0] if rank else [0, 8, 16]),
                lambda: attention(q.float() if rank else q, k, v, mesh, cu_seqlens=cu)):
        try:
            bad()
        except ValueError as exc:
            errors.append(str(exc))
    attention(q, k, v, mesh, cu_seqlens=cu)  # agreed again: runs
    return errors


@pytest.mark.distributed
def test_a_later_disagreement_raises_on_every_rank():
    from loongtrain.parallel.workers import run_local

    for errors in run_local(_attention_changes_later, 2, backend="gloo", timeout=120, collective_timeout=20):
        assert len(errors) == 3, errors
        assert "documents: (0, 8, 16) on ranks [0], (0, 4, 16) on ranks [1]" in errors[0], errors[0]
        assert "documents" in errors[1] and "(0.0, 8.0, 16.0) on ranks [1]" in errors[1], errors[1]
        assert "dtype: 'torch.float64' on ranks [0], 'torch.float32' on ranks [1]" in errors[2], errors[2]


# ----------------------------------------------------------------------------------------------------------
# Data safety (docs/launching.md, docs/data.md, docs/evaluation.md): the ownership rule, the output lock, the
# complete-checkpoint
# rule, corpus identity, manifest counts, the validation checks and the warnings, for prepare, train, eval,
# export and plan. Each row runs `loongtrain.commands.main` in this process (cwd: a scratch directory, or a
# fixture directory the row names), with every worker starter replaced: an error row exits 2 with one line
# and no worker; a warning row (code 0) reaches the workers' start with exactly that one warning line.
# Every fixture file is hashed before and after each row.


def _edit_state(ckpt: Path, **changes) -> None:
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


def _copy_run(src: Path, dst: Path) -> Path:
    """A copy of a run directory (its checkpoints and ``latest``); returns its checkpoint."""
    import shutil

    shutil.copytree(src, dst)
    return dst / "checkpoints" / "step_00000002"


def _edit_manifest(prep: Path, edit) -> None:
    manifest = json.loads((prep / "manifest.json").read_text())
    edit(manifest)
    (prep / "manifest.json").write_text(json.dumps(manifest))


def _hold_lock(directory: Path, pid: int, command: str):
    """An open fd holding ``directory``'s lock as a running ``loongtrain command`` of ``pid`` would."""
    import fcntl
    import socket

    directory.mkdir(parents=True, exist_ok=True)
    (directory / ".loongtrain").write_text(json.dumps({"command": command}))
    fd = os.open(directory / ".loongtrain.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, json.dumps({"pid": pid, "host": socket.gethostname(), "command": command}).encode())
    return fd




@pytest.fixture(scope="module")
def safety(files, tmp_path_factory):
    """Fixture files of the data-safety table (module docstring of the section above), beside ``files``."""
    from loongtrain.data.prepare import prepare

    s = tmp_path_factory.mktemp("safety")
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
    prepare([str(s / "docs.jsonl")], s / "prep", workers=1, shard_bytes=2000)
    prepare([str(s / "other.jsonl")], s / "prep_other", workers=1)
    import shutil

    for name, edit in [("prep_ntok", lambda m: m.update(num_tokens=m["num_tokens"] + 7)),
                       ("prep_shardtok", lambda m: m["shards"][0].update(num_tokens=m["shards"][0]["num_tokens"] - 1)),
                       ("prep_ndocs", lambda m: m.update(num_documents=m["num_documents"] + 9)),
                       ("prep_noshards", lambda m: m.pop("shards"))]:
        shutil.copytree(s / "prep", s / name)
        _edit_manifest(s / name, edit)
    shutil.copytree(s / "prep", s / "prep_index")  # the index's last offset, its digests made to match
    import numpy as np

    from loongtrain.data.prepared import buffer_digests

    index = np.fromfile(s / "prep_index" / "shards" / "documents.idx", dtype="<u8")
    index[-1] -= 3
    index.tofile(s / "prep_index" / "shards" / "documents.idx")
    _edit_manifest(s / "prep_index", lambda m: m.update(index=buffer_digests(index)))
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
    locks = [_hold_lock(running, os.getppid(), "prepare"), _hold_lock(s / "busy_run", os.getppid(), "train"),
             _hold_lock(s / "busy_eval", os.getppid(), "eval"),
             _hold_lock(s / ".busy_hf.export-tmp", os.getppid(), "export")]
    # runs: the byte run of `files`, copies of it that are incomplete, damaged or recorded other data
    run = Path(files["run"])
    ckpt = run / "checkpoints" / "step_00000002"
    shutil.copytree(ckpt, s / "tmpckpt" / "checkpoints" / "step_00000002.tmp")
    shutil.copytree(ckpt, s / "latest_tmp" / "checkpoints" / "step_00000002.tmp")
    (s / "latest_tmp" / "checkpoints" / "latest").write_text("step_00000002.tmp\n")
    shutil.copytree(ckpt, s / "nosums" / "checkpoints" / "step_00000002")
    (s / "nosums" / "checkpoints" / "step_00000002" / "checksums.json").unlink()
    flipped = next(_copy_run(run, s / "corrupt").glob("*.distcp"))
    flipped.write_bytes(bytes(255 - b for b in flipped.read_bytes()))  # same size, other bytes
    (_copy_run(run, s / "norng") / "rng_rank0.pt").unlink()
    _edit_state(_copy_run(run, s / "changed"), **{"data_identity.corpus.0.content": "0" * 64})
    _edit_state(_copy_run(run, s / "touchedrun"), **{"data_identity.corpus.0.mtime": "0" * 64})
    _edit_state(_copy_run(run, s / "tokchanged"), **{"data_identity.tokenizer": "sha256:" + "0" * 64})
    _copy_run(run, s / "userrun")
    (s / "userrun" / "notes.txt").write_text("mine")
    _copy_run(run, s / "foreignckpt")
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
    _edit_state(_copy_run(tokrun, s / "tokgone"), **{"config.tokenizer": str(s / "no_such_tok.json")})
    _edit_state(_copy_run(tokrun, s / "tokedit"), **{"data_identity.tokenizer": "sha256:" + "1" * 64})
    make_hf_dir(s / "hf_noweights", weights=False)
    yield {**files, "S": str(s)}
    for fd in locks:
        os.close(fd)


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


def _case(name: str, *argv: str, needle: str, **kw) -> Case:
    return Case(name, argv, needle, **kw)


SAFETY = [
    # the cases that once lost or misread data, one row each
    _case("prepare-empty-out-overwrite-in-cwd", *PREP, "a.jsonl", "--out", "", "--overwrite", cwd=S + "/work",
          needle="--out '' is empty"),
    _case("prepare-into-dir-holding-its-input", *PREP, S + "/D/a.jsonl", "--out", S + "/D", "--overwrite",
          needle="holds '{S}/D/a.jsonl', an input of this command"),
    _case("second-prepare-into-a-running-one", *PREP, S + "/docs.jsonl", "--out", S + "/running",
          needle="is in use by `loongtrain prepare` (pid"),
    _case("second-prepare-overwrite-a-running-one", *PREP, S + "/docs.jsonl", "--out", S + "/running", "--overwrite",
          needle="is in use by `loongtrain prepare`"),
    _case("eval-of-a-tmp-checkpoint", *EV, S + "/tmpckpt/checkpoints/step_00000002.tmp",
          needle="is a save that did not finish (a .tmp directory)"),
    _case("export-of-a-tmp-checkpoint", "export", S + "/tmpckpt/checkpoints/step_00000002.tmp", "--hf", "{tmp}/hf",
          needle="is a save that did not finish (a .tmp directory)"),
    _case("eval-of-a-truncated-checkpoint", *EV, "{dir}/cutrun", needle=".distcp' has "),
    _case("eval-of-a-truncated-checkpoint-2-workers", "eval", "--task", "position-loss", "--nproc", "2", "--hp", "2",
          "{dir}/cutrun", needle=".distcp' has "),
    _case("validation-tail-of-a-prepared-corpus", *TR, "--corpus", S + "/prep", "--val-interval", "1",
          "--out-dir", "{tmp}/run", needle="", code=0),
    _case("validation-tail-of-a-mixture", *TR, "--corpus", f"{S}/prep=0.5,{S}/docs.jsonl=0.5", "--val-interval", "1",
          "--out-dir", "{tmp}/run", needle="", code=0),
    _case("eval-of-a-run-trained-on-a-prepared-corpus", *EV, S + "/tokrun", "--out", "{tmp}/ev", needle="", code=0),
    _case("prepare-of-a-grown-source", *PREP, S + "/grown.jsonl", "--out", S + "/prep_grown",
          needle="was prepared from an earlier version of"),
    _case("manifest-tokens-contradict-files", *TR, "--corpus", S + "/prep_ntok",
          needle="manifest.json: num_tokens says"),
    _case("resume-after-the-corpus-changed", *TR, "--corpus", "{corpus}", "--out-dir", S + "/changed", "--resume",
          "auto", "--steps", "4", needle="changed (then: 1 file(s)"),
    _case("prepare-of-an-empty-corpus", *PREP, S + "/empty.jsonl", "--out", "{tmp}/p", needle="holds no documents"),
    _case("eval-out-onto-a-file", *EV, "{run}", "--out", S + "/afile", needle="--out '{S}/afile' is a file"),
    _case("prepare-utf8-error-names-its-flag", *PREP, S + "/badbyte.jsonl", "--out", "{tmp}/p",
          needle="(--decode-errors replace|ignore reads it anyway)"),
    _case("split-too-small", *TR, "--corpus", S + "/docs.jsonl", "--val-fraction", "0.01", "--seq-len", "512",
          "--val-interval", "1", needle="holds less than one global batch"),
    _case("warn-eval-batches-past-the-split", *TR, "--corpus", S + "/prep", "--val-fraction", "0.1",
          "--val-interval", "1", "--val-batches", "999", "--out-dir", "{tmp}/run", code=0,
          needle="--val-batches 999: the held-out data holds"),
    _case("warn-eval-interval-past-the-run", *TR, "--val-interval", "5", "--out-dir", "{tmp}/run", code=0,
          needle="--val-interval 5 is longer than the run (--steps 2): the run never validates"),
    _case("warn-val-corpus-is-the-corpus", *TR, "--val-corpus", "{corpus}", "--val-interval", "1",
          "--out-dir", "{tmp}/run", code=0, needle="is the training corpus"),
    _case("warn-hf-directory-without-weights", "eval", "--task", "position-loss", "--nproc", "1", "--seq-len", "32",
          "--corpus", "{corpus}", S + "/hf_noweights", "--out", "{tmp}/ev", code=0,
          needle="has no *.safetensors weights: evaluating randomly initialised weights"),
    # the ownership rule: prepare
    _case("prepare-out-cwd", *PREP, "a.jsonl", "--out", ".", cwd=S + "/work", needle="is the current directory"),
    _case("prepare-out-parent-of-cwd", *PREP, "../a.jsonl", "--out", "..", cwd=S + "/work/sub",
          needle="is the current directory or a parent of it"),
    _case("prepare-out-root", *PREP, S + "/docs.jsonl", "--out", "/",
          needle="'/' is the current directory or a parent"),
    _case("prepare-out-a-file", *PREP, S + "/docs.jsonl", "--out", S + "/afile", needle="is a file"),
    _case("prepare-out-its-own-input", *PREP, S + "/docs.jsonl", "--out", S + "/docs.jsonl", needle="is a file"),
    _case("prepare-out-user-files", *PREP, S + "/docs.jsonl", "--out", S + "/user_dir",
          needle="holds files loongtrain did not write (a.jsonl, notes.txt)"),
    _case("prepare-out-user-files-overwrite", *PREP, S + "/docs.jsonl", "--out", S + "/user_dir", "--overwrite",
          needle="holds files loongtrain did not write"),
    _case("prepare-out-inside-an-input-dir", *PREP, S + "/cdir", "--out", S + "/cdir/p",
          needle="lies inside '{S}/cdir', an input directory"),
    _case("prepare-out-holds-the-tokenizer", *PREP, S + "/docs.jsonl", "--tokenizer", S + "/tokdir/tok.json",
          "--out", S + "/tokdir", needle="holds '{S}/tokdir/tok.json', an input"),
    _case("prepare-out-a-foreign-manifest", *PREP, S + "/docs.jsonl", "--out", S + "/foreign_manifest", "--overwrite",
          needle="is not an output of `loongtrain prepare` (without loongtrain's marker"),
    _case("prepare-out-a-train-run", *PREP, S + "/docs.jsonl", "--out", "{run}", "--overwrite",
          needle="holds files loongtrain did not write (checkpoints, metrics.jsonl)"),
    _case("prepare-out-an-eval-output", *PREP, S + "/docs.jsonl", "--out", S + "/evalout", "--overwrite",
          needle="holds files loongtrain did not write (meta.json, results.json)"),
    _case("prepare-touched-source", *PREP, S + "/touched.jsonl", "--out", S + "/prep_touched",
          needle="its modification time changed"),
    _case("prepare-other-shard-size", *PREP, S + "/docs.jsonl", "--out", S + "/prep", needle="another shard_bytes"),
    _case("prepare-blank-lines-only", *PREP, S + "/blank.jsonl", "--out", "{tmp}/p", needle="holds no documents"),
    _case("prepare-no-text-field", *PREP, S + "/nofield.jsonl", "--out", "{tmp}/p", needle="no string field 'text'"),
    _case("prepare-bad-decode-errors", *PREP, S + "/docs.jsonl", "--out", "{tmp}/p", "--decode-errors", "lenient",
          needle="argument --decode-errors: invalid choice: 'lenient'"),
    _case("prepare-verify-counts", "prepare", "--verify", "--out", S + "/prep_ndocs", needle="num_documents says"),
    _case("prepare-verify-not-prepared", "prepare", "--verify", "--out", S + "/user_dir",
          needle="is not a prepared corpus"),
    # the ownership rule and the lock: train
    _case("train-out-cwd", *TR, "--out-dir", ".", cwd=S + "/work", needle="is the current directory"),
    _case("train-out-parent-of-cwd", *TR, "--out-dir", "..", cwd=S + "/work/sub", needle="or a parent of it"),
    _case("train-out-user-files", *TR, "--out-dir", S + "/user_dir", needle="holds files loongtrain did not write"),
    _case("train-out-user-files-overwrite", *TR, "--out-dir", S + "/userrun", "--overwrite",
          needle="holds files loongtrain did not write (notes.txt)"),
    _case("train-out-holds-the-corpus", *TR, "--corpus", S + "/D/a.jsonl", "--out-dir", S + "/D",
          needle="holds '{S}/D/a.jsonl', an input"),
    _case("train-out-inside-a-corpus-dir", *TR, "--corpus", S + "/cdir", "--out-dir", S + "/cdir/run",
          needle="lies inside '{S}/cdir', an input directory"),
    _case("train-out-is-the-prepared-corpus", *TR, "--corpus", S + "/prep", "--out-dir", S + "/prep",
          needle="holds '{S}/prep', an input"),
    _case("train-out-holds-the-tokenizer", *TR, "--tokenizer", S + "/tokdir/tok.json", "--corpus", S + "/docs.jsonl",
          "--out-dir", S + "/tokdir", needle="holds '{S}/tokdir/tok.json', an input"),
    _case("train-out-holds-the-val-corpus", *TR, "--val-corpus", S + "/D/a.jsonl", "--out-dir", S + "/D",
          needle="holds '{S}/D/a.jsonl', an input"),
    _case("train-out-an-eval-output", *TR, "--out-dir", S + "/evalout", needle="holds files loongtrain did not write"),
    _case("train-out-an-export", *TR, "--out-dir", S + "/prev_hf", needle="holds files loongtrain did not write"),
    _case("train-out-a-prepared-dir", *TR, "--out-dir", S + "/prep_other", needle="did not write (manifest.json"),
    _case("train-out-foreign-file-in-checkpoints", *TR, "--out-dir", S + "/foreignckpt", "--resume", "auto",
          "--steps", "4", needle="checkpoints' holds files loongtrain did not write (notes.txt)"),
    _case("train-out-locked", *TR, "--out-dir", S + "/busy_run", needle="is in use by `loongtrain train` (pid"),
    _case("train-resume-a-tmp-checkpoint", *TR, "--out-dir", "{tmp}/r",
          "--resume", S + "/tmpckpt/checkpoints/step_00000002.tmp", "--steps", "4", needle="did not finish"),
    _case("train-resume-without-checksums", *TR, "--out-dir", "{tmp}/r", "--resume",
          S + "/nosums/checkpoints/step_00000002", "--steps", "4",
          needle="has no checksums.json and is not the target"),
    _case("train-resume-latest-names-a-tmp", *TR, "--out-dir", "{tmp}/r", "--resume", S + "/latest_tmp",
          "--steps", "4", needle="is a save that did not finish"),
    _case("train-resume-corrupt-checkpoint", *TR, "--out-dir", S + "/corrupt", "--resume", "latest", "--steps", "4",
          needle=".distcp' is corrupt"),
    _case("train-resume-tokenizer-changed", *TR, "--out-dir", S + "/tokchanged", "--resume", "auto", "--steps", "4",
          needle="its files changed since the checkpoint"),
    _case("train-resume-prepared-tokenizer-run-changed", *TR, "--corpus", S + "/prep_tok", "--tokenizer",
          S + "/tokdir/tok.json", "--out-dir", S + "/tokedit", "--resume", "auto", "--steps", "4",
          needle="--tokenizer '{S}/tokdir/tok.json': its files changed"),
    _case("warn-resume-corpus-only-touched", *TR, "--out-dir", "{tmp}/copy", "--resume", "auto", "--steps", "4",
          copy=S + "/touchedrun", code=0, needle="its files were modified (same sizes and sampled bytes"),
    # prepared corpora: counts the files contradict, before any worker
    _case("prepared-shard-tokens-contradict", *TR, "--corpus", S + "/prep_shardtok",
          needle="tokens, its file holds"),
    _case("prepared-documents-contradict", *TR, "--corpus", S + "/prep_ndocs", needle="num_documents says"),
    _case("prepared-index-ends-contradict", *TR, "--corpus", S + "/prep_index",
          needle="the document index runs from 0"),
    _case("prepared-manifest-without-shards", *TR, "--corpus", S + "/prep_noshards",
          needle="not a complete manifest (no 'shards')"),
    _case("prepared-mixture-part-contradicts", *TR, "--corpus", f"{S}/prep=0.5,{S}/prep_ntok=0.5",
          needle="corpus '{S}/prep_ntok': {S}/prep_ntok/manifest.json: num_tokens says"),
    _case("prepared-val-corpus-contradicts", *TR, "--val-corpus", S + "/prep_ntok", "--val-interval", "1",
          needle="--val-corpus '{S}/prep_ntok': {S}/prep_ntok/manifest.json: num_tokens says"),
    # validation: split sizes and batches against what the run asks, before any worker
    _case("split-leaves-no-training-data", *TR, "--corpus", S + "/tiny.jsonl", "--val-fraction", "0.99",
          "--seq-len", "2", needle="leaves 0 tokens for training"),
    _case("split-too-small-prepared", *TR, "--corpus", S + "/prep", "--val-fraction", "0.01", "--seq-len", "512",
          "--val-interval", "1", needle="held-out documents) holds less than one global batch"),
    _case("split-too-small-for-the-global-batch", *TR, "--corpus", S + "/prep", "--val-fraction", "0.05",
          "--batch-size", "64", "--val-interval", "1", needle="dp*batch_size = 64 sequences"),
    _case("val-corpus-too-small", *TR, "--val-corpus", S + "/prep_other", "--seq-len", "2048", "--val-interval", "1",
          needle="holds"),
    _case("split-of-a-mixture-too-small", *TR, "--corpus", f"{S}/prep=0.5,{S}/docs.jsonl=0.5", "--val-fraction",
          "0.01", "--seq-len", "512", "--val-interval", "1", needle="holds less than one global batch"),
    _case("warn-tail-repeats-samples", *TR, "--val-interval", "1", "--val-batches", "500", "--out-dir", "{tmp}/run",
          code=0, needle="the validation set repeats samples"),
    _case("warn-val-corpus-never-used", *TR, "--val-corpus", S + "/prep", "--out-dir", "{tmp}/run", code=0,
          needle="without --val-interval: the run never validates"),
    # eval: complete checkpoints, verified before any worker; its --out by the ownership rule
    _case("eval-latest-names-a-tmp", *EV, S + "/latest_tmp", needle="is a save that did not finish"),
    _case("eval-checkpoint-without-checksums", *EV, S + "/nosums/checkpoints/step_00000002",
          needle="has no checksums.json and is not the target"),
    _case("eval-same-size-corruption", *EV, S + "/corrupt", needle=".distcp' is corrupt"),
    _case("eval-missing-rng-file", *EV, S + "/norng", needle="rng_rank0.pt' is missing"),
    _case("eval-out-empty", *EV, "{run}", "--out", "", needle="--out '' is empty"),
    _case("eval-out-cwd", *EV, "{run}", "--out", ".", cwd=S + "/work", needle="is the current directory"),
    _case("eval-out-user-files", *EV, "{run}", "--out", S + "/user_dir", needle="holds files loongtrain did not write"),
    _case("eval-out-the-run", *EV, "{run}", "--out", "{run}", needle="an input of this command"),
    _case("eval-out-inside-the-checkpoint", *EV, "{run}", "--out", "{ckpt}/eval", needle="an input directory"),
    _case("eval-out-a-prepared-corpus", *EV, "{run}", "--out", S + "/prep_other",
          needle="did not write (manifest.json"),
    _case("eval-out-locked", *EV, "{run}", "--out", S + "/busy_eval", needle="is in use by `loongtrain eval`"),
    _case("eval-out-holds-the-corpus", *EV, "{run}", "--corpus", S + "/D/a.jsonl", "--out", S + "/D",
          needle="holds '{S}/D/a.jsonl', an input"),
    _case("eval-corpus-counts-contradict", *EV, "{run}", "--corpus", S + "/prep_ntok", "--out", "{tmp}/ev",
          needle="num_tokens says"),
    _case("eval-prepared-corpus-too-short", *EV, "{run}", "--corpus", S + "/prep_other", "--seq-len", "4096",
          "--out", "{tmp}/ev", needle="corpus '{S}/prep_other' holds"),
    _case("eval-mixture-corpus-too-short", *EV, "{run}", "--corpus", f"{S}/prep_other=0.5,{S}/tiny.jsonl=0.5",
          "--out", "{tmp}/ev", needle="corpus '{S}/tiny.jsonl' holds"),
    # export: complete checkpoints, the run's tokenizer, --hf by the ownership rule and locked
    _case("export-checkpoint-without-checksums", "export", S + "/nosums/checkpoints/step_00000002", "--hf", "{tmp}/h",
          needle="has no checksums.json"),
    _case("export-latest-names-a-tmp", "export", S + "/latest_tmp", "--hf", "{tmp}/h", needle="did not finish"),
    _case("export-hf-cwd", "export", "{ckpt}", "--hf", ".", cwd=S + "/work", needle="is the current directory"),
    _case("export-hf-parent-of-cwd", "export", "{ckpt}", "--hf", "..", cwd=S + "/work/sub", needle="or a parent of it"),
    _case("export-hf-user-files-overwrite", "export", "{ckpt}", "--hf", S + "/user_dir", "--overwrite",
          needle="holds files loongtrain did not write (a.jsonl, notes.txt)"),
    _case("export-hf-earlier-export", "export", "{ckpt}", "--hf", S + "/prev_hf", needle="holds an earlier export"),
    _case("export-hf-earlier-export-with-user-file", "export", "{ckpt}", "--hf", S + "/prev_hf_user", "--overwrite",
          needle="holds files loongtrain did not write (notes.txt)"),
    _case("export-hf-a-prepared-corpus", "export", "{ckpt}", "--hf", S + "/prep_other", "--overwrite",
          needle="did not write (manifest.json"),
    _case("export-hf-an-eval-output", "export", "{ckpt}", "--hf", S + "/evalout", "--overwrite",
          needle="did not write (meta.json, results.json)"),
    _case("export-hf-another-export-running", "export", "{ckpt}", "--hf", S + "/busy_hf",
          needle="is in use by `loongtrain export`"),
    _case("export-hf-holds-the-tokenizer", "export", S + "/tokrun", "--hf", S + "/tokdir", "--overwrite",
          needle="holds '{S}/tokdir/tok.json', an input"),
    _case("export-tokenizer-gone", "export", S + "/tokgone", "--hf", "{tmp}/h", needle="no longer exists"),
    _case("export-tokenizer-changed", "export", S + "/tokedit", "--hf", "{tmp}/h",
          needle="changed since training"),
]


def _stat_hashes(root: Path, cache: dict) -> dict[str, str]:
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


_HASH_CACHE: dict = {}


@pytest.fixture
def reached(monkeypatch):
    """Worker starters replaced: a worker started fails the test; reaching the start of train's or eval's
    workers (after every check) is recorded and returns."""
    from loongtrain.data import prepare as prep
    from loongtrain.launch import eval_run as eval_launch
    from loongtrain.launch import train_run as launch
    from loongtrain.parallel import workers

    def started(*args, **kwargs):
        raise AssertionError("a worker was started")

    seen: list[str] = []
    for module, name in ((workers, "run_local"), (launch, "run_local"), (launch, "run_worker"),
                         (prep, "_tokenize_shard")):
        monkeypatch.setattr(module, name, started)
    monkeypatch.setattr(prep.multiprocessing, "get_context", started)
    monkeypatch.setattr(launch, "_launch_local", lambda run, world: seen.append("train"))
    monkeypatch.setattr(eval_launch, "launch", lambda job: seen.append("eval") or [])
    return seen


def test_enough_safety_cases():
    assert len(SAFETY) >= 60 + 22 and len({c.name for c in SAFETY}) == len(SAFETY)


@pytest.mark.parametrize("case", SAFETY, ids=[c.name for c in SAFETY])
def test_data_safety(case, safety, tmp_path, monkeypatch, capsys, reached):
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
    before = [_stat_hashes(r, _HASH_CACHE) for r in roots]
    t0 = time.perf_counter()
    code = main(argv)
    elapsed = time.perf_counter() - t0
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == case.code, err
    assert "Traceback" not in err and elapsed < 10, (elapsed, err)
    if case.code:
        assert reached == [], "the workers' start was reached"
        assert len(lines) == 1 and lines[0].startswith(f"loongtrain {argv[0]}: error: "), err
        assert case.needle.format(**fill) in lines[0], (case.needle, err)
    else:
        assert reached == [argv[0]], "the run did not reach its workers"
        warned = [line for line in lines if "[rank 0]" in line or " loongtrain" not in line]
        assert len(warned) <= 1 and all(case.needle in line for line in warned) and (case.needle or not warned), err
        assert bool(case.needle) == bool(warned), err
    assert [_stat_hashes(r, _HASH_CACHE) for r in roots] == before, "a fixture file changed"


# -- the output lock, signals and a full disk, case by case


def test_output_lock_refuses_a_second_writer_and_takes_over_a_stale_one(tmp_path, monkeypatch, caplog):
    """A held lock refuses the next writer, naming the holder; a lock file left by a dead process is taken
    over (the kernel dropped its flock; without flock, its dead pid on this host decides)."""
    import socket

    from loongtrain import _files
    from loongtrain._files import LOCK_FILE, Output, OutputLock, lock_holder

    out = Output("prepare", "--out", ())
    fd = _hold_lock(tmp_path / "held", os.getppid(), "prepare")
    try:
        with pytest.raises(ValueError, match=rf"is in use by `loongtrain prepare` \(pid {os.getppid()} on host "):
            OutputLock(out, tmp_path / "held").__enter__()
        assert f"pid {os.getppid()}" in lock_holder(tmp_path / "held")
    finally:
        os.close(fd)
    assert lock_holder(tmp_path / "held") is None  # its holder is gone
    dead = subprocess.Popen(["true"])
    dead.wait()
    for flock in (True, False):
        if not flock:
            monkeypatch.setattr(_files, "fcntl", None)
        stale = tmp_path / f"stale{flock}"
        stale.mkdir()
        (stale / LOCK_FILE).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "command": "x"}))
        with caplog.at_level(logging.INFO, logger="loongtrain"):
            logging.getLogger("loongtrain").addHandler(caplog.handler)
            with OutputLock(out, stale):
                assert json.loads((stale / LOCK_FILE).read_text())["pid"] == os.getpid()
            logging.getLogger("loongtrain").removeHandler(caplog.handler)
        assert not (stale / LOCK_FILE).exists()
        assert f"taking over the lock of pid {dead.pid}" in caplog.text
    live = tmp_path / "live"  # without flock: a live pid on this host holds it
    live.mkdir()
    (live / LOCK_FILE).write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname(), "command": "eval"}))
    with pytest.raises(ValueError, match="is in use by `loongtrain eval`"):
        OutputLock(out, live).__enter__()


def test_two_prepares_into_one_directory(tmp_path, capsys):
    """While one prepare writes DIR, a second one into DIR (even with --overwrite) exits 2 naming it and
    removes nothing; the first one finishes whole."""
    from loongtrain.data import prepare as prep
    from loongtrain.data.prepared import verify_prepared

    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"doc {i} " * 20}) + "\n" for i in range(100)))
    out = tmp_path / "p"
    codes = []

    def second(k):
        if k == 1:  # the first prepare is between shards: its marker, its temporary shards, its lock
            before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
            codes.append(main(["prepare", str(corpus), "--out", str(out), "--workers", "1", "--overwrite"]))
            assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before

    prep.prepare([str(corpus)], out, workers=1, shard_bytes=300, on_shard=second)
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("loongtrain prepare:")]
    assert codes == [2] and len(err) == 1 and "is in use by `loongtrain prepare`" in err[0], err
    verify_prepared(out, full=True)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_prepare_interrupted_prints_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch, signum):
    """Ctrl-C (SIGINT) or SIGTERM in the middle of a prepare: one line, exit 130 or 143, no traceback, and
    the directory as it was before (here: absent)."""
    from loongtrain.data import prepare as prep

    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"doc {i} " * 20}) + "\n" for i in range(100)))
    real = prep._tokenize_shard

    def signalled(task):
        if task[0] == 2:
            os.kill(os.getpid(), signum)  # delivered to this (main) thread at once
        return real(task)

    monkeypatch.setattr(prep, "_tokenize_shard", signalled)
    code = main(["prepare", str(corpus), "--out", str(tmp_path / "p"), "--workers", "1", "--shard-bytes", "300"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 128 + signum and err[-1] == ("loongtrain prepare: " + (
        "interrupted" if signum == signal.SIGINT else "terminated (SIGTERM)")), err
    assert not any("Traceback" in line for line in err) and not (tmp_path / "p").exists()


@pytest.mark.parametrize("command", ["eval", "export", "plan", "train"])
def test_ctrl_c_is_one_line_for_every_command(command, files, tmp_path, capsys, monkeypatch):
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


def _full_disk_at(monkeypatch, name: str, keep: int = 10):
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


def test_a_full_disk_is_named_and_leaves_no_temporary_files(tmp_path, capsys, monkeypatch):
    """prepare on a full disk (in a shard, the index, the manifest): one line naming the file and "no
    space left", exit 1, no temporary file left; a previous prepared corpus stays whole."""
    from loongtrain.data.prepared import verify_prepared

    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"doc {i} " * 20}) + "\n" for i in range(100)))
    out = tmp_path / "p"
    for name in ("tokens-00002.bin", "documents.idx", "manifest.json"):
        with monkeypatch.context() as m:
            _full_disk_at(m, name)
            code = main(["prepare", str(corpus), "--out", str(out), "--workers", "1", "--shard-bytes", "3000"])
        err = capsys.readouterr().err.strip().splitlines()
        path = out / f".tmp-{os.getpid()}" / name
        assert code == 1 and err == [f"loongtrain prepare: failed: {path}: no space left on device"
                                     f"{err[0].split('no space left on device')[1]}"], err
        assert " MiB free there); free space or write elsewhere" in err[0] and not out.exists(), err
    assert main(["prepare", str(corpus), "--out", str(out), "--workers", "1"]) == 0
    corpus.write_text(corpus.read_text() + json.dumps({"text": "one more"}) + "\n")
    with monkeypatch.context() as m:
        _full_disk_at(m, "tokens-00000.bin")
        assert main(["prepare", str(corpus), "--out", str(out), "--workers", "1", "--overwrite"]) == 1
    capsys.readouterr()
    verify_prepared(out, full=True)  # the corpus of before, whole
    assert sorted(p.name for p in out.iterdir()) == [".loongtrain", "manifest.json", "shards"]


def test_a_full_disk_in_export_and_checkpoint_saves(files, tmp_path, capsys, monkeypatch):
    import errno

    from loongtrain._files import DiskFullError
    from loongtrain.train import checkpoint, export

    previous = tmp_path / "hf"
    assert main(["export", files["ckpt"], "--hf", str(previous)]) == 0
    before = _hashes(previous)

    def full(model, config, out):
        (out / "model.safetensors").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device", str(out / "model.safetensors"))

    monkeypatch.setattr(export, "export_hf", full)
    assert main(["export", files["ckpt"], "--hf", str(previous), "--overwrite"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.safetensors: no space left on device" in err[0], err
    assert _hashes(previous) == before and not list(tmp_path.glob(".hf.export-*"))
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint.dcp, "save", no_space)
    with pytest.raises(DiskFullError, match=r"step_00000001.tmp: no space left on device \(.* MiB free there\)"):
        checkpoint.save_checkpoint(tmp_path / "ck", 1, model, optimizer, scheduler, {})


def test_plan_nothing_fits_on_gpus_is_a_message_not_a_crash(capsys):
    """`plan --gpus N` when nothing fits: the table and why, exit 2 (the message took --nodes only)."""
    code = main(["plan", "--model", "13b", "--seq-len", "128K", "--gpus", "1", "--cluster", "a100", "--modes", "off"])
    out = capsys.readouterr()
    assert code == 2 and "Traceback" not in out.err
    assert out.err.startswith("loongtrain plan: nothing fits in memory: seq_len=131072 on gpus=1"), out.err


def test_prepare_of_empty_documents_and_decode_errors(tmp_path, capsys):
    """Documents that are all empty: exit 2 after reading them, the directory as before; prepare accepts
    the --decode-errors its UTF-8 message names."""
    (tmp_path / "e.jsonl").write_text('{"text": ""}\n' * 3)
    assert main(["prepare", str(tmp_path / "e.jsonl"), "--out", str(tmp_path / "p"), "--workers", "1"]) == 2
    assert "every one of the 3 documents" in capsys.readouterr().err and not (tmp_path / "p").exists()
    (tmp_path / "b.jsonl").write_bytes(b'{"text": "caf\xe9 au lait"}\n')
    assert main(["prepare", str(tmp_path / "b.jsonl"), "--out", str(tmp_path / "p"), "--workers", "1",
                 "--decode-errors", "replace"]) == 0
    from loongtrain.data.prepared import PreparedStream, read_manifest

    stream = PreparedStream(read_manifest(tmp_path / "p"), ByteTokenizer())
    assert bytes(stream.slice(0, len(stream)).tolist()) == "caf\ufffd au lait".encode() + b"\0"
