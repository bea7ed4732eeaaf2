"""Mixtures of corpora and the validation split: determinism, resume, per-corpus token counts, no
overlap between training and validation documents (docs/data.md)."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import torch

from loongtrain.data import build_batches
from loongtrain.data.mixture import BLOCK, block_counts
from loongtrain.data.prepare import Sharding, prepare
from loongtrain.data.sources import parse_corpus_spec
from loongtrain.data.split import held_out
from loongtrain.data.validation import build_val_batches
from loongtrain.sections.data import DataSection

SEQ = 16


def section(corpus, batch_size, **options):
    """The data section reading ``corpus`` in batches of ``batch_size`` sequences of SEQ tokens."""
    return DataSection(corpus=corpus, seq_len=SEQ, batch_size=batch_size, **options)


def tagged_corpus(path, first, count):
    """Documents whose every byte is the document's tag (first..first+count-1, never 0 = EOS)."""
    rng = np.random.default_rng(first)
    docs = [chr(first + i) * int(rng.integers(3, 30)) for i in range(count)]
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return str(path)


@pytest.fixture
def two(tmp_path):
    a = tagged_corpus(tmp_path / "a.jsonl", 1, 60)
    b = tagged_corpus(tmp_path / "b.jsonl", 70, 50)
    prepare([a], tmp_path / "pa", "byte", Sharding(shard_bytes=200), workers=1)
    return a, b, str(tmp_path / "pa")


def tags(batch):
    ids = batch["input_ids"].flatten()
    return set(ids[ids != 0].tolist())


def take(batches, n):
    return [next(batches) for _ in range(n)]


def test_parse_corpus_spec(tmp_path):
    assert parse_corpus_spec("stdlib") == [("stdlib", 1.0)]
    odd = tmp_path / "w=1,x.jsonl"
    odd.write_text("")
    assert parse_corpus_spec(str(odd)) == [(str(odd), 1.0)]  # an existing path is one corpus
    assert parse_corpus_spec("a=0.7, b=0.3,c=0") == [("a", 0.7), ("b", 0.3), ("c", 0.0)]
    for spec, needle in (("a=x,b=1", "weight 'x' of 'a' is not a number"), ("a=-1,b=1", "must be finite and >= 0"),
                         ("a=0,b=0", "at least one weight must be positive"), ("a=1,b", "is not NAME=WEIGHT"),
                         ("a=1,a=2", "appears twice"), ("a=inf,b=1", "finite")):
        with pytest.raises(ValueError, match=needle):
            parse_corpus_spec(spec)


def test_one_corpus_one_name(tmp_path, monkeypatch):
    """Mixture parts are compared by the corpus they resolve to: two spellings of a path, a link and its target
    (parse_corpus_spec), and a copy of the same content (check_one_name) are one corpus, refused with the
    weights summed; two different corpora pass."""
    from loongtrain.data.sources import check_one_name

    monkeypatch.chdir(tmp_path)
    (tmp_path / "prep").mkdir()
    (tmp_path / "prep" / "a.jsonl").write_text('{"text": "one corpus"}\n')
    (tmp_path / "link").symlink_to(tmp_path / "prep")
    shutil.copytree(tmp_path / "prep", tmp_path / "copy")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "a.jsonl").write_text('{"text": "another corpus"}\n')
    for spec, named, summed in (("prep=0.5,./prep=0.5", "'prep' and './prep' are one corpus", "prep=1"),
                                (f"prep=0.25,{tmp_path}/prep/=0.5", "are one corpus", "prep=0.75"),
                                ("prep=0.5,link=0.2", "'prep' and 'link' are one corpus", "prep=0.7")):
        with pytest.raises(ValueError, match=re.escape(named) + ".*name it once, with its weights summed "
                                             + re.escape(f"({summed})")):
            parse_corpus_spec(spec)
    with pytest.raises(ValueError, match=r"'prep' and 'copy' hold the same corpus \(the same content: 1 file"):
        check_one_name("prep=0.5,copy=0.5")
    assert [r["corpus"] for r in check_one_name("prep=0.5,other=0.5")] == ["prep", "other"]


def test_block_counts_are_proportional():
    assert block_counts([0.7, 0.3]) == [717, 307] and sum(block_counts([1, 1, 1])) == BLOCK
    assert block_counts([1.0, 0.0]) == [BLOCK, 0]


def test_mixture_is_deterministic_resumable_and_weighted(two):
    a, b, pa = two
    spec = f"{pa}=0.75,{b}=0.25"
    first = take(build_batches(section(spec, 4), "byte", 5), 12)
    again = take(build_batches(section(spec, 4), "byte", 5), 12)
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(first, again))
    raw = take(build_batches(section(f"{a}=0.75,{b}=0.25", 4), "byte", 5), 12)
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(first, raw))  # prepared == raw
    # resume at step 6 into dp=2 with the same global batch
    full = build_batches(section(spec, 4), "byte", 5)
    take(full, 6)
    state = full.state_dict()
    for step in range(6, 12):
        halves = []
        for rank in range(2):
            part = build_batches(section(spec, 2), "byte", 5, dp_rank=rank, dp=2)
            part.load_state_dict({**state, "step": step})
            halves.append(next(part)["input_ids"])
        assert torch.equal(torch.cat(halves), first[step]["input_ids"])
    seen = full.tokens_by_corpus()
    total = 6 * 4 * SEQ
    assert seen == {pa: pytest.approx(0.75 * total, abs=3 * SEQ), b: pytest.approx(0.25 * total, abs=3 * SEQ)}
    assert sum(seen.values()) == 6 * 4 * SEQ
    from_a = sum(1 for x in first for row in x["input_ids"] if max(row.tolist()) < 70)
    from_b = sum(1 for x in first for row in x["input_ids"] if min(v for v in row.tolist() if v) >= 70)
    assert from_a + from_b == 48 and abs(from_a - 36) <= 2  # every sequence from one corpus, by weight


def test_one_corpus_mixture_is_the_corpus_and_zero_weight_never_drawn(two):
    a, b, pa = two
    alone = take(build_batches(section(pa, 2), "byte", 3), 8)
    mixed = build_batches(section(f"{pa}=1,{b}=0", 2), "byte", 3)
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(alone, take(mixed, 8)))
    assert mixed.tokens_by_corpus() == {pa: 8 * 2 * SEQ, b: 0}


@pytest.mark.parametrize("prepared", [False, True])
def test_validation_never_overlaps_training(two, prepared):
    a, b, pa = two
    spec = pa if prepared else a
    held = set((1 + np.flatnonzero(held_out(np.arange(60), 0.25, 11))).tolist())
    assert 5 < len(held) < 30
    train = build_batches(section(spec, 2, val_fraction=0.25), "byte", 11)
    epoch = train.dataset.num_samples()
    train_tags = set().union(*(tags(x) for x in take(train, epoch)))  # one full epoch (and more)
    val = build_val_batches(section(spec, 1, val_fraction=0.25), "byte", 11)
    val_tags = set().union(*(tags(x) for x in val))
    assert len(val) > 3 and val_tags <= held and not (val_tags & train_tags)
    kept = set(range(1, 61)) - held
    assert train_tags <= kept and len(train_tags) >= len(kept) - 2  # (the epoch's last partial sample is dropped)
    assert [x["input_ids"].tolist() for x in val] == [x["input_ids"].tolist() for x in val]  # re-iterable
    # two replicas split the validation batches without overlap, equally
    parts = [list(build_val_batches(section(spec, 1, val_fraction=0.25), "byte", 11, dp_rank=r, dp=2))
             for r in range(2)]
    assert len(parts[0]) == len(parts[1]) == len(val) // 2
    interleaved = [p["input_ids"] for pair in zip(*parts) for p in pair]
    assert all(torch.equal(p, x["input_ids"]) for p, x in zip(interleaved, val))


def test_val_split_prepared_equals_raw_and_val_corpus(two):
    a, b, pa = two
    for kwargs in ({"val_fraction": 0.3}, {"val_corpus": b}):
        raw = [x["input_ids"] for x in build_val_batches(section(a, 2, **kwargs), "byte", 1)]
        mm = [x["input_ids"] for x in build_val_batches(section(pa, 2, **kwargs), "byte", 1)]
        assert len(raw) == len(mm) > 0 and all(torch.equal(x, y) for x, y in zip(raw, mm))
    names = {n for n, _ in build_val_batches(section(f"{pa}=0.5,{b}=0.5", 1, val_fraction=0.3), "byte", 1).named()}
    assert names == {pa, b}
    for kwargs, needle in (({}, "exactly one of"), ({"val_fraction": 1.0}, r"must be in \(0, 1\)"),
                           ({"val_fraction": 0.01}, "less than one global batch")):
        with pytest.raises(ValueError, match=needle):
            build_val_batches(section(a, 1, **kwargs), "byte", 1)


def test_large_epochs_use_a_stateless_permutation():
    """Above RANDPERM_MAX samples the sampler permutes without a table (O(1) start-up at any size);
    the kind is in the state, and an older state without it resumes with randperm."""
    from loongtrain.data.sampler import RANDPERM_MAX, ReplicaSampler, feistel_index

    for n in (1, 2, 3, 7, 1000, 1025):
        assert sorted(feistel_index(i, n, 5) for i in range(n)) == list(range(n))
    assert [feistel_index(i, 1000, 5) for i in range(20)] != [feistel_index(i, 1000, 6) for i in range(20)]
    assert ReplicaSampler(RANDPERM_MAX, 0, 1, 1).permutation == "randperm"
    big = ReplicaSampler(10**12, 0, 2, 3, seed=4)
    assert big.permutation == "feistel" and big._perm_cache == {}
    first = big.indices(5)
    assert len(set(first)) == 3 and all(0 <= i < 10**12 for i in first)
    small = ReplicaSampler(1000, 1, 2, 4, seed=2, permutation="feistel")
    seen = [i for step in range(125) for i in small.indices(step)]
    other = ReplicaSampler(1000, 0, 2, 4, seed=2, permutation="feistel")
    assert sorted(seen + [i for step in range(125) for i in other.indices(step)]) == list(range(1000))
    state = small.state_dict()
    assert state["permutation"] == "feistel"
    fresh = ReplicaSampler(1000, 1, 2, 4, seed=2)
    fresh.load_state_dict(state)
    assert fresh.permutation == "feistel" and fresh.indices(3) == small.indices(3)
    fresh.load_state_dict({k: v for k, v in state.items() if k != "permutation"})
    assert fresh.permutation == "randperm"
