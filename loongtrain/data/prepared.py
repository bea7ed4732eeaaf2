"""The on-disk format of a prepared (tokenized once) corpus, and reading it by memory map (docs/data.md).

A prepared directory holds::

    manifest.json            written last: the directory is finished iff it exists (and verifies)
    shards/tokens-00000.bin  the token stream doc_0 + [eos] + doc_1 + [eos] + ..., split at document
    shards/tokens-00001.bin  boundaries into shards; little-endian uint16 when the vocabulary fits in
    ...                      65536 ids, else uint32
    shards/documents.idx     uint64 offsets of every document's first token in the stream, plus the
                             stream length (num_documents + 1 values)

The stream is exactly what :class:`~loongtrain.data.packing.TokenStream` builds from the same corpus
and tokenizer, so :class:`PreparedStream` stands in for it under the same
:class:`~loongtrain.data.packing.PackedDataset` and sampler: batches are bit-identical to the raw read.

The manifest records the format version (:data:`FORMAT_VERSION`; a newer one is refused), the
tokenizer's identity (:func:`tokenizer_identity`), the counts, and per file its size, its SHA-256 and a
*sampled digest*. Verification rule (:func:`verify_prepared`): the quick check run before every training
start checks every file's size (truncation) and its sampled digest, the SHA-256 of
:data:`SAMPLE_BLOCKS` blocks of :data:`SAMPLE_BYTES` bytes at evenly spaced offsets (first and last block
included), so it reads at most ~1 MiB per file whatever the corpus size; ``full=True`` (``loongtrain
prepare --verify``) hashes every byte.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from loongtrain.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

FORMAT = "loongtrain-prepared"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
#: present while a prepare runs (removed when the manifest is written): marks an interrupted prepare
IN_PROGRESS = ".prepare-in-progress"
SHARD_DIR = "shards"
INDEX_FILE = "documents.idx"
SAMPLE_BLOCKS = 16
SAMPLE_BYTES = 64 * 1024


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab <= 65536), else uint32 (little-endian)."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def tokenizer_identity(tokenizer: Tokenizer) -> str:
    """``"byte"`` for the byte tokenizer; for a Hugging Face tokenizer ``sha256:`` of its
    ``tokenizer.json`` (or, for a directory without one, of its vocabulary files in name order), plus
    its EOS id: two tokenizers with the same identity produce the same ids."""
    if isinstance(tokenizer, ByteTokenizer):
        return "byte"
    if not isinstance(tokenizer, HFTokenizer):
        return f"{type(tokenizer).__name__}:{tokenizer.name}:{tokenizer.vocab_size}:{tokenizer.eos_id}"
    path = Path(tokenizer.name)
    files = [path] if path.is_file() else [path / "tokenizer.json"]
    if not files[0].is_file():
        names = ("vocab", "merges", "tokenizer", "special_tokens_map", "added_tokens", "spiece")
        files = sorted(p for p in path.iterdir() if p.is_file() and p.name.startswith(names))
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode() + b"\0" + file.read_bytes())
    return f"sha256:{digest.hexdigest()}:eos={tokenizer.eos_id}"


def file_digests(path: Path) -> dict[str, Any]:
    """``{"size", "sha256", "sampled"}`` of a file (see the module docstring for the sampled rule)."""
    full = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            full.update(block)
    return {"size": path.stat().st_size, "sha256": full.hexdigest(), "sampled": sampled_digest(path)}


def buffer_digests(data: np.ndarray) -> dict[str, Any]:
    """:func:`file_digests` of the file ``data.tofile`` writes, computed from memory (no read back)."""
    raw = memoryview(np.ascontiguousarray(data)).cast("B")
    return {"size": raw.nbytes, "sha256": hashlib.sha256(raw).hexdigest(),
            "sampled": _sampled(raw.nbytes, lambda start, length: raw[start : start + length])}


def sampled_digest(path: Path) -> str:
    """SHA-256 of :data:`SAMPLE_BLOCKS` evenly spaced blocks of :data:`SAMPLE_BYTES` (the whole file if smaller)."""
    with open(path, "rb") as f:
        def read(start: int, length: int) -> bytes:
            f.seek(start)
            return f.read(length)

        return _sampled(path.stat().st_size, read)


def _sampled(size: int, read: Callable[[int, int], Any]) -> str:
    """The sampled digest of ``size`` bytes, ``read(start, length)`` returning a piece of them."""
    if size <= SAMPLE_BLOCKS * SAMPLE_BYTES:
        return hashlib.sha256(read(0, size)).hexdigest()
    digest = hashlib.sha256()
    last = size - SAMPLE_BYTES
    for k in range(SAMPLE_BLOCKS):
        digest.update(read(last * k // (SAMPLE_BLOCKS - 1), SAMPLE_BYTES))
    return digest.hexdigest()


def is_prepared_dir(path: str | Path) -> bool:
    """True for a directory that holds a prepare's manifest or an interrupted prepare's marker."""
    path = Path(path)
    return path.is_dir() and ((path / MANIFEST).is_file() or (path / IN_PROGRESS).exists())


@dataclass(frozen=True)
class Manifest:
    """A parsed ``manifest.json`` (the directory it describes is ``root``)."""

    root: Path
    data: dict[str, Any]

    @property
    def num_tokens(self) -> int:
        return int(self.data["num_tokens"])

    @property
    def num_documents(self) -> int:
        return int(self.data["num_documents"])

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.data["dtype"])

    @property
    def tokenizer(self) -> dict[str, Any]:
        return self.data["tokenizer"]

    def files(self) -> list[tuple[Path, dict[str, Any]]]:
        """(path, its record) of every shard, then the document index."""
        out = [(self.root / SHARD_DIR / s["file"], s) for s in self.data["shards"]]
        return out + [(self.root / SHARD_DIR / INDEX_FILE, self.data["index"])]


def read_manifest(path: str | Path) -> Manifest:
    """The manifest of prepared directory ``path``; ValueError for an interrupted prepare, a file that is
    not a loongtrain manifest, or a newer format version (naming the file)."""
    root = Path(path)
    file = root / MANIFEST
    if not file.is_file():
        if (root / IN_PROGRESS).exists():
            raise ValueError(f"{str(root)!r} is an interrupted `loongtrain prepare` (no {MANIFEST}); run the "
                             f"prepare again to finish it")
        raise ValueError(f"{str(root)!r} is not a prepared corpus (no {MANIFEST})")
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{file}: not valid JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else None
        raise ValueError(f"{file}: not a {FORMAT} manifest (format {found!r})")
    version = data.get("version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ValueError(f"{file}: format version {version!r} is newer than this loongtrain reads "
                         f"({FORMAT_VERSION}); upgrade loongtrain or prepare the corpus again")
    missing = [key for key in _REQUIRED if key not in data]
    if missing:
        raise ValueError(f"{file}: not a complete manifest (no {', '.join(map(repr, missing))}); prepare the "
                         f"corpus again")
    return Manifest(root, data)


_REQUIRED = ("dtype", "num_tokens", "num_documents", "shards", "index", "tokenizer")


def check_tokenizer(manifest: Manifest, tokenizer: Tokenizer) -> None:
    """ValueError (naming the manifest) when the directory was prepared with another tokenizer."""
    want, have = tokenizer_identity(tokenizer), manifest.tokenizer.get("identity")
    if want != have:
        raise ValueError(f"{manifest.root / MANIFEST}: prepared with tokenizer {manifest.tokenizer.get('name')!r} "
                         f"(identity {have}), but the run uses {tokenizer.name!r} (identity {want}); prepare "
                         f"the corpus again with this tokenizer")


def verify_prepared(path: str | Path, tokenizer: Tokenizer | None = None, *, full: bool = False,
                    digests: bool = True) -> Manifest:
    """Read and check a prepared directory (module docstring: the rule); ValueError naming the first bad
    file and what is wrong (size: the byte offset where it ends; digest mismatch). ``digests=False``
    checks the manifest, tokenizer and sizes only (what each rank does after the launcher's check)."""
    manifest = read_manifest(path)
    if tokenizer is not None:
        check_tokenizer(manifest, tokenizer)
    for file, record in manifest.files():
        if not file.is_file():
            raise ValueError(f"{file}: missing (listed in {manifest.root / MANIFEST})")
        size = file.stat().st_size
        if size != record["size"]:
            raise ValueError(f"{file}: truncated or grown: {size} bytes, the manifest says {record['size']} "
                             f"(data ends at offset {min(size, record['size'])}); prepare the corpus again")
        if not digests:
            continue
        key, actual = ("sha256", file_digests(file)["sha256"]) if full else ("sampled", sampled_digest(file))
        if actual != record[key]:
            raise ValueError(f"{file}: corrupted ({'checksum' if full else 'sampled checksum'} differs from "
                             f"{manifest.root / MANIFEST}); prepare the corpus again")
    check_counts(manifest)
    return manifest


def check_counts(manifest: Manifest) -> None:
    """The manifest's counts against its files (whose sizes :func:`verify_prepared` matched to the
    records): every shard's tokens = its bytes / the token size, their sum = ``num_tokens``, their documents
    sum to ``num_documents``, the index holds ``num_documents + 1`` offsets from 0 to ``num_tokens``.
    ValueError naming the manifest and the first count its files contradict. Reads 16 bytes."""
    where = manifest.root / MANIFEST
    try:
        itemsize = manifest.dtype.itemsize
        shards, index = manifest.data["shards"], manifest.data["index"]
        tokens, documents = manifest.num_tokens, manifest.num_documents
        for shard in shards:
            if int(shard["num_tokens"]) * itemsize != int(shard["size"]):
                raise ValueError(f"{where}: shard {shard['file']} says {shard['num_tokens']} tokens, its file "
                                 f"holds {int(shard['size']) // itemsize}; prepare the corpus again")
        held = sum(int(s["num_tokens"]) for s in shards)
        if held != tokens:
            raise ValueError(f"{where}: num_tokens says {tokens}, the shards hold {held}; prepare the corpus again")
        docs = sum(int(s["num_documents"]) for s in shards)
        if docs != documents or int(index["size"]) != 8 * (documents + 1):
            raise ValueError(f"{where}: num_documents says {documents}, the shards list {docs} and the index "
                             f"holds {int(index['size']) // 8 - 1}; prepare the corpus again")
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{where}: not a complete manifest (missing or malformed {exc})") from None
    offsets = document_index(manifest)
    ends = (int(offsets[0]), int(offsets[-1]))
    if ends != (0, tokens):
        raise ValueError(f"{where}: the document index runs from {ends[0]} to {ends[1]}, the stream holds "
                         f"{tokens} tokens; prepare the corpus again")


def check_prepared(path: str | Path, tokenizer: Tokenizer, need_tokens: int) -> Manifest:
    """:func:`verify_prepared` (quick rule) plus: the stream holds at least ``need_tokens`` tokens."""
    manifest = verify_prepared(path, tokenizer)
    if manifest.num_tokens < need_tokens:
        raise ValueError(f"{manifest.root / MANIFEST}: {manifest.num_tokens} tokens; one sample needs "
                         f"--seq-len + 1 = {need_tokens}")
    return manifest


class PreparedStream:
    """A :class:`~loongtrain.data.packing.TokenStream` stand-in over a prepared directory's memory-mapped
    shards: same ``ensure``/``slice``/``total_length``/``exhausted``, nothing read until sliced.

    ``documents`` (optional, sorted document numbers) restricts the stream to those documents, in order
    (the training or validation part of a split; :mod:`loongtrain.data.split`); their offsets are then
    computed from the document index once, 8 bytes read per document."""

    exhausted = True

    def __init__(self, manifest: Manifest, tokenizer: Tokenizer, documents: np.ndarray | None = None) -> None:
        self.manifest, self.tokenizer = manifest, tokenizer
        self.corpus = _Named(str(manifest.root))
        self.dtype = manifest.dtype
        self._shards = [np.memmap(f, dtype=self.dtype, mode="r") if rec["size"] else np.empty(0, self.dtype)
                        for f, rec in manifest.files()[:-1]]
        self._starts = np.cumsum([0] + [s.size for s in self._shards], dtype=np.int64)
        self._docs = documents
        if documents is None:
            self._len = manifest.num_tokens
        else:
            index = document_index(manifest)
            begin = np.asarray(index[documents], dtype=np.int64)
            lengths = np.asarray(index[documents + 1], dtype=np.int64) - begin
            self._doc_begin = begin
            self._virtual = np.concatenate([[0], np.cumsum(lengths)])
            self._len = int(self._virtual[-1])

    def __len__(self) -> int:
        return self._len

    def ensure(self, num_tokens: int) -> int:
        return self._len

    def total_length(self) -> int:
        return self._len

    def slice(self, start: int, end: int) -> torch.Tensor:
        """Tokens ``[start, end)`` as int64; IndexError past the end."""
        if end > self._len:
            raise IndexError(f"token stream has {self._len} tokens; asked for [{start}, {end})")
        if self._docs is None:
            return torch.from_numpy(self._physical(start, end))
        first = int(np.searchsorted(self._virtual, start, side="right")) - 1
        pieces, pos, d = [], start, first
        while pos < end:
            stop = min(end, int(self._virtual[d + 1]))
            begin = int(self._doc_begin[d]) + pos - int(self._virtual[d])
            pieces.append(self._physical(begin, begin + stop - pos))
            pos, d = stop, d + 1
        return torch.from_numpy(np.concatenate(pieces) if pieces else np.empty(0, np.int64))

    def _physical(self, start: int, end: int) -> np.ndarray:
        """Stream tokens ``[start, end)`` across shard boundaries, as int64."""
        out = np.empty(end - start, dtype=np.int64)
        shard = int(np.searchsorted(self._starts, start, side="right")) - 1
        pos = start
        while pos < end:
            base = int(self._starts[shard])
            stop = min(end, int(self._starts[shard + 1]))
            out[pos - start : stop - start] = self._shards[shard][pos - base : stop - base]
            pos, shard = stop, shard + 1
        return out


def document_index(manifest: Manifest) -> np.ndarray:
    """The memory-mapped document offsets (``num_documents + 1`` uint64 values)."""
    return np.memmap(manifest.root / SHARD_DIR / INDEX_FILE, dtype="<u8", mode="r")


@dataclass(frozen=True)
class _Named:
    """What PackedDataset reads of a corpus: its name."""

    name: str
