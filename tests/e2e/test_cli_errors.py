"""Bad command lines of ``loongtrain train``: each one exits 2 before any worker starts, with one message that
names the offending value, no traceback, and nothing left running or changed; an argument error answers before
any heavy import (no torch: what makes it fast, checked on the imports, not on a clock).

Most cases run ``main()`` in this process (fast); a few run the real command in a subprocess."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from loongtrain.commands import main

ROOT = Path(__file__).resolve().parents[2]
BASE = ["--nproc", "1", "--hp", "1", "--cp", "1", "--seq-len", "16", "--steps", "2", "--warmup", "1",
        "--progress", "off", "--peak-tflops", "1", "--no-tensorboard", "--no-plot", "--threads", "1",
        "--no-memory-report"]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """Corpora good and bad, config files, and a finished 2-step run (plus corrupt copies of it)."""
    d = tmp_path_factory.mktemp("cli_errors")
    (d / "corpus.txt").write_text("".join(f"line {i}: the quick brown fox\n" for i in range(50)))
    (d / "other.txt").write_text("".join(f"another corpus, line {i}\n" for i in range(50)))
    (d / "empty.txt").write_text("")
    (d / "short.txt").write_text("tiny")
    (d / "nofield.jsonl").write_text('{"body": "x"}\n')
    (d / "invalid.jsonl").write_text('{"text": "fine"}\n{not json\n')
    late = [f'{{"text": "doc {i} with some words"}}' for i in range(49)] + ["{broken"]
    (d / "late.jsonl").write_text("\n".join(late) + "\n")
    (d / "notext.jsonl").write_text('{"text": 3}\n')
    (d / "data.csv").write_text("a,b\n")
    (d / "emptydir").mkdir()
    (d / "afile").write_text("x")
    (d / "bad.toml").write_text("lr = [unclosed\n")
    (d / "unknown.toml").write_text("learning_rate = 0.1\n")
    (d / "wrongtype.toml").write_text('steps = "ten"\n')
    _prepared_dirs(d)
    run = d / "run"
    corpus = str(d / "corpus.txt")
    assert main(["train", *BASE, "--corpus", corpus, "--out-dir", str(run)]) == 0
    ckpt = run / "checkpoints" / "step_00000002"
    for name, damage in [("badstate", lambda c: (c / "trainer_state.json").write_text("{oops")),
                         ("truncated", lambda c: _truncate(next(c.glob("*.distcp")))),
                         ("nometa", lambda c: (c / ".metadata").unlink()),
                         ("badmeta", lambda c: (c / ".metadata").write_bytes(b"garbage")),
                         ("norng", lambda c: (c / "rng_rank0.pt").unlink())]:
        copy = d / name / "checkpoints" / "step_00000002"
        shutil.copytree(ckpt, copy)
        (copy.parent / "latest").write_text("step_00000002\n")
        damage(copy)
    return {"dir": str(d), "corpus": corpus, "run": str(run)}


def _prepared_dirs(d: Path) -> None:
    """Prepared corpora (loongtrain prepare): good, and damaged copies; a tokenizer that is not byte."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from loongtrain.data.prepare import prepare

    prepare([str(d / "corpus.txt")], d / "prep", workers=1)
    for name in ("prep_trunc", "prep_corrupt", "prep_newer", "prep_partial"):
        shutil.copytree(d / "prep", d / name)
    _truncate(d / "prep_trunc" / "shards" / "tokens-00000.bin")
    shard = d / "prep_corrupt" / "shards" / "tokens-00000.bin"
    shard.write_bytes(b"\xff" + shard.read_bytes()[1:])
    manifest = json.loads((d / "prep" / "manifest.json").read_text())
    (d / "prep_newer" / "manifest.json").write_text(json.dumps({**manifest, "version": 99}))
    (d / "prep_partial" / "manifest.json").unlink()
    (d / "prep_partial" / ".prepare-in-progress").write_text("{}")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["the quick brown fox"] * 5, trainers.BpeTrainer(
        vocab_size=270, special_tokens=["<unk>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(d / "tok.json"))


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


D = "{dir}"
RUN = ["--corpus", "{corpus}", "--out-dir", "{run}", "--resume", "latest", "--steps", "10"]
# (arguments after BASE, text the message must contain); {dir}, {corpus}, {run} are filled in
CASES = [
    # parsing and ranges
    (["--no-such-option", "3"], "--no-such-option"),
    (["--lr", "abc"], "argument --lr: invalid float value: 'abc'"),
    (["--steps", "1.5"], "argument --steps: invalid int value: '1.5'"),
    (["--seq-len", "x"], "argument --seq-len: seq_len='x' is not a length like 131072, 128K or 1M"),
    (["--lr", "nan"], "--lr=nan"),
    (["--lr", "inf"], "--lr=inf"),
    (["--lr", "-1"], "--lr=-1"),
    (["--lr", "0"], "--lr=0"),
    (["--beta1", "1.5"], "--beta1=1.5"),
    (["--beta1", "-0.1"], "--beta1=-0.1"),
    (["--beta2", "1.0"], "--beta2=1.0"),
    (["--beta2", "nan"], "--beta2=nan"),
    (["--eps", "-1"], "--eps=-1"),
    (["--eps", "0"], "--eps=0"),
    (["--eps", "inf"], "--eps=inf"),
    (["--weight-decay", "-0.1"], "--weight-decay=-0.1"),
    (["--weight-decay", "nan"], "--weight-decay=nan"),
    (["--clip", "-1"], "--clip=-1"),
    (["--clip", "inf"], "--clip=inf"),
    (["--min-lr-ratio", "1.5"], "--min-lr-ratio=1.5"),
    (["--min-lr-ratio", "nan"], "--min-lr-ratio=nan"),
    (["--peak-tflops", "-1"], "--peak-tflops=-1"),
    (["--timeout", "0"], "--timeout=0"),
    (["--timeout", "-5"], "--timeout=-5"),
    (["--timeout", "inf"], "--timeout=inf"),
    (["--heartbeat-timeout", "0"], "--heartbeat-timeout=0"),
    (["--max-bad-steps", "-1"], "--max-bad-steps=-1"),
    (["--max-restarts", "-1"], "--max-restarts=-1"),
    (["--steps", "0"], "--steps=0"),
    (["--steps", "-1"], "--steps=-1"),
    (["--seq-len", "0"], "--seq-len=0"),
    (["--batch-size", "0"], "--batch-size=0"),
    (["--grad-accum", "0"], "--grad-accum=0"),
    (["--warmup", "-1"], "--warmup=-1"),
    (["--log-interval", "0"], "--log-interval=0"),
    (["--keep-checkpoints", "-1"], "--keep-checkpoints=-1"),
    (["--ckpt-interval", "-1"], "--ckpt-interval=-1"),
    (["--stop-after", "-1"], "--stop-after=-1"),
    (["--threads", "-1"], "--threads=-1"),
    (["--nproc", "-1"], "--nproc=-1"),
    (["--dtype", "fp8"], "fp8"),
    (["--progress", "maybe"], "maybe"),
    (["--chunk-order", "spiral"], "--chunk-order='spiral'"),
    (["--chunk-order", "balanced", "--doc-mask", "off"], "needs --doc-mask on"),
    (["--model", "huge"], "huge"),
    (["--zero", "half"], "half"),
    (["--placement", "diagonal"], "diagonal"),
    (["--hp", "2", "--cp", "2", "--nproc", "4", "--inner-ring", "3"], "inner_ring=3"),
    (["--nproc", "3", "--hp", "2"], "3"),
    (["--nproc", "4", "--hp", "2", "--cp", "2", "--seq-len", "100"], "100"),
    (["--nproc", "8", "--hp", "8"], "hp=8"),
    (["--mlp-tiles", "0"], "mlp_tiles='0'"),
    (["--mlp-tiles", "3"], "mlp_tiles=3 must divide the 16 local tokens"),
    (["--nproc", "4", "--hp", "2", "--cp", "2", "--seq-len", "32", "--mlp-tiles", "16"], "mlp_tiles=16"),
    (["--offload-activations"], "--recompute none"),
    (["--offload-params"], "needs --zero full or hybrid; got --zero none"),
    (["--config", D + "/missing.toml"], "missing.toml"),
    (["--config", D + "/bad.toml"], "bad.toml"),
    (["--config", D + "/unknown.toml"], "learning_rate"),
    (["--config", D + "/wrongtype.toml"], "ten"),
    # corpus and tokenizer
    (["--corpus", D + "/nowhere.txt"], "nowhere.txt"),
    (["--corpus", D + "/empty.txt"], "empty"),
    (["--corpus", D + "/short.txt"], "holds 5 tokens"),
    (["--corpus", D + "/nofield.jsonl"], "'text'"),
    (["--corpus", D + "/notext.jsonl"], "notext.jsonl:1"),
    (["--corpus", D + "/invalid.jsonl"], "invalid.jsonl:2: invalid JSON"),
    (["--corpus", D + "/late.jsonl"], "late.jsonl:50: invalid JSON"),
    (["--corpus", D + "/data.csv"], "data.csv"),
    (["--corpus", D + "/emptydir"], "emptydir"),
    (["--corpus", "{corpus}", "--tokenizer", D + "/no_tokenizer"], "no_tokenizer"),
    # prepared corpora, mixtures, validation split
    (["--corpus", D + "/prep", "--tokenizer", D + "/tok.json"], "prep/manifest.json: prepared with tokenizer 'byte'"),
    (["--corpus", D + "/prep_trunc"], "prep_trunc/shards/tokens-00000.bin: truncated or grown"),
    (["--corpus", D + "/prep_corrupt"], "prep_corrupt/shards/tokens-00000.bin: corrupted"),
    (["--corpus", D + "/prep_newer"], "prep_newer/manifest.json: format version 99 is newer"),
    (["--corpus", D + "/prep_partial"], "interrupted `loongtrain prepare`"),
    (["--corpus", "{corpus}=x," + D + "/other.txt=1"], "weight 'x' of"),
    (["--corpus", "{corpus}=-1," + D + "/other.txt=1"], "must be finite and >= 0"),
    (["--corpus", "{corpus}=0," + D + "/other.txt=0"], "at least one weight must be positive"),
    (["--corpus", D + "/prep=0.5," + D + "/invalid.jsonl=0.5"], "invalid.jsonl:2: invalid JSON"),
    (["--corpus", D + "/prep=0.5," + D + "/prep_corrupt=0.5"], "tokens-00000.bin: corrupted"),
    (["--val-fraction", "1.5"], "--val-fraction=1.5 must be in (0, 1)"),
    (["--val-fraction", "-0.1"], "--val-fraction=-0.1"),
    (["--val-fraction", "1"], "--val-fraction=1.0"),
    (["--val-fraction", "nan"], "--val-fraction=nan"),
    (["--val-fraction", "0.1", "--val-corpus", "{corpus}"], "give one of them"),
    (["--val-corpus", D + "/invalid.jsonl"], "--val-corpus '{dir}/invalid.jsonl': {dir}/invalid.jsonl:2: invalid JSON"),
    # output directory and resume
    (["--corpus", "{corpus}", "--out-dir", D + "/afile"], "is a file"),
    (["--corpus", "{corpus}", "--out-dir", D + "/afile/sub"], "is a file"),
    (["--corpus", "{corpus}", "--out-dir", "{run}"], "--resume auto"),
    (["--corpus", "{corpus}", "--out-dir", D + "/fresh", "--resume"], "no complete checkpoint"),
    (["--corpus", "{corpus}", "--out-dir", D + "/fresh", "--resume", D + "/nowhere"], "nowhere"),
    ([*RUN[:-1], "2"], "already at step 2"),
    ([*RUN, "--seed", "1"], "--seed=1"),
    ([*RUN, "--seq-len", "32"], "--seq-len=32"),
    ([*RUN, "--batch-size", "2"], "global batch"),
    ([*RUN, "--grad-accum", "2"], "--grad-accum=2"),
    ([*RUN, "--lr", "0.001"], "--lr=0.001"),
    ([*RUN, "--val-fraction", "0.5"], "--val-fraction=0.5"),
    ([*RUN, "--model", "1b"], "--model='1b'"),
    ([*RUN[2:], "--corpus", D + "/other.txt"], "other.txt' differs from the checkpoint's"),
    ([*RUN[2:], "--corpus", "{corpus}", "--out-dir", D + "/badstate"], "trainer_state.json"),
    ([*RUN[2:], "--corpus", "{corpus}", "--out-dir", D + "/truncated"], ".distcp"),
    ([*RUN[2:], "--corpus", "{corpus}", "--out-dir", D + "/nometa"], ".metadata"),
    ([*RUN[2:], "--corpus", "{corpus}", "--out-dir", D + "/badmeta"], ".metadata"),
    ([*RUN[2:], "--corpus", "{corpus}", "--out-dir", D + "/norng"], "rng_rank0.pt"),
]


def _children() -> set[int]:
    me = str(os.getpid())
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if stat.rsplit(")", 1)[1].split()[1] == me:
                found.add(int(entry))
    return found


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}


def _fill(args: list[str], files: dict[str, str]) -> list[str]:
    return [a.format(**files) for a in args]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("args, needle", CASES, ids=[" ".join(a)[-60:] for a, _ in CASES])
def test_bad_input_exits_2_with_a_message(args, needle, files, capsys):
    args, needle = _fill(args, files), needle.format(**files)
    if "--corpus" not in args:
        args = ["--corpus", files["corpus"], *args]
    if "--out-dir" not in args:
        args = ["--out-dir", str(Path(files["dir"], "out")), *args]
    run_before = _snapshot(Path(files["run"]))
    children = _children()
    code = main(["train", *BASE, *args])
    err = capsys.readouterr().err
    assert code == 2, err
    assert needle in err, (needle, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert _children() <= children, "a process was left behind"
    assert _snapshot(Path(files["run"])) == run_before, "the run directory changed"


@pytest.mark.distributed  # starts processes
@pytest.mark.parametrize("args, needle", [
    # one case through the real entry point (the in-process table above has this row and the others; each
    # subprocess costs an interpreter start and the imports); tests/e2e/test_bad_inputs.py runs `plan` this way
    (["--corpus", "{corpus}", "--out-dir", "{run}"], "--overwrite"),
])
def test_bad_input_in_a_subprocess(args, needle, files):
    args = _fill(args, files)
    if "--corpus" not in args:
        args = ["--corpus", files["corpus"], *args]
    proc = subprocess.run([sys.executable, "-m", "loongtrain.commands", "train", *BASE, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    # one line and nothing else: no start-up log, so nothing ran before the check (a bound on seconds
    # would measure the machine's load, not the order of the checks)
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_ctrl_c_after_the_command_ended_is_not_a_traceback():
    """The console script (commands.cli): a Ctrl-C that arrives while the interpreter exits, after the command's
    last line (here sent from an exit hook, where torch's finalizers run), neither prints a traceback nor turns
    the finished command's exit code into an interrupt's."""
    code = ("import atexit, os, signal\n"
            "import loongtrain.commands as commands\n"
            "commands.main = lambda: print('done') or 3\n"
            "atexit.register(lambda: os.kill(os.getpid(), signal.SIGINT))\n"
            "atexit.register(lambda: __import__('time').sleep(0.2))\n"
            "commands.cli()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert (done.returncode, done.stdout, done.stderr) == (3, "done\n", ""), done


FAST = [(["train", "--hp", "two"], "argument --hp: invalid int value: 'two'"),
        (["train", "--no-such-option"], "unrecognized arguments: --no-such-option"),
        (["train", "--steps", "-1"], "--steps=-1 must be a positive integer"),
        (["train", "--objective", "dpo", "--loss-on", "all"], "--loss-on applies to --objective sft, not"),
        (["export", "ckpt", "--dtype", "int8"], "argument --dtype: invalid choice: 'int8'")]


def test_an_argument_error_answers_before_torch_is_imported():
    """The fast error path: the options are declared apart from the code that runs them (sections, the
    objectives' options: loongtrain/objectives/options.py), so an argument error is one line and exit 2 with torch
    never imported; ``--help`` too, and it names the tested families. One interpreter per command line (a
    subprocess: the test process has torch already)."""
    from loongtrain.hf.families import SUPPORTED_ARCHITECTURES

    script = ("import sys\nfrom loongtrain.commands import main\ncode = main(sys.argv[1:])\n"
              "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', code)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for argv, needle in [*FAST, (["train", "--help"], "")]:
        done = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, env=env,
                              timeout=300, cwd=str(ROOT))
        verdict = done.stdout.strip().splitlines()[-1]
        assert verdict == f"NO-TORCH {0 if needle == '' else 2}", (argv, verdict, done.stderr[-2000:])
        if needle:
            assert done.stderr.count("\n") == 1 and needle in done.stderr, (argv, done.stderr)
        else:
            text = " ".join(done.stdout.split())
            assert all(arch.removesuffix("ForCausalLM") in text for arch in SUPPORTED_ARCHITECTURES), text
