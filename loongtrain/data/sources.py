"""``--corpus`` specs: one corpus (prepared directory or raw) or a weighted mixture, opened as token
streams (docs/data.md). The one corpus reader: training, validation (with or without a split),
``loongtrain eval``'s corpus and its passkey filler all open corpora here.

- ``DIR`` holding a prepared manifest: memory-mapped (:class:`~loongtrain.data.prepared.PreparedStream`);
- anything :func:`~loongtrain.data.corpus.build_corpus` reads: tokenized lazily
  (:class:`~loongtrain.data.packing.TokenStream`);
- ``a=0.7,b=0.3``: a mixture of such corpora (:class:`~loongtrain.data.mixture.MixtureDataset`). A spec
  that is ``stdlib`` or an existing path is always one corpus, even if it holds ``=`` or ``,``.

A corpus's **identity** (:func:`corpus_identity`) is its content: a prepared directory's manifest
digests, a raw corpus's files' sizes and sampled digests (plus their modification times, kept apart;
for ``stdlib``, the installed standard library, its files' names and sizes). The
trainer records it in every checkpoint and a resume compares it (:func:`identity_change`); ``loongtrain
prepare`` records its sources' identity in the manifest.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

from loongtrain.data.corpus import Corpus, build_corpus, corpus_files
from loongtrain.data.mixture import MixtureDataset
from loongtrain.data.packing import PackedDataset, TokenStream
from loongtrain.data.prepared import PreparedStream, is_prepared_dir, read_manifest, sampled_digest, verify_prepared
from loongtrain.data.split import SplitCorpus, selected
from loongtrain.data.tokenizer import Tokenizer


def parse_corpus_spec(spec: str) -> list[tuple[str, float]]:
    """``[(corpus, weight), ...]`` of a ``--corpus`` value (weights as given; one corpus: weight 1).

    ValueError for a weight that does not parse, is negative or not finite, a part without ``=``, a
    corpus named twice (compared by the path it resolves to, :func:`corpus_key`: ``prep`` and ``./prep``, or a
    link and its target, are one corpus), or weights that are all zero. Two names of one content:
    :func:`check_one_name` (it reads the corpora)."""
    if spec == "stdlib" or Path(spec).exists() or "=" not in spec:
        return [(spec, 1.0)]
    parts: list[tuple[str, float]] = []
    for item in spec.split(","):
        name, sep, text = item.strip().rpartition("=")
        if not sep or not name:
            raise ValueError(f"corpus mixture {spec!r}: mixture part {item!r} is not NAME=WEIGHT (e.g. a=0.7,b=0.3)")
        try:
            weight = float(text)
        except ValueError:
            raise ValueError(f"corpus mixture {spec!r}: weight {text!r} of {name!r} is not a number") from None
        if not math.isfinite(weight) or weight < 0:
            raise ValueError(f"corpus mixture {spec!r}: weight {text!r} of {name!r} must be finite and >= 0")
        same = next(((n, w) for n, w in parts if corpus_key(n) == corpus_key(name)), None)
        if same is not None:
            named = f"corpus {name!r} appears twice" if same[0] == name else \
                f"{same[0]!r} and {name!r} are one corpus ({corpus_key(name)})"
            raise ValueError(f"corpus mixture {spec!r}: {named}; name it once, with its weights summed "
                             f"({same[0]}={same[1] + weight:g})")
        parts.append((name, weight))
    if not any(w > 0 for _, w in parts):
        raise ValueError(f"corpus mixture {spec!r}: at least one weight must be positive")
    return parts


def corpus_key(name: str) -> str:
    """The corpus a ``--corpus`` name means: ``stdlib``, or the path it resolves to (links followed)."""
    return name if name == "stdlib" else str(Path(name).resolve())


def check_one_name(spec: str, text_field: str = "text") -> list[dict[str, Any]]:
    """The identity of each corpus of ``spec`` (:func:`corpus_identity`), after checking that no two parts of
    a mixture hold the same content under two paths (a copy of a corpus mixed with itself); ValueError naming
    both otherwise."""
    parts = parse_corpus_spec(spec)
    identities = [source_identity(name, text_field) for name, _ in parts]
    seen: dict[tuple[str, str], tuple[str, float]] = {}
    for (name, weight), identity in zip(parts, identities):
        key = (identity["kind"], identity["content"])
        if key in seen:
            first, first_weight = seen[key]
            raise ValueError(f"corpus mixture {spec!r}: {first!r} and {name!r} hold the same corpus (the same "
                             f"content: {_describe(identity)}); name it once, with its weights summed "
                             f"({first}={first_weight + weight:g})")
        seen[key] = (name, weight)
    return identities


def open_stream(spec: str | Corpus, tokenizer: Tokenizer, *, text_field: str = "text", val_fraction: float = 0.0,
                seed: int = 0, part: str = "all", decode_errors: str = "strict") -> TokenStream | PreparedStream:
    """The token stream of ONE corpus (``part``: "all", or "train"/"validation" of the split by
    ``val_fraction`` and ``seed``; :mod:`loongtrain.data.split`). A prepared directory is checked
    against ``tokenizer`` and by file sizes (its digests: by ``loongtrain train``'s preflight, once, in
    the launcher; :func:`~loongtrain.data.prepared.check_prepared`). ``decode_errors``: how a raw corpus's
    bytes that are not UTF-8 are read (``--decode-errors``)."""
    if isinstance(spec, str) and is_prepared_dir(spec):
        manifest = verify_prepared(spec, tokenizer, digests=False)
        if "objective" in manifest.data:  # rows prepared for a post-training objective, not text
            raise ValueError(f"{spec!r} was prepared for --objective {manifest.data['objective']}: train it with "
                             f"--objective {manifest.data['objective']}, or prepare the text with `loongtrain prepare`")
        return PreparedStream(manifest, tokenizer, selected(manifest.num_documents, val_fraction, seed, part))
    corpus = build_corpus(spec, text_field, decode_errors=decode_errors)
    if selected(0, val_fraction, seed, part) is not None:  # a split applies (checks part and fraction)
        corpus = SplitCorpus(corpus, val_fraction, seed, part)
    return TokenStream(corpus, tokenizer)


def open_dataset(spec: str | Corpus, tokenizer: Tokenizer, seq_len: int, *, text_field: str = "text",
                 val_fraction: float = 0.0, seed: int = 0, part: str = "all", decode_errors: str = "strict",
                 shuffle: bool = True) -> PackedDataset | MixtureDataset:
    """The packed samples of ``spec``: one corpus (:func:`open_stream`) or a mixture of them
    (:class:`~loongtrain.data.mixture.MixtureDataset`, seeded by ``seed``; ``shuffle=False``: each
    corpus's samples in order)."""
    parts = [(spec, 1.0)] if isinstance(spec, Corpus) else parse_corpus_spec(str(spec))
    datasets = [PackedDataset(open_stream(name, tokenizer, text_field=text_field, val_fraction=val_fraction,
                                          seed=seed, part=part, decode_errors=decode_errors), seq_len)
                for name, _ in parts]
    if len(datasets) == 1:
        return datasets[0]
    return MixtureDataset(datasets, [str(n) for n, _ in parts], [w for _, w in parts], seed, shuffle=shuffle)


def first_samples(dataset: PackedDataset | MixtureDataset, count: int) -> list[dict[str, Any]]:
    """Samples ``0 .. count-1`` of ``dataset`` (for a mixture, its global positions), none of them
    wrapped around a corpus's end; ValueError naming the corpus that holds fewer tokens."""
    if isinstance(dataset, MixtureDataset):
        sources = [dataset.source(g) for g in range(count)]
        last: dict[int, int] = {}
        for c, n in sources:
            last[c] = max(last.get(c, -1), n)
        for c, n in last.items():
            _check_holds(dataset.datasets[c], n + 1)
        return [dataset.datasets[c][n] for c, n in sources]
    _check_holds(dataset, count)
    return [dataset[i] for i in range(count)]


def _check_holds(dataset: PackedDataset, count: int) -> None:
    need = count * dataset.seq_len + 1
    have = dataset.stream.ensure(need)
    if have < need:
        raise ValueError(f"corpus {dataset.stream.corpus.name!r} holds {have} tokens: {count} sequence(s) of "
                         f"{dataset.seq_len} tokens need {need}")


def source_identity(spec: str, text_field: str = "text") -> dict[str, Any]:
    """The identity of ONE corpus (module docstring): ``{"corpus", "kind", "content", ...}``; reads a
    prepared manifest, or a raw corpus's file sizes and sampled digests (at most ~1 MiB per file)."""
    if is_prepared_dir(spec):
        manifest = read_manifest(spec)
        digests = [s.get("sha256") for s in manifest.data.get("shards", [])]
        digests.append(manifest.data.get("index", {}).get("sha256"))
        content = hashlib.sha256(json.dumps([digests, manifest.tokenizer.get("identity")]).encode()).hexdigest()
        return {"corpus": spec, "kind": "prepared", "content": content, "tokens": manifest.num_tokens,
                "documents": manifest.num_documents}
    kind, files = corpus_files(spec)
    root = Path(spec) if kind != "stdlib" else None
    content, mtimes, total = hashlib.sha256(text_field.encode()), hashlib.sha256(), 0
    for file in files:
        stat = file.stat()
        name = str(file.relative_to(root)) if root is not None and root.is_dir() else file.name
        # the installed standard library: names and sizes (an upgrade changes them), not 12 MB of reads
        sampled = "" if kind == "stdlib" else sampled_digest(file)
        content.update(f"{name}\0{stat.st_size}\0{sampled}\n".encode())
        mtimes.update(f"{stat.st_mtime_ns}\n".encode())
        total += stat.st_size
    return {"corpus": spec, "kind": "raw", "content": content.hexdigest(), "mtime": mtimes.hexdigest(),
            "files": len(files), "bytes": total}


def corpus_identity(spec: str, text_field: str = "text") -> list[dict[str, Any]]:
    """:func:`source_identity` of every corpus of ``spec`` (one, or each part of a mixture)."""
    return [source_identity(name, text_field) for name, _ in parse_corpus_spec(spec)]


def _describe(record: dict[str, Any]) -> str:
    if record.get("kind") == "prepared":
        return f"prepared, {record.get('tokens')} tokens in {record.get('documents')} documents"
    return f"{record.get('files')} file(s), {record.get('bytes')} bytes"


def identity_change(saved: list[dict[str, Any]], now: list[dict[str, Any]]) -> tuple[str | None, str | None]:
    """``(error, warning)`` comparing a recorded corpus identity with the present one: an error when a
    corpus's content (a manifest's digests, a file's size or sampled digest) changed; a warning when only
    its files' modification times did (bytes between the sampled blocks may have changed)."""
    by_name = {r.get("corpus"): r for r in now}
    for old in saved:
        new = by_name.get(old.get("corpus"))
        if new is None:
            return f"corpus {old.get('corpus')!r} is no longer part of --corpus", None
        if old.get("content") != new.get("content"):
            return (f"corpus {old.get('corpus')!r} changed (then: {_describe(old)}; now: {_describe(new)})"), None
    for old in saved:
        new = by_name[old.get("corpus")]
        if old.get("mtime") is not None and old.get("mtime") != new.get("mtime"):
            return None, (f"corpus {old.get('corpus')!r}: its files were modified (same sizes and sampled "
                          f"bytes, {_describe(new)})")
    return None, None
