"""Corpora, tokenizers, packing and per-replica sampling; :func:`build_batches` ties them together.
Prepared (memory-mapped) corpora (written by :func:`loongtrain.data.prepare.prepare`), mixtures and the
validation split: docs/data.md.

Its names are imported when first used (``import loongtrain.data.corpus`` imports no torch).
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

#: each name's module (imported when the name is first used: ``import loongtrain.data.<module>`` imports no
#: sibling, and no torch where the module needs none)
_LAZY = {
    "Corpus": "corpus",
    "FilesCorpus": "corpus",
    "HFDatasetCorpus": "corpus",
    "build_corpus": "corpus",
    "stdlib_files": "corpus",
    "PackedDataset": "packing",
    "TokenStream": "packing",
    "Batches": "pipeline",
    "build_batches": "pipeline",
    "PreparedStream": "prepared",
    "verify_prepared": "prepared",
    "ReplicaSampler": "sampler",
    "parse_corpus_spec": "sources",
    "ByteTokenizer": "tokenizer",
    "HFTokenizer": "tokenizer",
    "Tokenizer": "tokenizer",
    "build_tokenizer": "tokenizer",
    "ValBatches": "validation",
    "build_val_batches": "validation",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(f"loongtrain.data.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'loongtrain.data' has no attribute {name!r}")
