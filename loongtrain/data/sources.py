"""``--corpus`` specs: one corpus (prepared directory or raw) or a weighted mixture, opened as token
streams (docs/design.md §12).

- ``DIR`` holding a prepared manifest: memory-mapped (:class:`~loongtrain.data.prepared.PreparedStream`);
- anything :func:`~loongtrain.data.corpus.build_corpus` reads: tokenized lazily
  (:class:`~loongtrain.data.packing.TokenStream`);
- ``a=0.7,b=0.3``: a mixture of such corpora (:class:`~loongtrain.data.mixture.MixtureDataset`). A spec
  that is ``stdlib`` or an existing path is always one corpus, even if it holds ``=`` or ``,``.
"""

from __future__ import annotations

import math
from pathlib import Path

from loongtrain.data.corpus import Corpus, build_corpus
from loongtrain.data.packing import TokenStream
from loongtrain.data.prepared import PreparedStream, is_prepared_dir, verify_prepared
from loongtrain.data.split import SplitCorpus, selected
from loongtrain.data.tokenizer import Tokenizer


def parse_corpus_spec(spec: str) -> list[tuple[str, float]]:
    """``[(corpus, weight), ...]`` of a ``--corpus`` value (weights as given; one corpus: weight 1).

    ValueError for a weight that does not parse, is negative or not finite, a part without ``=``, a
    repeated corpus, or weights that are all zero."""
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
        if name in (n for n, _ in parts):
            raise ValueError(f"corpus mixture {spec!r}: corpus {name!r} appears twice")
        parts.append((name, weight))
    if not any(w > 0 for _, w in parts):
        raise ValueError(f"corpus mixture {spec!r}: at least one weight must be positive")
    return parts


def open_stream(spec: str | Corpus, tokenizer: Tokenizer, *, text_field: str = "text", val_fraction: float = 0.0,
                seed: int = 0, part: str = "all", decode_errors: str = "strict") -> TokenStream | PreparedStream:
    """The token stream of ONE corpus (``part``: "all", or "train"/"validation" of the split by
    ``val_fraction`` and ``seed``; :mod:`loongtrain.data.split`). A prepared directory is checked
    against ``tokenizer`` and by file sizes (its digests: by ``loongtrain train``'s preflight, once, in
    the launcher; :func:`~loongtrain.data.prepared.check_prepared`). ``decode_errors``: how a raw corpus's
    bytes that are not UTF-8 are read (``--decode-errors``)."""
    if isinstance(spec, str) and is_prepared_dir(spec):
        manifest = verify_prepared(spec, tokenizer, digests=False)
        return PreparedStream(manifest, tokenizer, selected(manifest.num_documents, val_fraction, seed, part))
    corpus = build_corpus(spec, text_field, decode_errors=decode_errors)
    if selected(0, val_fraction, seed, part) is not None:  # a split applies (checks part and fraction)
        corpus = SplitCorpus(corpus, val_fraction, seed, part)
    return TokenStream(corpus, tokenizer)
