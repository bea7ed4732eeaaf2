"""``loongtrain eval`` in one process: position buckets, the per-token loss, passkey prompts and scoring (a
perfect retriever scores 100%, a random model at chance), and the bad inputs that exit 2 before any worker."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from loongtrain.commands import eval as cli
from loongtrain.data import ByteTokenizer
from loongtrain.eval.passkey import (
    NEEDLE_PREFIX,
    build_prompt,
    digit_ids,
    draw_key,
    passkey,
    passkey_tokens,
)
from loongtrain.eval.position_loss import bucket_edges, bucket_sums, position_loss
from loongtrain.loss.chunked import chunked_token_losses
from loongtrain.model.config import ModelConfig
from loongtrain.model.llama import Transformer
from loongtrain.parallel.mesh import single_process_mesh

CPU = torch.device("cpu")
SMALL = ModelConfig(vocab_size=256, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=64)


def test_bucket_edges_are_powers_of_two_up_to_the_length():
    assert bucket_edges(8192) == [0, 1024, 2048, 4096, 8192]
    assert bucket_edges(65536) == [0, 1024, 2048, 4096, 8192, 16384, 32768, 65536]
    assert bucket_edges(4096) == [0, 512, 1024, 2048, 4096]  # short: a smaller first bucket
    assert bucket_edges(6000) == [0, 512, 1024, 2048, 4096, 6000]
    assert bucket_edges(256) == [0, 32, 64, 128, 256]


def test_bucket_sums_match_a_loop():
    gen = torch.Generator().manual_seed(0)
    losses = torch.rand(3, 50, generator=gen, dtype=torch.float64)
    positions = torch.randint(0, 256, (3, 50), generator=gen)
    valid = torch.rand(3, 50, generator=gen) > 0.2
    edges = bucket_edges(256)
    sums = bucket_sums(losses, positions, valid, edges)
    for b, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
        inside = valid & (positions >= lo) & (positions < hi)
        assert sums[0, b].item() == pytest.approx(losses[inside].sum().item(), rel=1e-12)
        assert sums[1, b].item() == inside.sum().item()


def test_token_losses_equal_cross_entropy_and_argmax():
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 37, 8, generator=gen, dtype=torch.float64)
    weight = torch.randn(11, 8, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 11, (2, 37), generator=gen)
    labels[0, 3] = -100
    losses, argmax = chunked_token_losses(hidden, weight, labels, chunk_tokens=5)
    logits = hidden @ weight.T
    want = F.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1), reduction="none").reshape(2, 37)
    torch.testing.assert_close(losses, want, rtol=1e-12, atol=1e-12)
    assert torch.equal(argmax, logits.argmax(-1))


def test_prompt_hides_the_key_at_its_depth_and_asks_for_it():
    tok = ByteTokenizer()
    tokens = passkey_tokens(tok)
    key = draw_key(0, 512, 2, 1, 5)
    assert key == draw_key(0, 512, 2, 1, 5) and key != draw_key(0, 512, 2, 2, 5)
    for depth in (0.0, 0.5, 1.0):
        batch = build_prompt(tokens, 512, depth, key)
        assert batch["input_ids"].shape == batch["labels"].shape == (1, 512)
        text = tok.decode(batch["input_ids"][0])
        digits = "".join(map(str, key))
        assert text.count(NEEDLE_PREFIX + digits) == 1
        where = text.index(NEEDLE_PREFIX) / (512 - tokens.overhead(5))
        assert abs(where - depth) < 0.05, (depth, where)
        assert tok.decode(batch["labels"][0, batch["answer"]]) == digits  # the answer is the key
        assert torch.equal(batch["input_ids"][0, 1:], batch["labels"][0, :-1])


def test_digits_must_be_single_tokens(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from loongtrain.data import HFTokenizer

    vocab = {"<unk>": 0, "</s>": 1, **{w: i + 2 for i, w in enumerate("The pass key is".split())}}
    hf = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="cannot encode the key's digit '0'"):
        digit_ids(HFTokenizer(tmp_path / "tokenizer.json"))
    digits = {str(d): 100 + d for d in range(10)}
    hf = Tokenizer(models.WordLevel({**vocab, **digits}, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.save(str(tmp_path / "tokenizer.json"))
    assert digit_ids(HFTokenizer(tmp_path / "tokenizer.json")) == tuple(range(100, 110))


class Retriever(nn.Module):
    """Copies the key: after the question, predicts the token that followed the needle's prefix, digit by
    digit (one-hot hidden states through an identity head). A model that retrieves perfectly."""

    def __init__(self, prefix: list[int], question: list[int], vocab: int) -> None:
        super().__init__()
        self.prefix, self.question, self.vocab = prefix, question, vocab
        self.layers = nn.ModuleList()

    def head_weight(self) -> torch.Tensor:
        return torch.eye(self.vocab, dtype=torch.float64)

    def forward(self, input_ids, position_ids, return_hidden=True, **_):
        return torch.stack([self._row(row.tolist()) for row in input_ids])

    def _row(self, ids: list[int]) -> torch.Tensor:
        key_at = _find(ids, self.prefix) + len(self.prefix)
        asked = _find(ids, self.question, last=True) + len(self.question)
        target = torch.zeros(len(ids), dtype=torch.int64)
        for t in range(asked - 1, len(ids)):  # the token at t predicts t + 1
            target[t] = ids[key_at + t - (asked - 1)]
        return F.one_hot(target, self.vocab).to(torch.float64)


def _find(ids: list[int], pattern: list[int], last: bool = False) -> int:
    hits = [i for i in range(len(ids) - len(pattern) + 1) if ids[i:i + len(pattern)] == pattern]
    return hits[-1] if last else hits[0]


def test_passkey_tells_a_retriever_from_a_random_model():
    tokens = passkey_tokens(ByteTokenizer())
    lengths, depths = (256, 512), (0.0, 0.5, 1.0)
    oracle = Retriever(list(tokens.prefix), list(tokens.question), 256)
    cells = passkey(oracle, tokens, lengths, depths, 3, single_process_mesh(), CPU)
    assert len(cells) == 6 and all(c["correct"] == c["trials"] == 3 for c in cells)
    assert all(c["digits_correct"] == c["digits"] == 15 for c in cells)
    random_model = Transformer(SMALL, seed=0).double()
    cells = passkey(random_model, tokens, lengths, depths, 3, single_process_mesh(), CPU)
    # chance: a 5-digit key is right with probability 1e-5 per trial, a digit 1/10
    assert sum(c["correct"] for c in cells) == 0
    assert sum(c["digits_correct"] for c in cells) <= 0.3 * sum(c["digits"] for c in cells)


def test_trials_batched_by_length_score_as_one_prompt_a_forward():
    """Lengths 96 and 192: two 96-token prompts share a forward; the cells equal those of each length alone
    (one prompt a forward)."""
    tokens = passkey_tokens(ByteTokenizer())
    model = Transformer(SMALL, seed=0).double()
    with torch.no_grad():  # mostly the identity (tied head): some digits right, some wrong
        for name, p in model.named_parameters():
            if name.endswith(("wo.weight", "w2.weight")):
                p.mul_(0.05)
    depths = (0.0, 0.5, 1.0)
    batched = passkey(model, tokens, (96, 192), depths, 3, single_process_mesh(), CPU, seed=1)
    alone = [c for n in (96, 192) for c in passkey(model, tokens, (n,), depths, 3, single_process_mesh(), CPU, seed=1)]
    assert batched == alone
    assert 0 < sum(c["digits_correct"] for c in alone) < sum(c["digits"] for c in alone)


def test_replica_batches_split_items_evenly_over_replicas():
    from types import SimpleNamespace

    from loongtrain.eval.forward import replica_batches

    items = list(range(5))
    assert replica_batches(items, 2, SimpleNamespace(dp=1, dp_rank=0)) == [[0, 1], [2, 3], [4]]
    assert replica_batches(items, 2, SimpleNamespace(dp=2, dp_rank=0)) == [[0, 2], [4]]
    assert replica_batches(items, 2, SimpleNamespace(dp=2, dp_rank=1)) == [[1, 3], []]  # a padding forward
    assert replica_batches(items[:1], 4, SimpleNamespace(dp=2, dp_rank=1)) == [[]]
    with pytest.raises(ValueError, match="rows=0"):
        replica_batches(items, 0, SimpleNamespace(dp=1, dp_rank=0))


def test_position_loss_is_the_mean_of_each_bucket():
    model = Transformer(SMALL, seed=0).double()
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 256, (2, 65), generator=gen)
    batches = [{"input_ids": ids[i:i + 1, :-1], "labels": ids[i:i + 1, 1:],
                "position_ids": torch.arange(64)[None]} for i in range(2)]
    rows = position_loss(model, batches, single_process_mesh(), CPU, 64)
    with torch.no_grad():
        logits = model(ids[:, :-1], torch.arange(64).expand(2, 64))
    per_token = F.cross_entropy(logits.reshape(-1, 256), ids[:, 1:].reshape(-1), reduction="none").reshape(2, 64)
    assert [(r["start"], r["end"]) for r in rows] == [(0, 8), (8, 16), (16, 32), (32, 64)]
    for r in rows:
        assert r["tokens"] == 2 * (r["end"] - r["start"])
        assert r["loss"] == pytest.approx(per_token[:, r["start"]:r["end"]].mean().item(), rel=1e-10)


# --------------------------------------------------------------------------------------------------
# The command line: outputs, and bad input (exit 2, one line, no worker started)

@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A one-step training run of a small model (byte tokenizer), checkpointed."""
    from loongtrain.launch.config import TrainConfig
    from loongtrain.parallel.config import ParallelConfig
    from tests.helpers.training import fit

    root = tmp_path_factory.mktemp("eval_run")
    corpus = root / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    cfg = TrainConfig.from_dict(dict(corpus=str(corpus), seq_len=64, steps=1, warmup=0, parallel=ParallelConfig(),
                      out_dir=str(root / "run"), peak_tflops=1.0, tensorboard=False, plot=False, progress="off",
                      memory_report=False))
    fit(cfg, single_process_mesh(), CPU, model_config=SMALL)
    return root


def _no_workers(monkeypatch):
    import loongtrain.launch.eval_run as launch

    monkeypatch.setattr(launch, "launch", lambda job: pytest.fail("a worker was started"))


@pytest.mark.parametrize("case, args, message", [
    ("model", ["{root}/nothing"], r"MODEL '.*nothing' is none of: run directory"),
    ("lengths", ["{run}", "--hp", "2", "--cp", "2", "--nproc", "4", "--lengths", "64,100"],
     r"length 100: sequence length 100 must be divisible by 2\*cp\*hp = 2\*2\*2 = 8"),
    ("depths", ["{run}", "--depths", "0,1.5"], r"--depths \[1.5\]: every depth must be in \[0, 1\]"),
    ("digits", ["{run}", "--tokenizer", "{root}/tok.json"], r"cannot encode the key's digit '0'"),
    ("corpus", ["{run}", "--task", "position-loss", "--seq-len", "4096"],
     r"eval corpus '.*corpus.txt' \(--seq-len 4096\): corpus .* holds \d+ tokens: 4 sequence\(s\) of 4096"),
    ("filler", ["{run}", "--filler", "corpus", "--lengths", "4K"],
     r"eval corpus .*\(length 4096\): .* holds \d+ tokens"),
])
def test_bad_input_exits_2_before_any_worker(run_dir, monkeypatch, capsys, case, args, message):
    if case == "digits":
        from tokenizers import Tokenizer, models

        Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1}, unk_token="<unk>")).save(str(run_dir / "tok.json"))
    _no_workers(monkeypatch)
    argv = [a.format(root=run_dir, run=run_dir / "run") for a in args]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("loongtrain eval: error: ")
    import re

    assert re.search(message, err), err


def test_eval_writes_results_and_warns_past_the_trained_length(run_dir, caplog):
    import logging

    out = run_dir / "pk"
    logger = logging.getLogger("loongtrain")  # the CLI's logging set-up stops propagation to the root's handler
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level("WARNING", logger="loongtrain"):
            assert cli.main([str(run_dir / "run"), "--lengths", "128,256", "--depths", "0,1", "--trials", "1",
                             "--nproc", "1", "--threads", "1", "--out", str(out)]) == 0
    finally:
        logger.removeHandler(caplog.handler)
    warned = [r.getMessage() for r in caplog.records if "past the model" in r.getMessage()]
    assert warned == ["length 256 is past the model's trained --seq-len 64: measuring beyond the trained length"]
    cells = json.loads((out / "results.json").read_text())
    assert [(c["length"], c["depth"], c["trials"]) for c in cells] == [(128, 0.0, 1), (128, 1.0, 1), (256, 0.0, 1),
                                                                       (256, 1.0, 1)]
    assert all(0 <= c["correct"] <= c["trials"] for c in cells)
    assert (out / "passkey.png").is_file()
    out = run_dir / "pl"
    assert cli.main([str(run_dir / "run"), "--task", "position-loss", "--docs", "2", "--nproc", "1", "--threads", "1",
                     "--out", str(out)]) == 0
    rows = json.loads((out / "results.json").read_text())
    assert [(r["start"], r["end"]) for r in rows] == [(0, 8), (8, 16), (16, 32), (32, 64)]
    assert all(r["loss"] > 0 for r in rows) and (out / "position_loss.png").is_file()


def test_eval_follows_the_runs_chunk_layout(run_dir, monkeypatch):
    """A run trained with --chunk-order balanced is evaluated under it (zigzag without --doc-mask on, as in
    training, where batches without documents stay zigzag)."""
    import dataclasses

    import loongtrain.eval.config as job_module
    from loongtrain.commands.parser import build
    from loongtrain.launch.eval_run import prepare

    resolve = job_module.resolve_model

    def balanced(model: str):
        source = resolve(model)
        return dataclasses.replace(source, run=source.run.replace(chunk_order="balanced", doc_mask="on"))

    monkeypatch.setattr(job_module, "resolve_model", balanced)
    options = dict(model=str(run_dir / "run"), task="position-loss", docs=1, nproc=1)
    assert prepare(job_module.EvalConfig(**options)).run.data.chunk_order == "balanced"
    assert prepare(build(job_module.EvalConfig, dict(options, doc_mask="off"))).run.data.chunk_order == "zigzag"
    monkeypatch.setattr(job_module, "resolve_model", resolve)
    assert prepare(job_module.EvalConfig(**options)).run.data.chunk_order == "zigzag"


def test_eval_of_a_hugging_face_directory_uses_its_tokenizer(tmp_path, capsys):
    import re

    from tokenizers import Tokenizer, models, pre_tokenizers

    from loongtrain.eval.passkey import FILLER, NEEDLE_SUFFIX, QUESTION
    from tests.helpers.hf_models import make_hf_dir

    words = sorted(set(re.findall(r"\w+|[^\w\s]+", FILLER + NEEDLE_PREFIX + NEEDLE_SUFFIX + QUESTION)))
    vocab = {"<unk>": 0, "</s>": 1, **{str(d): 2 + d for d in range(10)}, **{w: 12 + i for i, w in enumerate(words)}}
    model_dir = make_hf_dir(tmp_path / "hf", vocab_size=64)
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(model_dir / "tokenizer.json"))
    out = tmp_path / "out"
    assert cli.main([str(model_dir), "--lengths", "64,128", "--depths", "0,1", "--trials", "2", "--nproc", "1",
                     "--threads", "1", "--out", str(out)]) == 0
    cells = json.loads((out / "results.json").read_text())
    assert [(c["length"], c["trials"], c["digits"]) for c in cells] == [(64, 2, 10), (64, 2, 10), (128, 2, 10),
                                                                       (128, 2, 10)]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["kind"] == "hf" and meta["lengths"] == [64, 128]
    assert "overall: " in capsys.readouterr().out


@pytest.fixture(scope="module")
def tokenizer_run(tmp_path_factory):
    """A 2-step run trained with a Hugging Face BPE tokenizer on a prepared corpus (and the raw corpus)."""
    from loongtrain.commands import main
    from loongtrain.data.prepare import prepare
    from tests.helpers.cli_cases import BASE, bpe_tokenizer

    root = tmp_path_factory.mktemp("tok_run")
    docs = root / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"document {i}: the quick brown fox " * 3}) + "\n" for i in range(80)))
    tok = bpe_tokenizer(root / "tok.json")
    prepare([str(docs)], root / "prep", str(tok), workers=1)
    assert main(["train", *BASE, "--corpus", str(root / "prep"), "--tokenizer", str(tok),
                 "--out-dir", str(root / "run")]) == 0
    return root


def _position_loss(model: str, corpus: str, out, *extra: str) -> list[dict]:
    assert cli.main([model, "--task", "position-loss", "--docs", "2", "--seq-len", "16", "--nproc", "1",
                     "--threads", "1", "--corpus", corpus, "--out", str(out), *extra]) == 0
    return json.loads((out / "results.json").read_text())


def test_eval_reads_the_runs_prepared_corpus_as_the_raw_one(tokenizer_run):
    """eval's default corpus is the run's (here prepared): its sequences equal the raw corpus's."""
    from loongtrain.commands.parser import build
    from loongtrain.eval.config import EvalConfig
    from loongtrain.launch.eval_run import prepare

    options = dict(model=str(tokenizer_run / "run"), task="position-loss", docs=3, nproc=1)
    default = prepare(EvalConfig(**options)).batches
    raw = prepare(build(EvalConfig, dict(options, corpus=str(tokenizer_run / "docs.jsonl")))).batches
    assert len(default) == 3 and all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(default, raw))
    assert int(default[0]["input_ids"].max()) >= 256  # BPE ids: the run's tokenizer, not bytes


def test_export_carries_the_runs_tokenizer(tokenizer_run, tmp_path):
    """The export holds the run's tokenizer files, so evaluating it reads the same ids as evaluating the
    checkpoint: the same losses (the native and the transformers model, fp32); without them it would read
    bytes, and the loss differs."""
    from loongtrain.commands import main
    from loongtrain.data.tokenizer import build_tokenizer

    hf = tmp_path / "hf"
    assert main(["export", str(tokenizer_run / "run"), "--hf", str(hf)]) == 0
    assert (hf / "tokenizer.json").read_bytes() == (tokenizer_run / "tok.json").read_bytes()
    assert build_tokenizer(str(hf)).eos_id == build_tokenizer(str(tokenizer_run / "tok.json")).eos_id
    corpus = str(tokenizer_run / "docs.jsonl")
    trained = _position_loss(str(tokenizer_run / "run"), corpus, tmp_path / "a")
    exported = _position_loss(str(hf), corpus, tmp_path / "b")
    assert [r["loss"] for r in exported] == pytest.approx([r["loss"] for r in trained], rel=1e-4)
    (hf / "tokenizer.json").unlink()  # as an export that dropped it: eval falls back to bytes
    as_bytes = _position_loss(str(hf), corpus, tmp_path / "c")
    assert as_bytes[-1]["loss"] != pytest.approx(trained[-1]["loss"], rel=1e-2)
