"""Corpus checks before any worker starts (docs/data.md): each corpus of a run can be read, is text (or a
prepared corpus of the run's tokenizer) and holds a sample; a large raw corpus is checked on a sample
(:data:`SAMPLE_ALL_BYTES`; the reader still checks every byte as it reads). Every failure is a ValueError
naming the option, the corpus and the cause."""

from __future__ import annotations

import logging

from loongtrain.data.corpus import FilesCorpus, build_corpus, non_text_chars, sample_documents
from loongtrain.data.packing import TokenStream
from loongtrain.data.prepared import check_prepared, is_prepared_dir
from loongtrain.data.sources import check_one_name, open_stream, parse_corpus_spec
from loongtrain.data.tokenizer import Tokenizer

log = logging.getLogger("loongtrain.train")


def check_corpora(corpus: str, val_corpus: str, tokenizer: Tokenizer, seq_len: int, *, val_fraction: float = 0.0,
                  seed: int = 0, decode_errors: str = "strict") -> None:
    """Every corpus of ``--corpus`` and ``--val-corpus`` (each part of a mixture) can be read and holds one
    sample of ``seq_len + 1`` tokens (with ``--val-fraction``, the training part of each ``--corpus``
    too); a raw one is text (:func:`check_text`), a prepared one matches ``tokenizer``, its counts its
    files, and passes its quick checksum check (:func:`loongtrain.data.prepared.check_prepared`); no two parts
    of a mixture are one corpus (by path: :func:`~loongtrain.data.sources.parse_corpus_spec`; by content:
    :func:`~loongtrain.data.sources.check_one_name`)."""
    for flag, spec in (("--corpus", corpus), ("--val-corpus", val_corpus)):
        if not spec:
            continue
        try:
            parts = parse_corpus_spec(spec)
        except ValueError as exc:
            raise ValueError(f"{flag} {spec!r}: {exc}") from None
        for name, _ in parts:
            where = f"{flag} {spec!r}" if name == spec else f"{flag} {spec!r}, corpus {name!r}"
            if is_prepared_dir(name):
                try:
                    check_prepared(name, tokenizer, seq_len + 1)
                except ValueError as exc:
                    raise ValueError(f"{where}: {exc}") from None
            else:
                check_raw_corpus(name, tokenizer, seq_len, where, decode_errors)
            if flag == "--corpus" and val_fraction:
                _check_training_part(name, tokenizer, where, seq_len, val_fraction, seed, decode_errors)
        if len(parts) > 1:  # each part is whole: now one content under two names is named as such
            try:
                check_one_name(spec)
            except ValueError as exc:
                raise ValueError(f"{flag} {spec!r}: {exc}") from None


def _check_training_part(name: str, tokenizer: Tokenizer, where: str, seq_len: int, val_fraction: float, seed: int,
                         decode_errors: str) -> None:
    """The documents ``--val-fraction`` leaves for training hold one sample."""
    need = seq_len + 1
    try:
        have = open_stream(name, tokenizer, val_fraction=val_fraction, seed=seed, part="train",
                           decode_errors=decode_errors).ensure(need)
    except (ValueError, OSError) as exc:
        raise ValueError(f"{where}: {exc}") from None
    if have < need:
        raise ValueError(f"{where}: --val-fraction {val_fraction} leaves {have} tokens for training; one "
                         f"sample needs --seq-len + 1 = {need} (lower --val-fraction)")


#: a raw corpus of up to this many bytes is read whole by the preflight; a larger one is sampled
#: (:func:`loongtrain.data.corpus.sample_documents`; the reader still checks every byte as it reads)
SAMPLE_ALL_BYTES = 64 << 20


def check_raw_corpus(spec: str, tokenizer: Tokenizer, seq_len: int, where: str, decode_errors: str = "strict") -> None:
    """A raw corpus can be read as text (every document of its files, or a sample of a large one) and
    holds at least ``seq_len + 1`` tokens."""
    try:
        corpus = build_corpus(spec, decode_errors=decode_errors)
    except (ImportError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None
    need = seq_len + 1
    if isinstance(corpus, FilesCorpus) and spec != "stdlib":
        size = sum(f.stat().st_size for f in corpus.files)
        if not size:
            raise ValueError(f"{where} is empty (every file has 0 bytes)")
        sampled = size > SAMPLE_ALL_BYTES
        if check_text(corpus, tokenizer, where, decode_errors, sample=sampled, need=need) >= need:
            return  # the sample alone holds a sample's tokens
    try:
        have = TokenStream(corpus, tokenizer).ensure(need)
    except (ValueError, OSError) as exc:
        raise ValueError(f"{where}: {exc}") from None
    if have < need:
        raise ValueError(f"{where} holds {have} tokens; one sample needs --seq-len + 1 = {need}")


#: a corpus whose first characters are more than this share control characters or U+FFFD gets a warning
NON_TEXT_WARNING = 0.3
_SAMPLE_CHARS = 1 << 22


def check_text(corpus: FilesCorpus, tokenizer: Tokenizer, where: str, decode_errors: str = "strict", *,
               sample: bool = False, need: int = 0) -> int:
    """Read every document of a files corpus once (every line of every file is decoded and parsed, so a
    bad byte or line anywhere is found now), or with ``sample`` the documents of
    :func:`~loongtrain.data.corpus.sample_documents`: ValueError when no document holds a token; a warning
    when the first 4 Mi characters read are mostly control characters or replaced bytes (U+FFFD). Returns
    the tokens (EOS included) counted in a sample, up to about ``need`` (0 without ``sample``)."""
    def read(errors: str):
        if sample:
            return sample_documents(corpus.files, corpus.text_field, errors)
        return FilesCorpus(corpus.files, corpus.name, corpus.text_field, decode_errors=errors)

    has_tokens, tokens = False, 0
    try:
        for doc in read(decode_errors):
            if sample and tokens < need:
                count = len(tokenizer.encode(doc))
                tokens, has_tokens = tokens + count + 1, has_tokens or count > 0
            elif not has_tokens and doc:
                has_tokens = len(tokenizer.encode(doc[:4096])) > 0
        sampled = non_text = 0  # the share of non-text, whatever --decode-errors drops or replaces
        for doc in read("replace"):
            part = doc[: _SAMPLE_CHARS - sampled]
            sampled, non_text = sampled + len(part), non_text + non_text_chars(part)
            if sampled >= _SAMPLE_CHARS:
                break
    except (ValueError, OSError) as exc:
        raise ValueError(f"{where}: {exc}") from None
    if not has_tokens:
        raise ValueError(f"{where}: its documents hold no tokens (every document is empty after tokenization "
                         f"with {tokenizer.name!r})")
    if sampled and non_text / sampled > NON_TEXT_WARNING:
        log.warning("%s: %.0f%% of its first %d characters are control characters or undecodable bytes "
                    "(U+FFFD): is it text?", where, 100 * non_text / sampled, sampled)
    if decode_errors != "strict":
        log.info("%s, --decode-errors %s: bytes that are not UTF-8 are %s", where, decode_errors,
                 "replaced by U+FFFD" if decode_errors == "replace" else "dropped")
    return tokens
