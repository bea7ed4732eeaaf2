"""Corpora, tokenizers, packing and per-replica sampling; :func:`build_batches` ties them together."""

from loongtrain.data.corpus import Corpus, FilesCorpus, HFDatasetCorpus, build_corpus, stdlib_files
from loongtrain.data.packing import PackedDataset, TokenStream
from loongtrain.data.pipeline import Batches, build_batches
from loongtrain.data.sampler import ReplicaSampler
from loongtrain.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, build_tokenizer

__all__ = [
    "Batches",
    "ByteTokenizer",
    "Corpus",
    "FilesCorpus",
    "HFDatasetCorpus",
    "HFTokenizer",
    "PackedDataset",
    "ReplicaSampler",
    "TokenStream",
    "Tokenizer",
    "build_batches",
    "build_corpus",
    "build_tokenizer",
    "stdlib_files",
]
