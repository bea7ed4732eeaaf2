"""``loongtrain prepare``'s work: tokenize corpora once into a prepared directory (format:
:mod:`loongtrain.data.prepared`; docs/data.md).

The parent reads the documents in corpus order and cuts them into shards of about ``shard_bytes`` bytes
of text (so the output does not depend on the number of workers); worker processes tokenize a shard
each, write it and its digests, and return its document lengths; the parent writes the document index
and, last, the manifest.

Bad input found while reading (a line that is not valid JSON, naming ``FILE:LINE``) raises ValueError:
the workers stop and the output directory is left as it was. The first shard's documents are read before
the workers start (an empty corpus is refused there); a bad line later in the corpus stops them after
they started.

The output directory follows the ownership rule of :mod:`loongtrain._files` (never the current
directory, a directory holding a source, or one holding files loongtrain did not write) and is locked
for the run: a second prepare into it exits 2 naming the first.

Crash safety: a prepare first writes the marker :data:`~loongtrain.data.prepared.IN_PROGRESS` into the
output directory, writes every shard into ``DIR/.tmp-<pid>/``, then (only then) removes the previous
corpus's manifest and shards, renames the new shards to ``DIR/shards`` (atomic) and writes
``manifest.json`` (atomically, by rename), and removes the marker. A directory without the manifest is
never read as a corpus. A bad input, a full disk or Ctrl-C removes this run's temporary files (the
previous corpus, under ``--overwrite``, is still whole); a crash leaves them, and a rerun finds the
marker, removes the interrupted run's files and starts again. A finished directory with the same
request (sources, tokenizer, text field, ``--decode-errors``, shard size) and the same sources'
identity (their sizes, sampled digests and modification times,
:func:`~loongtrain.data.sources.source_identity`) is left as it is; a changed source is refused unless
``--overwrite`` (prepare again).
"""

from __future__ import annotations

import itertools
import json
import logging
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loongtrain._files import (
    LOCK_FILE,
    MARKER,
    Folder,
    Output,
    OutputLock,
    check_output,
    remove_folder,
    remove_owned,
    write_atomic,
    write_bytes,
)
from loongtrain.data.corpus import Corpus, FilesCorpus, build_corpus
from loongtrain.data.prepared import (
    FORMAT,
    FORMAT_VERSION,
    IN_PROGRESS,
    INDEX_FILE,
    MANIFEST,
    SHARD_DIR,
    buffer_digests,
    read_manifest,
    token_dtype,
    tokenizer_identity,
)
from loongtrain.data.prepared_rows import PreparedRows, RowEncoder, tokenize_rows_shard
from loongtrain.data.sources import source_identity
from loongtrain.data.tokenizer import HFTokenizer, Tokenizer, build_tokenizer

log = logging.getLogger("loongtrain.data")

DEFAULT_SHARD_BYTES = 64 << 20
#: the request fields of manifests written before the field existed: what they prepared
REQUEST_DEFAULTS = {"min_doc_tokens": 0, "decode_errors": "strict"}


@dataclass(frozen=True)
class Sharding:
    """How :func:`prepare` turns the sources' documents into shards: the JSON field holding the text, the reading of
    bytes that are not UTF-8 (strict: an error; replace; ignore), the characters of text a shard, the fewest tokens
    of a document kept (EOS not counted; 0 keeps all). The manifest records it; a rerun must match it."""

    text_field: str = "text"
    shard_bytes: int = DEFAULT_SHARD_BYTES
    decode_errors: str = "strict"
    min_doc_tokens: int = 0


SHARDING = Sharding()


@dataclass(frozen=True)
class PrepareResult:
    """What :func:`prepare` did: ``"prepared"`` or ``"unchanged"`` (already finished), and the counts."""

    status: str
    out: Path
    num_tokens: int
    num_documents: int
    seconds: float


def _wrote(path: Path) -> bool:
    """A directory an older prepare wrote (before the ownership marker): its marker or a loongtrain manifest."""
    if (path / IN_PROGRESS).exists():
        return True
    try:
        return json.loads((path / MANIFEST).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


#: what `loongtrain prepare` writes into --out (loongtrain._files: the ownership rule)
SHARD_FOLDER = Folder(("tokens-*.bin", "targets-*.bin", INDEX_FILE, MANIFEST))  # shards/, and .tmp-<pid>/ before it
OUTPUT = Output("prepare", "--out", Folder((MANIFEST, MANIFEST + ".tmp", IN_PROGRESS),
                                           ((SHARD_DIR, SHARD_FOLDER), (".tmp-*", SHARD_FOLDER))), _wrote)


def request(sources: list[str], tokenizer: Tokenizer, sharding: Sharding) -> dict[str, Any]:
    """What identifies a prepare: the manifest's fields a rerun must match to count as already done."""
    resolved = [s if s == "stdlib" else str(Path(s).resolve()) for s in sources]
    return {"sources": resolved, **asdict(sharding),
            "tokenizer": {"name": tokenizer.name, "identity": tokenizer_identity(tokenizer),
                          "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id}}


def check_out_dir(out: Path, want: dict[str, Any], overwrite: bool,
                  identity: list[dict[str, Any]] | None = None) -> str:
    """``"done"`` (a finished prepare of the same request and unchanged sources), ``"fresh"`` (empty or
    absent) or ``"restart"`` (an interrupted prepare, or ``overwrite``); ValueError for anything else
    (``out`` passed :func:`~loongtrain._files.check_output`)."""
    if not out.exists() or not any(p.name not in (MARKER, LOCK_FILE) for p in out.iterdir()):
        return "fresh"
    if (out / MANIFEST).is_file() and not overwrite:
        manifest = read_manifest(out)  # a newer format raises here
        have = {k: manifest.data.get(k, REQUEST_DEFAULTS.get(k)) for k in want}
        diff = [k for k in want if have[k] != want[k]]
        if diff:
            raise ValueError(f"--out {str(out)!r} holds a prepared corpus with another {', '.join(diff)} "
                             f"({out / MANIFEST}); pass --overwrite to replace it, or choose another --out")
        changed = _changed_sources(manifest.data.get("source_identity"), identity or [])
        if changed:
            raise ValueError(f"--out {str(out)!r} was prepared from {changed}; pass --overwrite to prepare it "
                             f"again, or choose another --out")
        return "done"
    return "restart"


def _changed_sources(saved: list[dict[str, Any]] | None, now: list[dict[str, Any]]) -> str:
    """Which source changed since the manifest recorded ``saved`` ("" when none)."""
    if not saved:
        return "sources whose identity it does not record (an older loongtrain)"
    for old, new in zip(saved, now):
        if old != new:
            what = "content" if old.get("content") != new.get("content") else "modification time"
            return (f"an earlier version of {old.get('corpus')!r} (its {what} changed since: {old.get('files')} "
                    f"file(s) of {old.get('bytes')} bytes then, {new.get('files')} of {new.get('bytes')} now)")
    return ""


def prepare(
    sources: list[str],
    out: str | Path,
    tokenizer: str | Tokenizer = "byte",
    sharding: Sharding = SHARDING,
    *,
    workers: int = 0,
    overwrite: bool = False,
    progress: bool | None = None,
    on_shard: Callable[[int], None] | None = None,
    rows: Callable[[Tokenizer], RowEncoder | None] | None = None,
) -> PrepareResult:
    """Tokenize ``sources`` (any ``--corpus`` spec each, concatenated in order) into directory ``out``, cut into
    shards as ``sharding`` says (:class:`Sharding`: what the manifest records).

    ``workers``: processes (0: the cores; 1: in this process). ``progress``: a tqdm bar on stderr (None: when tqdm is
    installed and stderr is a terminal). ``on_shard(k)`` is called after shard ``k`` is written (tests
    use it to simulate a crash). ``rows``: an objective's encoder of its rows for the
    tokenizer (:class:`~loongtrain.data.prepared_rows.RowEncoder`; ``--objective sft|dpo``'s): the sources are
    ``.jsonl`` conversations encoded by it, their target masks stored beside the tokens
    (:mod:`loongtrain.data.conversations`). Raises ValueError for bad input (module
    docstring: which directories are accepted), :class:`~loongtrain._files.DiskFullError` for a full disk."""
    t0 = time.perf_counter()
    text_field, shard_bytes, decode_errors = sharding.text_field, sharding.shard_bytes, sharding.decode_errors
    min_doc_tokens = sharding.min_doc_tokens
    if not sources:
        raise ValueError("prepare needs at least one corpus")
    if shard_bytes < 1:
        raise ValueError(f"--shard-bytes={shard_bytes} must be positive")
    if workers < 0:
        raise ValueError(f"--workers={workers} must be >= 0 (0: one per core)")
    if min_doc_tokens < 0:
        raise ValueError(f"--min-doc-tokens={min_doc_tokens} must be >= 0 (0: keep every document)")
    tok = build_tokenizer(tokenizer)
    encoder = rows(tok) if rows is not None else None
    if encoder is not None and encoder.documents != 1 and min_doc_tokens:
        raise ValueError(f"--min-doc-tokens applies to corpora of one document a row, not --objective "
                         f"{encoder.prepared_for}'s")
    corpora = ([PreparedRows(s, encoder, decode_errors) for s in sources] if encoder is not None else
               [build_corpus(s, text_field, decode_errors) for s in sources])
    inputs = [s for s in sources if s != "stdlib"] + ([tok.name] if isinstance(tok, HFTokenizer) else [])
    out = check_output(OUTPUT, out, inputs=inputs)
    want = request(sources, tok, sharding)
    if encoder is not None:  # the manifest records what made the tokens and targets
        want.update(encoder.record())
    identity = [source_identity(s, text_field) for s in sources]
    state = check_out_dir(out, want, overwrite, identity)
    if state == "done":
        manifest = read_manifest(out)
        log.info("%s is already prepared (%d tokens, %d documents): nothing to do", out,
                 manifest.num_tokens, manifest.num_documents)
        return PrepareResult("unchanged", out, manifest.num_tokens, manifest.num_documents,
                             time.perf_counter() - t0)
    created = not out.exists()
    try:
        with OutputLock(OUTPUT, out):
            _clear_leftovers(out, state)
            try:
                manifest = _prepare_into(out, corpora, encoder or tok, want, identity, workers, shard_bytes,
                                         progress, on_shard)
            except (ValueError, OSError, KeyboardInterrupt):  # bad input, a full disk, Ctrl-C: remove our files
                _remove_partial(out, fresh=state == "fresh")
                raise
    finally:
        if created and out.is_dir() and not any(out.iterdir()):  # a failure removed all it wrote: DIR as before
            out.rmdir()
    seconds = time.perf_counter() - t0
    log.info("prepared %s: %d tokens, %d documents, %d shards in %.1f s (%.3g tokens/s)", out,
             manifest["num_tokens"], manifest["num_documents"], len(manifest["shards"]), seconds,
             manifest["num_tokens"] / seconds)
    return PrepareResult("prepared", out, manifest["num_tokens"], manifest["num_documents"], seconds)


def _prepare_into(out: Path, corpora: list[Corpus], tok: Tokenizer | RowEncoder, want: dict[str, Any],
                  identity: list[dict[str, Any]], workers: int, shard_bytes: int, progress: bool | None,
                  on_shard: Callable[[int], None] | None) -> dict[str, Any]:
    """The prepare itself, in the locked directory ``out``: shards in ``.tmp-<pid>``, then the swap."""
    write_atomic(out / IN_PROGRESS, json.dumps(want))
    tmp = out / f".tmp-{os.getpid()}"
    tmp.mkdir()
    dtype = token_dtype((tok.tokenizer if isinstance(tok, RowEncoder) else tok).vocab_size)
    bar = None
    if _want_progress(progress):
        from tqdm import tqdm

        bar = tqdm(total=_total_bytes(corpora), unit="B", unit_scale=True, desc="prepare", file=sys.stderr)

    def written(k: int, text_bytes: int) -> None:  # shard k is written: the bar, and the caller's hook
        if bar is not None:
            bar.update(text_bytes)
        if on_shard is not None:
            on_shard(k)

    try:
        shards, lengths = _write_shards(corpora, tok, tmp, dtype, workers or os.cpu_count() or 1, shard_bytes,
                                        written, want["min_doc_tokens"])
    finally:
        if bar is not None:
            bar.close()
    _check_kept(lengths, shards, want["min_doc_tokens"])
    num_tokens = int(lengths.sum())
    if num_tokens == (0 if isinstance(tok, RowEncoder) else len(lengths)):
        raise ValueError(f"every one of the {len(lengths)} documents of {want['sources']} is empty: nothing to "
                         f"prepare")
    offsets = np.zeros(len(lengths) + 1, dtype="<u8")
    np.cumsum(lengths, out=offsets[1:])
    write_bytes(tmp / INDEX_FILE, memoryview(offsets).cast("B"))
    manifest = {"format": FORMAT, "version": FORMAT_VERSION, **want, "source_identity": identity,
                "dtype": dtype.str, "num_tokens": num_tokens, "num_documents": len(lengths), "shards": shards,
                "index": buffer_digests(offsets)}
    write_atomic(tmp / MANIFEST, json.dumps(manifest, indent=1))  # every byte written before the swap
    (out / MANIFEST).unlink(missing_ok=True)  # from here the directory reads as interrupted until it is whole
    old = out / SHARD_DIR
    if old.exists() and not _discard(old):
        raise ValueError(f"{old} holds files loongtrain did not write; they are never deleted: move them elsewhere")
    os.rename(tmp, out / SHARD_DIR)
    os.replace(out / SHARD_DIR / MANIFEST, out / MANIFEST)
    (out / IN_PROGRESS).unlink()
    return manifest


def _clear_leftovers(out: Path, state: str) -> None:
    """Under the lock: an interrupted prepare's files go; beside a finished corpus (``--overwrite``) only
    stale temporary shards do, the corpus itself stays until the new one is whole."""
    if state != "restart":
        return
    if (out / MANIFEST).is_file():
        for stale in out.glob(".tmp-*"):
            _discard(stale)
        return
    log.warning("%s: removing the files of an interrupted prepare", out)
    remove_owned(OUTPUT, out)


def _remove_partial(out: Path, fresh: bool) -> None:
    """This run's files after a failure: its temporary shards and its in-progress marker (a finished corpus
    beside them stays); in a directory that was ``fresh``, everything it wrote."""
    _discard(out / f".tmp-{os.getpid()}")
    if fresh and not (out / MANIFEST).is_file():
        remove_owned(OUTPUT, out)
        (out / MARKER).unlink(missing_ok=True)
    elif (out / MANIFEST).is_file() or not (out / SHARD_DIR).exists():
        (out / IN_PROGRESS).unlink(missing_ok=True)


def _discard(folder: Path) -> bool:
    """Delete a shard folder (``shards/``, ``.tmp-<pid>/``) as far as loongtrain wrote it (loongtrain._files):
    True when it is gone (or was not there)."""
    if not folder.is_dir() or folder.is_symlink():
        return not (folder.exists() or folder.is_symlink())
    return remove_folder(SHARD_FOLDER, folder)


def _check_kept(lengths: np.ndarray, shards: list[dict[str, Any]], min_doc_tokens: int) -> None:
    """With ``--min-doc-tokens``: log how many documents were kept; ValueError when none was."""
    if not min_doc_tokens:
        return
    dropped = sum(s["dropped_documents"] for s in shards)
    if not len(lengths):
        raise ValueError(f"--min-doc-tokens {min_doc_tokens}: none of the {dropped} documents has that many tokens")
    log.info("--min-doc-tokens %d: kept %d of %d documents", min_doc_tokens, len(lengths), len(lengths) + dropped)


def _want_progress(progress: bool | None) -> bool:
    try:
        import tqdm  # noqa: F401
    except ImportError:
        return False
    return sys.stderr.isatty() if progress is None else progress


def _total_bytes(corpora: list[Corpus]) -> int | None:
    if all(isinstance(c, FilesCorpus) for c in corpora):
        return sum(f.stat().st_size for c in corpora for f in c.files)  # type: ignore[attr-defined]
    return None


def _shard_texts(corpora: list[Corpus], shard_bytes: int) -> Iterator[tuple[int, list[str]]]:
    """(shard number, its documents): consecutive documents of about ``shard_bytes`` characters."""
    batch: list[str] = []
    size, k = 0, 0
    for corpus in corpora:
        for doc in corpus:
            batch.append(doc)
            size += len(doc)
            if size >= shard_bytes:
                yield k, batch
                batch, size, k = [], 0, k + 1
    if batch or k == 0:
        yield k, batch


def _write_shards(corpora: list[Corpus], tok: Tokenizer | RowEncoder, tmp: Path, dtype: np.dtype, workers: int,
                  shard_bytes: int, written: Callable[[int, int], None],
                  min_doc_tokens: int = 0) -> tuple[list[dict[str, Any]], np.ndarray]:
    """The shards of ``corpora`` tokenized into ``tmp`` (``workers`` processes), ``written(k, text_bytes)`` after
    shard ``k``: ``(their records, every kept document's length)``."""
    tasks = ((k, docs, str(tmp), dtype.str, min_doc_tokens) for k, docs in _shard_texts(corpora, shard_bytes))
    # the first shard's documents are read before any worker starts (a bad line there: no worker ever ran)
    first = next(tasks)
    if not first[1]:
        raise ValueError(f"the corpus {', '.join(repr(c.name) for c in corpora)} holds no documents: nothing "
                         f"to prepare")
    tasks = itertools.chain([first], tasks)
    shards: list[dict[str, Any]] = []
    lengths: list[np.ndarray] = []
    pool = None
    try:
        if workers > 1:
            context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods()
                                                  else "spawn")
            pool = _start_pool(context, workers, tok)
            results = pool.imap(_tokenize_shard, tasks)
        else:
            _init_worker(tok, parallel_tokenizer=True)
            results = map(_tokenize_shard, tasks)
        for k, record, doc_lengths, text_bytes in results:
            shards.append(record)
            lengths.append(doc_lengths)
            written(k, text_bytes)
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
    return shards, np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)


_WORKER_TOKENIZER: Tokenizer | RowEncoder | None = None
_HELD = {signal.SIGINT, signal.SIGTERM}  # held while the pool's processes start


def _start_pool(context: Any, workers: int, tok: Tokenizer | RowEncoder) -> Any:
    """The tokenizer pool, its processes started with Ctrl-C and SIGTERM held until their initializer has set
    its own handlers (a Ctrl-C before it ran printed a worker's traceback; the pool's SIGTERM before it ran
    reached the parent's handler and left the worker waiting for work forever); the parent stops the pool and
    prints one line."""
    block = hasattr(signal, "pthread_sigmask")  # held, not lost: the parent sees them once the pool is up
    if block:
        signal.pthread_sigmask(signal.SIG_BLOCK, _HELD)
    try:
        return context.Pool(workers, initializer=_init_worker, initargs=(tok,))
    finally:
        if block:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _HELD)


def _init_worker(tok: Tokenizer | RowEncoder, parallel_tokenizer: bool = False) -> None:
    global _WORKER_TOKENIZER
    if not parallel_tokenizer:  # a pool process: one per core already, no tokenizer thread pool on top
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        os.environ["RAYON_NUM_THREADS"] = "1"
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the parent stops the pool, prints one line
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # pool.terminate(): end quietly (not the parent's handler)
        if hasattr(signal, "pthread_sigmask"):  # started with both held (_start_pool): handled from here on
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _HELD)
    _WORKER_TOKENIZER = tok


def _tokenize_shard(task: tuple[int, list[str], str, str, int]) -> tuple[int, dict[str, Any], np.ndarray, int]:
    """Tokenize one shard's documents (EOS after each), keep those of at least ``min_doc_tokens`` tokens,
    write ``tokens-<k>.bin``; return its record."""
    k, docs, tmp, dtype, min_doc_tokens = task
    tok = _WORKER_TOKENIZER
    assert tok is not None
    if isinstance(tok, RowEncoder):  # --objective sft|dpo: rows (and their target masks)
        return tokenize_rows_shard(task, tok)
    encoded = [e for e in tok.encode_many(docs) if e.size >= min_doc_tokens]
    lengths = np.fromiter((e.size + 1 for e in encoded), dtype=np.int64, count=len(encoded))
    tokens = np.empty(int(lengths.sum()), dtype=np.dtype(dtype))
    ends = np.cumsum(lengths)
    for e, end in zip(encoded, ends):
        tokens[end - e.size - 1 : end - 1] = e
    tokens[ends - 1] = tok.eos_id
    name = f"tokens-{k:05d}.bin"
    write_bytes(Path(tmp) / name, memoryview(tokens).cast("B"))
    return k, {"file": name, "num_tokens": int(tokens.size), "num_documents": len(encoded),
               **({"dropped_documents": len(docs) - len(encoded)} if min_doc_tokens else {}),
               **buffer_digests(tokens)}, lengths, sum(len(d) for d in docs)
