"""Bad inputs a new user writes: files that parse but say the wrong thing, outputs that would
destroy files, bytes that are not text, usage and TOML errors of every subcommand. Each one exits 2
before any worker starts (within 10 s), with one line on stderr naming the file or option, no
traceback, and every file of the fixture untouched (hashed before and after).

Most cases run ``loongtrain.cli.main(argv)`` in this process with the worker starters replaced by a
function that fails the test; a few run the real command in a subprocess. The rest: the units behind
them (cu_seqlens, the restart rule, SIGTERM, the per-call agreement of attention arguments)."""

from __future__ import annotations

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

from loongtrain.cli import SUBCOMMANDS, main
from tests.test_faults import _workers
from tests.test_hf_train import make_hf_dir

ROOT = Path(__file__).resolve().parents[1]
BASE = ["--nproc", "1", "--hp", "1", "--cp", "1", "--seq-len", "16", "--steps", "2", "--warmup", "1",
        "--progress", "off", "--peak-tflops", "1", "--no-tensorboard", "--no-plot", "--threads", "1",
        "--no-memory-report"]


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
    ([*EXPORT, "--hf", D + "/hf_out"], "exists and is not empty; pass --overwrite"),
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
    ([*PLAN, "--batch", "-1"], "--batch-size=-1 must be >= 1"),
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
    ([*TRAIN, "--plan", "auto", "--plan-cluster", D + "/cluster_frac.toml"], "gpus_per_node = 7.5 must be of type int"),
    (["plan", "--config", D + "/plan_frac.toml"], "plan_frac.toml': nodes = 1.5 must be of type int"),
    (["plan", "--config", D + "/plan_model.toml"], "plan_model.toml': [model]: dim = 'big' must be of type int"),
    (["plan", "--config", D + "/plan_unknown.toml"], "plan_unknown.toml': unknown keys ['bogus']"),
    (["plan", "--config", D + "/plan_bad.toml"], "plan_bad.toml' is not valid TOML"),
    (["plan", "--config", D + "/missing.toml"], "missing.toml' does not exist"),
    (["plan", "--calibrate", "--out", D], "is a directory; name the cluster TOML file"),
    (["plan", "--calibrate", "--out", D + "/no/such/dir/c.toml"], "does not exist"),
    (["plan", "--calibrate", "--calibrate-world", "0"], "--calibrate-world=0 must be >= 1"),
    (["export", "{ckpt}"], "the following arguments are required: --hf"),
    ([*EXPORT, "--hf", D + "/x", "--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    ([*EXPORT, "--hf", D + "/x", "--bogus"], "unrecognized arguments: --bogus"),
    (["export", D + "/nowhere", "--hf", D + "/x"], "is not a loongtrain checkpoint"),
    (["fly"], f"unknown command 'fly'; choose one of {list(SUBCOMMANDS)}"),
    ([], f"no command; choose one of {list(SUBCOMMANDS)}"),
]

PREFIX = {"train": "loongtrain train: error: ", "plan": "loongtrain plan: error: ",
          "export": "loongtrain export: error: ", "fly": "loongtrain: unknown command", "": "loongtrain: error: "}


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
    """--overwrite: the old files are gone (a stray shard would stop the result from loading), and the
    result loads with transformers."""
    import transformers

    out = tmp_path / "hf"
    out.mkdir()
    for name in ("model-00002-of-00002.safetensors", "tokenizer.json", "model.safetensors"):
        (out / name).write_text("old")
    assert main(["export", files["ckpt"], "--hf", str(out), "--overwrite"]) == 0, capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
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
    assert err[-1] == "loongtrain train: training failed: rank 1 of 2: OSError: [Errno 28] No space left on device"
    assert not any("Traceback" in line for line in err), err


@pytest.mark.distributed  # starts processes
@pytest.mark.parametrize("argv, needle", [
    ([*TRAIN, "--model", D + "/hf_minimal", "--nproc", "2", "--hp", "2"], "does not state"),
    ([*PLAN, "--cluster", D + "/cluster_frac.toml"], "gpus_per_node = 7.5"),
])
def test_bad_input_in_a_subprocess(argv, needle, files):
    argv = _fill(argv, files)
    if argv[0] == "train":
        argv += ["--corpus", files["corpus"], "--out-dir", str(Path(files["dir"], "out"))]
    before = _hashes(Path(files["dir"]))
    # the time bound is the in-process table's; here interpreter start and imports dominate (~3 s on
    # quiet cores, over 30 s measured on the shared 2-core machine), so only the timeout bounds it
    proc = subprocess.run([sys.executable, "-m", "loongtrain.cli", *argv], cwd=ROOT, capture_output=True, text=True,
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
        seen.extend(_workers(os.getpid()).values())
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
    assert not _workers(os.getpid()), "a worker outlived the launcher"
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
