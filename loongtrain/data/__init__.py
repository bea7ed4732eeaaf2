"""Corpora, tokenizers, packing and per-replica sampling; :func:`build_batches` ties them together.
Prepared (memory-mapped) corpora (written by :func:`loongtrain.data.prepare.prepare`), mixtures and the
validation split: docs/data.md."""

from loongtrain.data.corpus import Corpus, FilesCorpus, HFDatasetCorpus, build_corpus, stdlib_files
from loongtrain.data.packing import PackedDataset, TokenStream
from loongtrain.data.pipeline import Batches, build_batches
from loongtrain.data.prepared import PreparedStream, verify_prepared
from loongtrain.data.sampler import ReplicaSampler
from loongtrain.data.sources import parse_corpus_spec
from loongtrain.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, build_tokenizer
from loongtrain.data.validation import ValBatches, build_val_batches

__all__ = [
    "Batches",
    "ByteTokenizer",
    "Corpus",
    "FilesCorpus",
    "HFDatasetCorpus",
    "HFTokenizer",
    "PackedDataset",
    "PreparedStream",
    "ReplicaSampler",
    "TokenStream",
    "Tokenizer",
    "ValBatches",
    "build_batches",
    "build_corpus",
    "build_tokenizer",
    "build_val_batches",
    "parse_corpus_spec",
    "stdlib_files",
    "verify_prepared",
]
