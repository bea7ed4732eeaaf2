"""Prepared corpora: the on-disk format, `loongtrain prepare` (idempotence, interruption, bad input),
and memory-mapped batches bit-identical to the raw read (docs/data.md)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from loongtrain.commands import main as cli_main
from loongtrain.data import build_batches, build_tokenizer
from loongtrain.data.prepare import Sharding, prepare
from loongtrain.data.prepared import (
    FORMAT_VERSION,
    IN_PROGRESS,
    MANIFEST,
    SAMPLE_BYTES,
    PreparedStream,
    buffer_digests,
    document_index,
    file_digests,
    read_manifest,
    sampled_digest,
    verify_prepared,
)
from loongtrain.sections.data import DataSection


def write_jsonl(path, docs):
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


def make_docs(n=120, seed=0):
    rng = np.random.default_rng(seed)
    return [f"doc {i}: " + "xyzäb✓ "[i % 7] * int(rng.integers(0, 40)) for i in range(n)]


@pytest.fixture
def corpus(tmp_path):
    return write_jsonl(tmp_path / "c.jsonl", make_docs())


def equal_batches(a, b, steps):
    for _ in range(steps):
        x, y = next(a), next(b)
        assert x.keys() == y.keys()
        for key in x:
            assert x[key].dtype == y[key].dtype and torch.equal(x[key], y[key]), key


def test_format_is_the_raw_token_stream(tmp_path, corpus):
    docs = make_docs()
    out = tmp_path / "p"
    result = prepare([str(corpus)], out, "byte", Sharding(shard_bytes=300), workers=1)
    manifest = read_manifest(out)
    assert result.status == "prepared" and manifest.data["version"] == FORMAT_VERSION
    assert manifest.dtype == np.dtype("<u2") and manifest.tokenizer["identity"] == "byte"
    assert len(manifest.data["shards"]) > 3  # several shards, cut at document boundaries
    expected = b"".join(d.encode() + b"\0" for d in docs)
    stream = PreparedStream(manifest, build_tokenizer("byte"))
    assert manifest.num_tokens == len(expected) == len(stream) and manifest.num_documents == len(docs)
    assert stream.slice(0, len(expected)).tolist() == list(expected)  # across every shard boundary
    index = np.asarray(document_index(manifest))
    lengths = [len(d.encode()) + 1 for d in docs]
    assert index.tolist() == np.concatenate([[0], np.cumsum(lengths)]).tolist()
    assert sum(s["num_documents"] for s in manifest.data["shards"]) == len(docs)
    assert not (out / IN_PROGRESS).exists() and not list(out.glob(".tmp-*"))


@pytest.mark.distributed  # a pool of 2 worker processes
def test_same_output_for_any_worker_count_and_idempotent(tmp_path, corpus, caplog):
    prepare([str(corpus)], tmp_path / "one", "byte", Sharding(shard_bytes=300), workers=1)
    prepare([str(corpus)], tmp_path / "two", "byte", Sharding(shard_bytes=300), workers=2)
    files = sorted(p.relative_to(tmp_path / "one") for p in (tmp_path / "one").rglob("*") if p.is_file())
    for f in files:
        assert (tmp_path / "one" / f).read_bytes() == (tmp_path / "two" / f).read_bytes(), f
    before = {f: (tmp_path / "one" / f).stat().st_mtime_ns for f in files}
    with caplog.at_level("INFO", logger="loongtrain"):
        again = prepare([str(corpus)], tmp_path / "one", "byte", Sharding(shard_bytes=300), workers=2)
    assert again.status == "unchanged" and "nothing to do" in caplog.text
    assert before == {f: (tmp_path / "one" / f).stat().st_mtime_ns for f in files}


def test_interrupted_prepare_is_never_read_and_restarts_cleanly(tmp_path, corpus):
    out = tmp_path / "p"

    def crash(k):
        if k == 2:
            raise RuntimeError("simulated crash between shards")

    with pytest.raises(RuntimeError, match="simulated"):
        prepare([str(corpus)], out, "byte", Sharding(shard_bytes=300), workers=1, on_shard=crash)
    assert (out / IN_PROGRESS).exists() and not (out / MANIFEST).exists()
    assert list(out.glob(".tmp-*/tokens-00002.bin"))  # the crash left written shards behind
    with pytest.raises(ValueError, match="interrupted"):
        build_batches(DataSection(corpus=str(out), seq_len=16), "byte")
    assert prepare([str(corpus)], out, "byte", Sharding(shard_bytes=300), workers=1).status == "prepared"
    prepare([str(corpus)], tmp_path / "clean", "byte", Sharding(shard_bytes=300), workers=1)
    assert not list(out.glob(".tmp-*")) and not (out / IN_PROGRESS).exists()
    assert json.loads((out / MANIFEST).read_text())["shards"] == json.loads(
        (tmp_path / "clean" / MANIFEST).read_text())["shards"]


def test_mmap_batches_bit_equal_to_raw_and_resume(tmp_path, corpus):
    prepare([str(corpus)], tmp_path / "p", "byte", Sharding(shard_bytes=300), workers=1)
    for dp_rank, dp, shuffle in ((0, 1, True), (1, 2, True), (0, 1, False)):
        raw = build_batches(DataSection(corpus=str(corpus), seq_len=24, batch_size=3), "byte", 7, dp_rank=dp_rank,
                            dp=dp, shuffle=shuffle)
        mm = build_batches(DataSection(corpus=str(tmp_path / "p"), seq_len=24, batch_size=3), "byte", 7,
                           dp_rank=dp_rank, dp=dp, shuffle=shuffle)
        equal_batches(raw, mm, 40)  # past an epoch: wraps identically
    # resume into another dp at the same global batch: the replicas' union is the same sequence
    one = build_batches(DataSection(corpus=str(tmp_path / "p"), seq_len=24, batch_size=4), "byte", 7)
    for _ in range(5):
        next(one)
    state = one.state_dict()
    halves = []
    for rank in range(2):
        b = build_batches(DataSection(corpus=str(tmp_path / "p"), seq_len=24, batch_size=2), "byte", 7, dp_rank=rank,
                          dp=2)
        b.load_state_dict(state)
        halves.append(next(b))
    nxt = next(one)
    assert torch.equal(torch.cat([h["input_ids"] for h in halves]), nxt["input_ids"])


@pytest.mark.distributed  # a pool of 2 worker processes
def test_hf_tokenizer_prepare_equals_raw(tmp_path, corpus):
    tokenizers = pytest.importorskip("tokenizers")
    model = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    model.train_from_iterator(make_docs(), trainer=trainer)
    model.save(str(tmp_path / "tok.json"))
    tok = build_tokenizer(str(tmp_path / "tok.json"))
    prepare([str(corpus)], tmp_path / "p", tok, Sharding(shard_bytes=500), workers=2)
    assert read_manifest(tmp_path / "p").tokenizer["identity"].startswith("sha256:")
    equal_batches(build_batches(DataSection(corpus=str(corpus), seq_len=16, batch_size=2), tok, 3),
                  build_batches(DataSection(corpus=str(tmp_path / "p"), seq_len=16, batch_size=2), tok, 3), 30)
    with pytest.raises(ValueError, match=r"manifest.json: prepared with tokenizer .*tok.json"):
        build_batches(DataSection(corpus=str(tmp_path / "p"), seq_len=16), "byte")


def test_startup_reads_no_tokens(tmp_path, corpus, monkeypatch):
    """A prepared corpus opens without reading its shards (only the manifest and sampled blocks)."""
    prepare([str(corpus)], tmp_path / "p", "byte", Sharding(shard_bytes=300), workers=1)
    import loongtrain.data.prepared as prepared

    touched = []
    real = prepared.PreparedStream._physical
    def spy(self, a, b):
        touched.append((a, b))
        return real(self, a, b)

    monkeypatch.setattr(prepared.PreparedStream, "_physical", spy)
    batches = build_batches(DataSection(corpus=str(tmp_path / "p"), seq_len=24, batch_size=2), "byte")
    assert touched == []
    next(batches)
    assert sum(b - a for a, b in touched) == 2 * 25  # two samples of seq_len + 1 tokens


def corrupt(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_verify_catches_truncation_corruption_and_newer_format(tmp_path, corpus):
    out = tmp_path / "p"
    prepare([str(corpus)], out, "byte", Sharding(shard_bytes=300), workers=1)
    shard = out / "shards" / "tokens-00001.bin"
    corrupt(shard, 0)
    with pytest.raises(ValueError, match=r"tokens-00001.bin: corrupted \(sampled checksum"):
        verify_prepared(out)
    corrupt(shard, 0)
    verify_prepared(out, full=True)
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(ValueError, match=r"tokens-00001.bin: truncated .* offset"):
        verify_prepared(out)
    manifest = json.loads((out / MANIFEST).read_text())
    (out / MANIFEST).write_text(json.dumps({**manifest, "version": FORMAT_VERSION + 1}))
    with pytest.raises(ValueError, match=r"manifest.json: format version 2 is newer"):
        verify_prepared(out)


def test_sampled_digest_rule(tmp_path):
    """Large files: the sampled digest sees the first and last blocks, not the bytes between blocks."""
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(40 * SAMPLE_BYTES))
    base = sampled_digest(path)
    corrupt(path, 40 * SAMPLE_BYTES - 1)
    assert sampled_digest(path) != base
    corrupt(path, 40 * SAMPLE_BYTES - 1)
    corrupt(path, SAMPLE_BYTES + 5)  # between the first and second sampled blocks
    assert sampled_digest(path) == base
    data = np.arange(40 * SAMPLE_BYTES // 2, dtype="<u2")
    data.tofile(path)
    assert buffer_digests(data) == file_digests(path)  # what prepare computes in memory = what verify reads


class WorkerStarted(Exception):
    pass


def no_workers(task):
    raise WorkerStarted(task[0])


def no_pool(*args):
    raise WorkerStarted("pool")


@pytest.mark.parametrize("case", ["nonempty", "bad_json", "other_tokenizer_dir", "newer", "no_corpus"])
def test_prepare_cli_bad_input_exits_2(tmp_path, corpus, capsys, case, monkeypatch):
    import loongtrain.data.prepare as prep

    monkeypatch.setattr(prep, "_tokenize_shard", no_workers)  # a shard started would raise
    monkeypatch.setattr(prep.multiprocessing, "get_context", no_pool)  # and so would a worker pool
    out = tmp_path / "out"
    args = [str(corpus), "--out", str(out), "--workers", "2"]
    if case == "nonempty":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
        needle = "holds files loongtrain did not write (notes.txt)"
    elif case == "bad_json":
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"text": "ok"}\n{oops\n')
        args[0], needle = str(bad), "bad.jsonl:2: invalid JSON"
        args += ["--shard-bytes", "1000000"]  # the bad line is read before the first shard is full
    elif case in ("other_tokenizer_dir", "newer"):
        monkeypatch.undo()
        prepare([str(corpus)], out, "byte", Sharding(shard_bytes=300), workers=1)
        monkeypatch.setattr(prep, "_tokenize_shard", no_workers)
        monkeypatch.setattr(prep.multiprocessing, "get_context", no_pool)
        if case == "newer":
            m = json.loads((out / MANIFEST).read_text())
            (out / MANIFEST).write_text(json.dumps({**m, "version": 99}))
            needle = "format version 99 is newer"
        else:
            args += ["--shard-bytes", "1000"]
            needle = "another shard_bytes"
        capsys.readouterr()  # the good prepare's own log line is not the bad run's output
    else:
        args, needle = ["--out", str(out)], "at least one CORPUS"
    assert cli_main(["prepare", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    if case == "nonempty":  # --overwrite never deletes a file loongtrain did not write
        assert cli_main(["prepare", *args, "--overwrite"]) == 2
        assert "did not write (notes.txt)" in capsys.readouterr().err
        assert sorted(p.name for p in out.iterdir()) == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    if case == "bad_json":
        assert not out.exists() or not any(out.iterdir())


def test_train_from_prepared_equals_raw_and_logs_tokens_by_corpus(tmp_path, corpus):
    """`loongtrain train --corpus DIR`: the same losses as the raw corpus; a mixture's metrics carry the
    tokens each corpus supplied."""
    from loongtrain.train.metrics import read_jsonl

    assert cli_main(["prepare", str(corpus), "--out", str(tmp_path / "p"), "--workers", "1"]) == 0
    base = ["train", "--nproc", "1", "--hp", "1", "--cp", "1", "--seq-len", "16", "--steps", "3", "--warmup", "1",
            "--progress", "off", "--peak-tflops", "1", "--no-tensorboard", "--no-plot", "--threads", "1",
            "--batch-size", "2", "--val-fraction", "0.2"]
    runs = {}
    for name, spec in (("raw", str(corpus)), ("prepared", str(tmp_path / "p")),
                       ("mix", f"{tmp_path / 'p'}=0.5,{corpus}=0.5")):
        report = ["--memory-report" if name == "prepared" else "--no-memory-report"]
        assert cli_main([*base, *report, "--corpus", spec, "--out-dir", str(tmp_path / name)]) == 0
        runs[name] = read_jsonl(tmp_path / name / "metrics.jsonl")
    assert [r["loss"] for r in runs["raw"]] == [r["loss"] for r in runs["prepared"]]
    assert runs["prepared"][-1][f"tokens_seen/{tmp_path / 'p'}"] == 3 * 2 * 16
    last = runs["mix"][-1]
    assert last[f"tokens_seen/{tmp_path / 'p'}"] + last[f"tokens_seen/{corpus}"] == 3 * 2 * 16


def test_a_corpus_prepared_again_from_other_data_is_not_resumed(tmp_path, capsys):
    """A checkpoint records its corpus by content: prepared again into the same directory from other data,
    `--resume auto` exits 2 naming the change (by name alone it would have resumed on other tokens)."""
    other = write_jsonl(tmp_path / "other.jsonl", make_docs(120, seed=5))
    corpus = write_jsonl(tmp_path / "c.jsonl", make_docs())
    prep = tmp_path / "p"
    assert cli_main(["prepare", str(corpus), "--out", str(prep), "--workers", "1"]) == 0
    base = ["train", "--nproc", "1", "--hp", "1", "--cp", "1", "--seq-len", "16", "--steps", "2", "--warmup", "1",
            "--progress", "off", "--peak-tflops", "1", "--no-tensorboard", "--no-plot", "--threads", "1",
            "--no-memory-report", "--corpus", str(prep), "--out-dir", str(tmp_path / "run")]
    assert cli_main(base) == 0
    capsys.readouterr()
    assert cli_main(["prepare", str(other), "--out", str(prep), "--workers", "1", "--overwrite"]) == 0
    capsys.readouterr()
    assert cli_main([*base[:-4], "--steps", "3", "--resume", "auto", *base[-4:]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"corpus '{prep}' changed (then: prepared, " in err[-1], err


def test_overwrite_keeps_the_old_corpus_until_the_new_one_is_whole(tmp_path, corpus):
    out = tmp_path / "p"
    prepare([str(corpus)], out, "byte", Sharding(shard_bytes=300), workers=1)
    before = (out / MANIFEST).read_bytes()

    def check(k):
        assert (out / MANIFEST).read_bytes() == before  # readable as it was while the new shards are written
        verify_prepared(out, full=True)
        if k == 3:
            raise ValueError("a bad line")

    other = write_jsonl(tmp_path / "o.jsonl", make_docs(50, seed=1))
    with pytest.raises(ValueError, match="a bad line"):
        prepare([str(other)], out, "byte", Sharding(shard_bytes=300), workers=1, overwrite=True, on_shard=check)
    assert (out / MANIFEST).read_bytes() == before and not list(out.glob(".tmp-*"))
    again = prepare([str(other)], out, "byte", Sharding(shard_bytes=300), workers=1, overwrite=True)
    assert again.num_documents == 50


def test_sampled_documents_read_large_files_by_blocks(tmp_path, monkeypatch):
    """Files past the sample size are read as blocks: whole UTF-8 characters and whole JSON lines only (a
    block boundary inside either is no error), a bad byte inside a block named by its file offset."""
    from loongtrain.data import corpus as corpus_module
    from loongtrain.data.corpus import build_corpus as build_corpus_files
    from loongtrain.data.corpus import sample_documents

    monkeypatch.setattr(corpus_module, "SAMPLE_FILE_BYTES", 4096)
    text = tmp_path / "big.txt"
    text.write_text("äöü€𝄞 text " * 4000)  # multi-byte characters across every block boundary
    docs = list(sample_documents([text]))
    assert len(docs) == corpus_module.SAMPLE_BLOCKS and all(d and "\ufffd" not in d for d in docs)
    lines = tmp_path / "big.jsonl"
    lines.write_text("".join(json.dumps({"text": f"ä line {i}"}, ensure_ascii=False) + "\n" for i in range(3000)))
    sampled = list(sample_documents([lines]))
    assert sampled[0] == "ä line 0" and sampled[-1] == "ä line 2999" and all(d.startswith("ä line ") for d in sampled)
    data = bytearray(text.read_bytes())
    block = 4096 // corpus_module.SAMPLE_BLOCKS
    inside, between = (len(data) - block) * 8 // 15 + 100, (len(data) - block) * 8 // 15 + block + 100
    data[between] = 0xFF  # between two sampled blocks: not read here (the reader finds it)
    (tmp_path / "bad.txt").write_bytes(bytes(data))
    assert len(list(sample_documents([tmp_path / "bad.txt"]))) == corpus_module.SAMPLE_BLOCKS
    data[inside] = 0xFF  # inside the 9th block
    (tmp_path / "bad.txt").write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"bad.txt: not valid UTF-8 text at byte \d+ ") as caught:
        list(sample_documents([tmp_path / "bad.txt"]))
    at = int(str(caught.value).split("at byte ")[1].split()[0])
    assert inside - 3 <= at <= inside  # the file offset (of the character the bad byte breaks)
    with pytest.raises(ValueError, match=rf"at byte {at} "):  # the full read says the same
        list(build_corpus_files(tmp_path / "bad.txt"))


def test_corpus_identity_is_the_content(tmp_path, corpus):
    """Raw: the files' sizes and sampled digests (an edit is a change; a new modification time alone only
    a warning); prepared: the manifest's digests."""
    import os

    from loongtrain.data.sources import corpus_identity, identity_change

    first = corpus_identity(str(corpus))
    stat = corpus.stat()
    os.utime(corpus, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    touched = corpus_identity(str(corpus))
    assert identity_change(first, touched)[0] is None and "were modified" in identity_change(first, touched)[1]
    corpus.write_text(corpus.read_text().replace("doc 1:", "doc 9:"))  # same size, other bytes
    assert "changed" in identity_change(first, corpus_identity(str(corpus)))[0]
    prepare([str(corpus)], tmp_path / "p", workers=1)
    assert corpus_identity(str(tmp_path / "p"))[0]["kind"] == "prepared"
    assert identity_change(corpus_identity(str(tmp_path / "p")), corpus_identity(str(tmp_path / "p"))) == (None, None)
