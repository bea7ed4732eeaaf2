"""Bad post-training input exits 2 before any worker starts, one line naming the value and the fix
(``--objective sft|dpo``, docs/post-training.md)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from loongtrain.commands import main as cli_main
from tests.helpers import chat_data

pytest.importorskip("transformers", reason="the hf extra is not installed (pip install -e '.[hf]')")


def _rows(path: Path, rows: list) -> str:
    return str(chat_data.write_rows(path, rows))


def _case(tmp: Path, case: str) -> tuple[list[str], str]:
    """(the command line's arguments after ``train``, the pattern its one error line must match)."""
    model = chat_data.make_model_dir(tmp / "m")
    chat = str(chat_data.write_conversations(tmp / "chat.jsonl", 4))
    base = ["--model", str(model), "--seq-len", "256", "--nproc", "4", "--out-dir", str(tmp / "out")]
    if case == "no messages":
        bad = _rows(tmp / "bad.jsonl", [{"messages": chat_data.conversation(0)}, {"text": "plain"}])
        return base + ["--objective", "sft", "--corpus", bad], rf"{re.escape(bad)}:2: no 'messages' list"
    if case == "unknown role":
        tok = chat_data.make_tokenizer(tmp / "two", chat_data.TWO_ROLES_TEMPLATE)
        return (base + ["--objective", "sft", "--corpus", chat, "--tokenizer", str(tok)],
                rf"{re.escape(chat)}:1: message 0 has role 'system', which the chat template does not render")
    if case == "no template":
        tok = chat_data.make_tokenizer(tmp / "plain", None)
        return (base + ["--objective", "sft", "--corpus", chat, "--tokenizer", str(tok)],
                r"has no chat template .*--chat-template FILE.*--loss-on all")
    if case == "all too long":
        return (base + ["--objective", "sft", "--corpus", chat, "--seq-len", "64"],
                r"every one of the 4 conversations is longer than --seq-len 64 .*raise --seq-len to at least \d+")
    if case == "one too long, --on-long error":
        rows = [{"messages": chat_data.conversation(i, 1 + 4 * (i == 2))} for i in range(4)]
        path = _rows(tmp / "long.jsonl", rows)
        return (base + ["--objective", "sft", "--corpus", path, "--on-long", "error"],
                r"conversation 2 \(counting from 0\) has \d+ tokens, more than --seq-len 256 .*--on-long drop")
    if case == "no target anywhere":  # no assistant turn in any row: every step would be skipped
        rows = [{"messages": chat_data.conversation(i)[:2]} for i in range(4)]
        path = _rows(tmp / "questions.jsonl", rows)
        return (base + ["--objective", "sft", "--corpus", path],
                rf"--corpus '{re.escape(path)}': no target token in any of 4 conversations")
    if case == "template syntax error":
        (tmp / "broken.jinja").write_text("{% for m in messages %}{{ m['content'] }\n{% endfor %}")
        return (base + ["--objective", "sft", "--corpus", chat, "--chat-template", str(tmp / "broken.jinja")],
                rf"--chat-template '{re.escape(str(tmp / 'broken.jinja'))}' is not a valid Jinja template: line 1")
    if case == "tools not a list":
        bad = _rows(tmp / "tools.jsonl", [{"messages": chat_data.conversation(0), "tools": {"name": "x"}}])
        return base + ["--objective", "sft", "--corpus", bad], rf"{re.escape(bad)}:1: 'tools' must be a list"
    if case == "content not text":
        bad = _rows(tmp / "image.jsonl", [{"messages": [{"role": "user", "content": [{"type": "image"}]}]}])
        return base + ["--objective", "sft", "--corpus", bad], rf"{re.escape(bad)}:1: messages\[0\]'s 'content'"
    pairs = str(chat_data.write_pairs(tmp / "pairs.jsonl", 4))
    dpo = base + ["--objective", "dpo"]
    if case == "pair without chosen":
        bad = _rows(tmp / "bad.jsonl", [chat_data.pair(0), {"prompt": "p", "rejected": "r"}])
        return dpo + ["--corpus", bad], rf"{re.escape(bad)}:2: a preference row needs 'prompt', 'chosen' and 'rejected'"
    if case == "dpo on plain text":
        (tmp / "text.txt").write_text("just text\n")
        return dpo + ["--corpus", str(tmp / "text.txt")], r"holds plain text .*--objective pretrain"
    if case == "dpo on text rows":
        text = _rows(tmp / "text.jsonl", [{"text": "just text"}])
        return dpo + ["--corpus", text], rf"{re.escape(text)}:1: a preference row needs .*--objective pretrain"
    if case == "implicit pair of the same texts":
        bad = _rows(tmp / "same.jsonl", [{"chosen": "Q? yes", "rejected": "Q? yes"}])
        return dpo + ["--corpus", bad], rf"{re.escape(bad)}:1: 'chosen' and 'rejected' are the same"
    if case == "ref model of another vocabulary":
        other = chat_data.make_model_dir(tmp / "wide", vocab_size=300)
        return (dpo + ["--corpus", pairs, "--ref-model", str(other)],
                r"--ref-model .*vocab_size=300, the policy's 259: the reference must have the policy's architecture")
    if case == "ref model of another architecture":
        other = chat_data.make_model_dir(tmp / "qwen", "Qwen2ForCausalLM", tie_word_embeddings=False)
        return (dpo + ["--corpus", pairs, "--ref-model", str(other)],
                r"--ref-model .* is a Qwen2ForCausalLM model, the policy a LlamaForCausalLM one")
    raise AssertionError(case)


CASES = ("no messages", "unknown role", "no template", "all too long", "one too long, --on-long error",
         "pair without chosen", "dpo on plain text", "dpo on text rows", "ref model of another vocabulary",
         "ref model of another architecture", "no target anywhere", "template syntax error", "tools not a list",
         "content not text", "implicit pair of the same texts")


@pytest.mark.parametrize("case", CASES)
def test_exits_2_before_any_worker(tmp_path, capsys, monkeypatch, case):
    from loongtrain.launch import train_run as launch

    def no_workers(*args, **kwargs):
        raise AssertionError("a worker was started")

    monkeypatch.setattr(launch, "run_local", no_workers)
    monkeypatch.setattr(launch, "run_worker", no_workers)
    args, pattern = _case(tmp_path, case)
    rc = cli_main(["train", *args])
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [line for line in err.splitlines() if line.startswith("loongtrain train: error")]
    assert len(lines) == 1 and re.search(pattern, lines[0]), err


def test_options_of_another_objective(capsys):
    for args, pattern in ((["--ref-model", "x"], r"--ref-model applies to --objective dpo"),
                          (["--objective", "sft", "--doc-mask", "off"], r"needs --doc-mask on and --position-reset"),
                          (["--objective", "dpo", "--loss-on", "all"], r"--loss-on applies to --objective sft"),
                          (["--objective", "rl"],
                           r"--objective='rl' is not one of \('pretrain', 'sft', 'dpo', 'grpo'\)"),
                          (["--objective", "dpo", "--dpo-beta", "0"], r"--dpo-beta=0.0 must be finite and > 0")):
        assert cli_main(["train", *args]) == 2
        assert re.search(pattern, capsys.readouterr().err)


def test_prepared_corpus_of_another_objective(tmp_path, capsys):
    model = chat_data.make_model_dir(tmp_path / "m")
    chat = chat_data.write_conversations(tmp_path / "chat.jsonl", 4)
    assert cli_main(["prepare", str(chat), "--objective", "sft", "--tokenizer", str(model),
                     "--out", str(tmp_path / "prep"), "--workers", "1"]) == 0
    text = tmp_path / "text.txt"
    text.write_text("x" * 2000)
    assert cli_main(["prepare", str(text), "--tokenizer", str(model), "--out", str(tmp_path / "text"),
                     "--workers", "1"]) == 0
    capsys.readouterr()
    common = ["--model", str(model), "--seq-len", "256", "--nproc", "1", "--hp", "1", "--cp", "1"]
    assert cli_main(["train", *common, "--corpus", str(tmp_path / "prep"), "--out-dir", str(tmp_path / "o1")]) == 2
    assert "was prepared for --objective sft" in capsys.readouterr().err
    assert cli_main(["train", *common, "--objective", "sft", "--corpus", str(tmp_path / "text"),
                     "--out-dir", str(tmp_path / "o2")]) == 2
    assert "prepare it again with `loongtrain prepare --objective sft`" in capsys.readouterr().err
    other = tmp_path / "template.jinja"
    other.write_text(chat_data.ROLE_TEMPLATE)
    assert cli_main(["train", *common, "--objective", "sft", "--corpus", str(tmp_path / "prep"), "--chat-template",
                     str(other), "--out-dir", str(tmp_path / "o3")]) == 2
    assert json.loads((tmp_path / "prep" / "manifest.json").read_text())["chat"]["rule"] == "generation"
    assert "prepared with chat format" in capsys.readouterr().err
