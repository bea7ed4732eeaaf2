"""Data pipeline: tokenizers, corpus readers, packing, sampling, resume and dp split."""

from __future__ import annotations

import itertools
import json
import sysconfig

import pytest
import torch

from loongtrain.data import (
    ByteTokenizer,
    FilesCorpus,
    PackedDataset,
    ReplicaSampler,
    TokenStream,
    build_batches,
    build_corpus,
    build_tokenizer,
    stdlib_files,
)
from loongtrain.sections.data import DataSection


class ListCorpus(FilesCorpus):
    """In-memory documents (for exact expectations)."""

    def __init__(self, docs: list[str]) -> None:
        self.docs, self.name = docs, "list"

    def __iter__(self):
        return iter(self.docs)


DOCS = ["hello world", "", "zürich ✓", "a" * 50, "last doc"]


def expected_stream(docs: list[str]) -> list[int]:
    out: list[int] = []
    for d in docs:
        out += list(d.encode()) + [0]
    return out


def test_byte_tokenizer_round_trip():
    tok = build_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 256 and tok.eos_id == 0
    text = "plain ascii, ünïcödé, 中文, emoji 🚀\n\ttabs"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode_tensor(text)) == text
    assert tok.encode_tensor(text).tolist() == ids
    with pytest.raises(ValueError, match="unknown tokenizer"):
        build_tokenizer("no/such/tokenizer")


def test_stream_is_documents_joined_with_eos_and_lazy():
    stream = TokenStream(ListCorpus(DOCS), ByteTokenizer())
    stream.ensure(5)
    assert len(stream) == len("hello world") + 1 and not stream.exhausted  # only the first document
    expected = expected_stream(DOCS)
    assert stream.total_length() == len(expected) and stream.exhausted
    assert stream.slice(0, len(expected)).tolist() == expected
    with pytest.raises(IndexError):
        stream.slice(0, len(expected) + 1)


def test_packing_labels_are_shifted_inputs_and_wrap():
    seq_len = 7
    data = PackedDataset(TokenStream(ListCorpus(DOCS), ByteTokenizer()), seq_len)
    expected = torch.tensor(expected_stream(DOCS))
    n = data.num_samples()
    assert n == (len(expected) - 1) // seq_len
    for i in range(n):
        s = data[i]
        assert s["input_ids"].dtype == s["labels"].dtype == s["position_ids"].dtype == torch.int64
        assert torch.equal(s["input_ids"], expected[i * seq_len : (i + 1) * seq_len])
        assert torch.equal(s["labels"], expected[i * seq_len + 1 : (i + 1) * seq_len + 1])
        assert torch.equal(s["input_ids"][1:], s["labels"][:-1])
        assert torch.equal(s["position_ids"], torch.arange(seq_len))
    for i in range(n, 3 * n):  # later epochs wrap
        assert torch.equal(data[i]["input_ids"], data[i % n]["input_ids"])
    with pytest.raises(ValueError, match="fewer than"):
        PackedDataset(TokenStream(ListCorpus(["ab"]), ByteTokenizer()), 8).num_samples()


def test_sampler_dp_split_covers_each_epoch_once():
    n, dp, batch = 24, 3, 2
    samplers = [ReplicaSampler(n, d, dp, batch, seed=5) for d in range(dp)]
    per_step = dp * batch
    for epoch in range(2):
        seen = []
        for step in range(epoch * n // per_step, (epoch + 1) * n // per_step):
            parts = [s.indices(step) for s in samplers]
            assert len({tuple(p) for p in parts}) == dp  # replicas differ
            seen += [i for p in parts for i in p]
        assert sorted(seen) == list(range(n))  # union covers the epoch exactly once
    first = [i for s in samplers for step in range(4) for i in s.indices(step)]
    second = [i for s in samplers for step in range(4, 8) for i in s.indices(step)]
    assert first != second and first != sorted(first)  # reshuffled per epoch, actually shuffled
    other_seed = ReplicaSampler(n, 0, dp, batch, seed=6)
    assert [other_seed.indices(s) for s in range(4)] != [samplers[0].indices(s) for s in range(4)]
    infinite = ReplicaSampler(None, 1, 2, 3)
    assert infinite.indices(0) == [3, 4, 5] and infinite.indices(2) == [15, 16, 17]
    with pytest.raises(ValueError, match="dp_rank"):
        ReplicaSampler(n, 3, 3, 1)


def test_sampler_resume_is_exact():
    a = ReplicaSampler(50, 1, 2, 3, seed=9)
    for _ in range(7):
        a.next_indices()
    state = a.state_dict()
    expected = [a.next_indices() for _ in range(10)]
    b = ReplicaSampler(50, 1, 2, 3, seed=9)
    b.load_state_dict(state)
    assert [b.next_indices() for _ in range(10)] == expected
    c = ReplicaSampler(50, 1, 2, 3, seed=9, start_step=7)
    assert [c.next_indices() for _ in range(10)] == expected
    with pytest.raises(ValueError, match="samples per step"):
        ReplicaSampler(50, 0, 4, 3, seed=9).load_state_dict(state)


def test_build_batches_determinism_resume_and_dp(tmp_path):
    path = tmp_path / "docs.jsonl"
    gen = torch.Generator().manual_seed(0)
    with open(path, "w") as f:
        for i in range(40):
            words = torch.randint(0, 1000, (int(torch.randint(5, 40, (1,), generator=gen)),), generator=gen)
            f.write(json.dumps({"text": f"doc {i}: " + " ".join(map(str, words.tolist()))}) + "\n")
    kwargs = dict(data=DataSection(corpus=str(path), seq_len=64, batch_size=2), tokenizer="byte", dp=2, seed=3)
    for shuffle in (True, False):
        a = build_batches(dp_rank=0, start_step=0, shuffle=shuffle, **kwargs)
        b = build_batches(dp_rank=0, start_step=0, shuffle=shuffle, **kwargs)
        batches = [next(a) for _ in range(30)]  # several epochs
        for x, y in zip(batches, (next(b) for _ in range(30)), strict=True):
            assert all(torch.equal(x[k], y[k]) for k in x)
            assert x["input_ids"].shape == (2, 64) and x["input_ids"].dtype == torch.int64
            assert torch.equal(x["input_ids"][:, 1:], x["labels"][:, :-1])
        resumed = build_batches(dp_rank=0, start_step=11, shuffle=shuffle, **kwargs)
        assert all(torch.equal(next(resumed)["labels"], batches[i]["labels"]) for i in range(11, 20))
        other = build_batches(dp_rank=1, start_step=0, shuffle=shuffle, **kwargs)
        assert not torch.equal(next(other)["input_ids"], batches[0]["input_ids"])
        state = a.state_dict()
        a2 = build_batches(dp_rank=0, start_step=0, shuffle=shuffle, **kwargs)
        a2.load_state_dict(state)
        assert torch.equal(next(a2)["input_ids"], next(a)["input_ids"])


def test_txt_and_jsonl_readers(tmp_path):
    (tmp_path / "b.txt").write_text("second file\n\nstill second")
    (tmp_path / "a.txt").write_text("first file")
    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "c.jsonl").write_text('{"text": "j1", "id": 1}\n\n{"text": "j2"}\n')
    (sub / "d.jsonl").write_text('{"body": "custom field"}\n')
    assert list(build_corpus(tmp_path / "b.txt")) == ["second file\n\nstill second"]
    assert list(build_corpus(sub / "c.jsonl")) == ["j1", "j2"]
    assert list(build_corpus(sub / "d.jsonl", text_field="body")) == ["custom field"]
    with pytest.raises(ValueError, match="no string field 'text'"):
        list(build_corpus(sub / "d.jsonl"))
    assert list(itertools.islice(build_corpus(tmp_path), 4)) == [  # sorted paths, lazily
        "first file", "second file\n\nstill second", "j1", "j2",
    ]
    (sub / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        list(build_corpus(sub / "bad.jsonl"))


def test_bad_paths_raise_value_error(tmp_path):
    with pytest.raises(ValueError, match="existing path"):
        build_corpus(tmp_path / "missing.txt")
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(ValueError, match=r"\.txt or \.jsonl"):
        build_corpus(tmp_path / "x.csv")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no .txt or .jsonl"):
        build_corpus(tmp_path / "empty")
    with pytest.raises(ValueError):
        build_batches(DataSection(corpus=str(tmp_path / "nope"), seq_len=8))


def test_stdlib_corpus_is_sorted_python_without_tests():
    files = stdlib_files()
    assert len(files) > 100 and files == sorted(files)
    assert all(f.suffix == ".py" for f in files)
    root = sysconfig.get_paths()["stdlib"]
    assert not any({"site-packages", "test", "tests"} & set(f.relative_to(root).parts) for f in files)
    batches = build_batches(DataSection(corpus="stdlib", seq_len=256, batch_size=2), "byte", shuffle=False)
    first = next(batches)
    stream = b"".join(f.read_bytes() + b"\0" for f in files[:20])
    assert first["input_ids"].flatten().tolist() == list(stream[:256] + stream[256:512])


def test_hf_tokenizer_from_local_file(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from loongtrain.data import HFTokenizer

    model = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "</s>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    model.train_from_iterator(["def f(x):\n    return x + 1\n"] * 20, trainer=trainer)
    model.save(str(tmp_path / "tokenizer.json"))
    tok = build_tokenizer(str(tmp_path))  # a directory holding tokenizer.json
    assert isinstance(tok, HFTokenizer) and tok.eos_id == 1 and tok.vocab_size == model.get_vocab_size()
    text = "def g(y):\n    return y * 2\n"
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode(text)) < len(text.encode())  # merges were learned and used
    (tmp_path / "doc.txt").write_text(text)
    batch = next(build_batches(DataSection(corpus=str(tmp_path / "doc.txt"), seq_len=4), tok, shuffle=False))
    stream = tok.encode(text) + [tok.eos_id]
    assert batch["input_ids"][0].tolist() == stream[:4] and batch["labels"][0].tolist() == stream[1:5]
    with pytest.raises(ValueError, match="not in the vocabulary"):
        HFTokenizer(tmp_path / "tokenizer.json", eos_token="<nope>")


def test_hf_dataset_saved_to_disk(tmp_path):
    datasets = pytest.importorskip("datasets")
    from loongtrain.data import HFDatasetCorpus

    rows = {"content": ["first row", "second row", "third"], "id": [1, 2, 3]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "plain"))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows)}).save_to_disk(str(tmp_path / "dict"))
    for name in ("plain", "dict"):
        corpus = build_corpus(tmp_path / name, text_field="content")
        assert isinstance(corpus, HFDatasetCorpus) and list(corpus) == rows["content"]
    with pytest.raises(ValueError, match="no column 'text'"):
        build_corpus(tmp_path / "plain")
