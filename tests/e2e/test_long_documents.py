"""`loongtrain prepare --min-doc-tokens N`: a corpus of the long documents only (bit-identical to the raw corpus
of those documents), recorded in the manifest so another N is another preparation, and the long-document
recipe: that corpus mixed with a short one under seq-len stages."""

from __future__ import annotations

import json

import pytest
import torch

from loongtrain.commands import main
from loongtrain.data import build_batches
from loongtrain.data.prepare import Sharding, prepare
from loongtrain.data.prepared import MANIFEST
from loongtrain.sections.data import DataSection
from loongtrain.train.metrics import read_jsonl
from tests.helpers.fixtures import QUIET_FLAGS


def _write(path, docs):
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return str(path)


DOCS = [f"doc {i}: " + "lorem ipsum " * (i % 9) for i in range(90)]  # 7 to 115 bytes (byte tokens)


def test_only_documents_of_at_least_n_tokens_are_kept(tmp_path):
    corpus = _write(tmp_path / "all.jsonl", DOCS)
    long_only = _write(tmp_path / "long.jsonl", [d for d in DOCS if len(d.encode()) >= 60])
    result = prepare([corpus], tmp_path / "p", "byte", Sharding(shard_bytes=500, min_doc_tokens=60), workers=1)
    assert result.num_documents == sum(len(d.encode()) >= 60 for d in DOCS) < len(DOCS)
    manifest = json.loads((tmp_path / "p" / MANIFEST).read_text())
    assert manifest["min_doc_tokens"] == 60 and manifest["num_documents"] == result.num_documents
    for shuffle in (True, False):
        kept = build_batches(DataSection(corpus=str(tmp_path / "p"), seq_len=32, batch_size=2), "byte", 3,
                             shuffle=shuffle)
        raw = build_batches(DataSection(corpus=long_only, seq_len=32, batch_size=2), "byte", 3, shuffle=shuffle)
        for _ in range(12):
            x, y = next(kept), next(raw)
            assert all(torch.equal(x[k], y[k]) for k in x)
    again = prepare([corpus], tmp_path / "p", "byte", Sharding(shard_bytes=500, min_doc_tokens=60), workers=1)
    assert again.status == "unchanged"
    with pytest.raises(ValueError, match="another min_doc_tokens"):
        prepare([corpus], tmp_path / "p", "byte", Sharding(shard_bytes=500, min_doc_tokens=30), workers=1)


def test_a_manifest_without_the_field_prepared_every_document(tmp_path):
    corpus = _write(tmp_path / "all.jsonl", DOCS)
    prepare([corpus], tmp_path / "p", "byte", Sharding(shard_bytes=500), workers=1)
    path = tmp_path / "p" / MANIFEST
    old = json.loads(path.read_text())
    assert old.pop("min_doc_tokens") == 0
    path.write_text(json.dumps(old))  # as written before the field existed
    assert prepare([corpus], tmp_path / "p", "byte", Sharding(shard_bytes=500), workers=1).status == "unchanged"
    with pytest.raises(ValueError, match="another min_doc_tokens"):
        prepare([corpus], tmp_path / "p", "byte", Sharding(shard_bytes=500, min_doc_tokens=10), workers=1)


@pytest.mark.parametrize("n, needle", [("1000", "none of the 90 documents has that many tokens"),
                                       ("-1", "--min-doc-tokens=-1 must be >= 0")])
def test_bad_min_doc_tokens_exit_2(tmp_path, capsys, n, needle):
    corpus = _write(tmp_path / "all.jsonl", DOCS)
    out = tmp_path / "p"
    assert main(["prepare", corpus, "--out", str(out), "--workers", "1", "--min-doc-tokens", n]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and needle in err, err
    assert not out.exists() or not any(out.iterdir())


def test_long_documents_mixed_with_short_ones_under_a_schedule(tmp_path):
    """The recipe of the README: the long documents prepared on their own, mixed with the whole corpus."""
    corpus = _write(tmp_path / "all.jsonl", DOCS)
    long_dir = tmp_path / "long"
    assert main(["prepare", corpus, "--out", str(long_dir), "--workers", "1", "--min-doc-tokens", "60"]) == 0
    out = tmp_path / "run"
    argv = ["train", "--nproc", "1", "--hp", "1", "--cp", "1", "--corpus", f"{long_dir}=0.5,{corpus}=0.5",
            "--seq-len-stages", "16:2,32:2", "--batch-size", "2", "--warmup", "1", "--no-memory-report",
            "--out-dir", str(out), *QUIET_FLAGS]
    assert main(argv) == 0
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["seq_len"] for r in rows] == [16, 16, 32, 32]
    last = rows[-1]
    # tokens per step count from the longest stage: 2 x 32 in every step (issue 41)
    assert last[f"tokens_seen/{long_dir}"] + last[f"tokens_seen/{corpus}"] == 4 * 2 * 32
