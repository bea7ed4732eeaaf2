"""Document sources, read lazily and always in the same order.

- ``"stdlib"`` (default, no download): the ``*.py`` files of this Python's standard library
  (``sysconfig.get_paths()["stdlib"]``) in sorted path order, one document per file, skipping
  ``site-packages``/``dist-packages`` (machine-specific) and test directories (``test``, ``tests``,
  ``idle_test``; they hold odd encodings and generated data). About 12 MB on CPython 3.11.
- a ``.txt`` file: ONE document per file (the whole file).
- text files are UTF-8: other bytes are a ValueError naming the file and the byte offset, unless
  ``decode_errors`` is "replace" or "ignore" (``--decode-errors``; :func:`decode_text`).
- a ``.jsonl`` file: one document per non-blank line, the string field ``text_field`` (default "text").
- a directory of ``.txt``/``.jsonl`` files: all of them, recursively, in sorted path order.
- a Hugging Face dataset saved with ``save_to_disk`` (directory with ``dataset_dict.json`` or
  ``state.json``), or a local dataset script (``.py``, or ``<dir>/<dir>.py``): needs ``datasets``;
  the "train" split and the ``text_field`` column are used.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


class Corpus:
    """An iterable of documents (str); iterating again yields the same documents in the same order."""

    name: str

    def __iter__(self) -> Iterator[str]:
        raise NotImplementedError


#: ``--decode-errors``: how bytes that are not UTF-8 are handled (Python's codec error handlers)
DECODE_ERRORS = ("strict", "replace", "ignore")


def decode_text(data: bytes, file: Path | str, errors: str = "strict", offset: int = 0) -> str:
    """``data`` (bytes of ``file`` from byte ``offset``) as UTF-8. ``errors="strict"``: bytes that are
    not UTF-8 raise ValueError naming the file and the byte offset; "replace" (U+FFFD) and "ignore"
    (dropped) opt in to reading them anyway."""
    if errors not in DECODE_ERRORS:
        raise ValueError(f"decode_errors={errors!r} is not one of {DECODE_ERRORS}")
    try:
        return data.decode("utf-8", errors=errors)
    except UnicodeDecodeError as exc:
        raise ValueError(f"{file}: not valid UTF-8 text at byte {offset + exc.start} ({exc.reason}); is it a "
                         f"text file? (--decode-errors replace|ignore reads it anyway)") from None


_NON_TEXT = re.compile("[\x00-\x08\x0e-\x1f\x7f-\x9f\ufffd]")


def non_text_chars(text: str) -> int:
    """Characters of ``text`` that text does not hold: C0/C1 control characters other than tab, newline,
    carriage return, vertical tab and form feed, and U+FFFD (an undecodable byte, replaced)."""
    return len(_NON_TEXT.findall(text))


class FilesCorpus(Corpus):
    """Documents from a sorted list of files (``.txt``/``.py``: whole file; ``.jsonl``: one per line),
    decoded as UTF-8 with ``decode_errors`` (:func:`decode_text`; stdlib sources: "replace")."""

    def __init__(self, files: list[Path], name: str, text_field: str = "text", decode_errors: str = "strict") -> None:
        self.files, self.name, self.text_field = files, name, text_field
        decode_text(b"", name, decode_errors)  # checks the choice
        self.decode_errors = decode_errors

    def __iter__(self) -> Iterator[str]:
        for file in self.files:
            if file.suffix == ".jsonl":
                yield from read_jsonl(file, self.text_field, self.decode_errors)
            else:
                yield decode_text(file.read_bytes(), file, self.decode_errors)


def read_jsonl(path: Path, text_field: str = "text", decode_errors: str = "strict") -> Iterator[str]:
    """The ``text_field`` string of every non-blank line of a JSON-lines file (UTF-8: :func:`decode_text`)."""
    offset = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            line = decode_text(raw, path, decode_errors, offset)
            offset += len(raw)
            if line.strip():
                yield record_text(line, text_field, f"{path}:{lineno}")


def record_text(line: str, text_field: str, where: str) -> str:
    """The ``text_field`` string of one JSON line; ValueError naming ``where`` (the file and line) otherwise."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: invalid JSON ({e.msg})") from None
    if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
        raise ValueError(f"{where}: no string field {text_field!r}")
    return record[text_field]


#: :func:`sample_documents`: bytes read per sampled file, in this many evenly spaced blocks
SAMPLE_FILE_BYTES = 4 << 20
SAMPLE_BLOCKS = 16
#: :func:`sample_documents`: at most this many files (evenly spaced, first and last included)
SAMPLE_FILES = 64


def sample_documents(files: list[Path], text_field: str = "text", decode_errors: str = "strict") -> Iterator[str]:
    """Documents read from a sample of ``files``, for checks that need not read every byte (a multi-GB
    corpus in well under a second): up to :data:`SAMPLE_FILES` files, evenly spaced; a file of up to
    :data:`SAMPLE_FILE_BYTES` whole (as :class:`FilesCorpus` reads it), a larger one as
    :data:`SAMPLE_BLOCKS` evenly spaced blocks: a ``.txt`` block is text (cut to whole UTF-8
    characters), a ``.jsonl`` block gives its whole lines. Bad bytes and lines raise ValueError naming
    the file and the byte offset, as the full read does."""
    if len(files) > SAMPLE_FILES:
        files = [files[i * (len(files) - 1) // (SAMPLE_FILES - 1)] for i in range(SAMPLE_FILES)]
    for file in files:
        size = file.stat().st_size
        if size <= SAMPLE_FILE_BYTES:
            yield from FilesCorpus([file], str(file), text_field, decode_errors)
            continue
        block = SAMPLE_FILE_BYTES // SAMPLE_BLOCKS
        with open(file, "rb") as f:
            for k in range(SAMPLE_BLOCKS):
                start = (size - block) * k // (SAMPLE_BLOCKS - 1)
                f.seek(start)
                data = f.read(block)
                if file.suffix == ".jsonl":
                    yield from _block_lines(data, start, start + len(data) == size, file, text_field, decode_errors)
                else:
                    yield _block_text(data, start, start + len(data) == size, file, decode_errors)


def _block_text(data: bytes, start: int, at_end: bool, file: Path, errors: str) -> str:
    """A block of a text file cut to whole UTF-8 characters, decoded (:func:`decode_text`)."""
    head = 0
    if start:
        while head < min(3, len(data)) and 0x80 <= data[head] < 0xC0:  # continuation bytes of a cut character
            head += 1
    tail = len(data)
    if not at_end:
        for back in range(1, min(4, len(data) - head) + 1):  # a character cut at the block's end
            byte = data[tail - back]
            if byte < 0x80:
                break
            if byte >= 0xC0:
                need = 2 if byte < 0xE0 else 3 if byte < 0xF0 else 4
                if need > back:
                    tail -= back
                break
    return decode_text(data[head:tail], file, errors, start + head)


def _block_lines(data: bytes, start: int, at_end: bool, file: Path, text_field: str, errors: str) -> Iterator[str]:
    """The whole JSON lines of a block of a ``.jsonl`` file (the cut first and last ones dropped)."""
    lines = data.split(b"\n")
    offset = start
    if start:
        offset += len(lines[0]) + 1
        lines = lines[1:]
    if not at_end:
        lines = lines[:-1]
    for raw in lines:
        line = decode_text(raw, file, errors, offset)
        here, offset = offset, offset + len(raw) + 1
        if line.strip():
            yield record_text(line, text_field, f"{file}, the line at byte {here}")


def stdlib_files(root: str | Path | None = None) -> list[Path]:
    """Sorted ``*.py`` files of the standard library, pruning :data:`SKIP_DIRS` (walked once per process:
    the installation does not change while it runs)."""
    return list(_walk_py(str(root or sysconfig.get_paths()["stdlib"])))


@functools.lru_cache(maxsize=4)
def _walk_py(root: str) -> tuple[Path, ...]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
        found.extend(os.path.join(dirpath, f) for f in filenames if f.endswith(".py"))
    return tuple(Path(f) for f in sorted(found))


def load_hf_dataset(path: Path) -> Any:
    """The rows of a local Hugging Face dataset (saved with ``save_to_disk``, or a local script): its ``train``
    split when it has several. ValueError naming the path when there is none; ImportError without ``datasets``."""
    try:
        import datasets
    except ImportError:
        raise ImportError(
            f"reading the Hugging Face dataset {str(path)!r} needs 'datasets': "
            f"pip install 'loongtrain[hf]'"
        ) from None
    saved = path.is_dir() and any((path / f).exists() for f in ("dataset_dict.json", "state.json"))
    data = datasets.load_from_disk(str(path)) if saved else datasets.load_dataset(str(path))
    if isinstance(data, (datasets.DatasetDict, dict)):
        if "train" not in data:
            raise ValueError(f"dataset {str(path)!r} has no 'train' split; splits: {list(data)}")
        data = data["train"]
    return data


class HFDatasetCorpus(Corpus):
    """Rows of a local Hugging Face dataset (``load_from_disk`` or a local script), column ``text_field``."""

    def __init__(self, path: Path, text_field: str = "text") -> None:
        data = load_hf_dataset(path)
        if text_field not in data.column_names:
            raise ValueError(
                f"dataset {str(path)!r} has no column {text_field!r}; columns: {data.column_names}"
            )
        self.data, self.name, self.text_field = data, str(path), text_field

    def __iter__(self) -> Iterator[str]:
        for row in self.data:
            yield row[self.text_field]


def _is_hf_dataset_dir(path: Path) -> bool:
    markers = ("dataset_dict.json", "state.json", "dataset_info.json")
    return any((path / m).exists() for m in markers) or (path / f"{path.name}.py").exists()


def corpus_files(spec: str | Path) -> tuple[str, list[Path]]:
    """What ``spec`` reads (no file opened): ``("stdlib", files)``, ``("files", files)`` (``.txt``/``.jsonl``,
    sorted) or ``("dataset", the files under it)`` for a Hugging Face dataset directory or script. The one
    resolution of a corpus path (:func:`build_corpus` reads what this lists; a corpus's identity hashes
    it). ValueError for a path that is none of them."""
    if spec == "stdlib":
        files = stdlib_files()
        if not files:
            raise ValueError(f"no standard-library sources found under {sysconfig.get_paths()['stdlib']!r}")
        return "stdlib", files
    path = Path(spec)
    if not path.exists():
        raise ValueError(f"corpus {str(spec)!r} is neither 'stdlib' nor an existing path")
    if path.is_file():
        if path.suffix in (".txt", ".jsonl"):
            return "files", [path]
        if path.suffix == ".py":
            return "dataset", [path]
        raise ValueError(f"corpus file {str(path)!r} must end in .txt or .jsonl (or be a dataset script .py)")
    if _is_hf_dataset_dir(path):
        return "dataset", sorted(p for p in path.rglob("*") if p.is_file())
    files = sorted(p for p in path.rglob("*") if p.suffix in (".txt", ".jsonl") and p.is_file())
    if not files:
        raise ValueError(f"corpus directory {str(path)!r} holds no .txt or .jsonl files")
    return "files", files


def build_corpus(spec: str | Path | Corpus = "stdlib", text_field: str = "text",
                 decode_errors: str = "strict") -> Corpus:
    """A :class:`Corpus` from ``"stdlib"`` or a local path (see the module docstring for formats);
    ``decode_errors``: for text files (:func:`decode_text`)."""
    if isinstance(spec, Corpus):
        return spec
    kind, files = corpus_files(spec)
    if kind == "stdlib":
        return FilesCorpus(files, "stdlib", decode_errors="replace")  # a few sources hold odd bytes
    if kind == "dataset":
        return HFDatasetCorpus(Path(spec), text_field)
    return FilesCorpus(files, str(spec), text_field, decode_errors)
