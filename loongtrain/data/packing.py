"""Packing: documents -> one token stream (EOS after each document) -> fixed-length samples.

Sample ``i`` is the stream slice ``[i*seq_len, (i+1)*seq_len + 1)``: ``input_ids`` are its first
``seq_len`` tokens, ``labels`` its last ``seq_len`` (inputs shifted by one), and ``position_ids`` are
``0..seq_len-1`` (positions inside the packed sequence; no per-document reset). ``doc_starts`` (bool)
marks the tokens that start a document inside the sample: token 0 and every token after an EOS (a
document ends with its EOS), so the trainer can mask attention per document and restart positions
(:func:`loongtrain.parallel.documents.cu_seqlens_from_starts`). Consecutive samples share one boundary
token. The stream is tokenized lazily, only as far as requested, and cached in
memory (uint8 for vocabularies of at most 256 tokens, else int32).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from loongtrain.data.corpus import Corpus
from loongtrain.data.tokenizer import Tokenizer


class TokenStream:
    """The concatenation ``doc_0 + [eos] + doc_1 + [eos] + ...`` of a corpus, materialised on demand."""

    def __init__(self, corpus: Corpus, tokenizer: Tokenizer) -> None:
        self.corpus, self.tokenizer = corpus, tokenizer
        self.dtype = np.uint8 if tokenizer.vocab_size <= 256 else np.int32
        self._buf = np.empty(1 << 16, dtype=self.dtype)  # numpy: no intra-op thread pool for small copies
        self._len = 0
        self._docs: Iterator[str] | None = iter(corpus)

    @property
    def exhausted(self) -> bool:
        """True once every document has been tokenized (``len(self)`` is then the final length)."""
        return self._docs is None

    def __len__(self) -> int:
        """Tokens materialised so far."""
        return self._len

    def ensure(self, num_tokens: int) -> int:
        """Tokenize until at least ``num_tokens`` tokens exist or the corpus ends; return the length."""
        while self._len < num_tokens and self._docs is not None:
            doc = next(self._docs, None)
            if doc is None:
                self._docs = None
                break
            self._append(self.tokenizer.encode_tensor(doc).numpy())
            self._append(np.array([self.tokenizer.eos_id], dtype=self.dtype))
        return self._len

    def total_length(self) -> int:
        """Length of the whole stream (tokenizes everything)."""
        while not self.exhausted:
            self.ensure(self._len + (1 << 20))
        return self._len

    def slice(self, start: int, end: int) -> torch.Tensor:
        """Tokens ``[start, end)`` as int64; raises IndexError past the end of the corpus."""
        if self.ensure(end) < end:
            raise IndexError(f"token stream has {self._len} tokens; asked for [{start}, {end})")
        return torch.from_numpy(self._buf[start:end].astype(np.int64))

    def _append(self, tokens: np.ndarray) -> None:
        need = self._len + tokens.size
        if need > self._buf.size:
            grown = np.empty(max(need, 2 * self._buf.size), dtype=self.dtype)
            grown[: self._len] = self._buf[: self._len]
            self._buf = grown
        self._buf[self._len : need] = tokens
        self._len = need


class PackedDataset:
    """Fixed-length samples over a :class:`TokenStream`; indices past the corpus wrap around (epochs)."""

    def __init__(self, stream: TokenStream, seq_len: int) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len} must be positive")
        self.stream, self.seq_len = stream, seq_len

    def num_samples(self) -> int:
        """Samples in one epoch: ``(stream_length - 1) // seq_len`` (tokenizes the whole corpus)."""
        count = (self.stream.total_length() - 1) // self.seq_len
        if count < 1:
            raise ValueError(
                f"corpus {self.stream.corpus.name!r} has {len(self.stream)} tokens, fewer than "
                f"seq_len + 1 = {self.seq_len + 1}"
            )
        return count

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        """Sample ``index % num_samples``; the epoch size is only computed once the corpus runs out."""
        if index < 0:
            raise IndexError(f"sample index {index} must be non-negative")
        end = (index + 1) * self.seq_len + 1
        if self.stream.ensure(end) < end:
            index %= self.num_samples()
        start = index * self.seq_len
        tokens = self.stream.slice(start, start + self.seq_len + 1)
        inputs = tokens[:-1]
        doc_starts = torch.ones(self.seq_len, dtype=torch.bool)  # token 0: nothing before it in the row
        doc_starts[1:] = inputs[:-1] == self.stream.tokenizer.eos_id
        return {
            "input_ids": inputs,
            "labels": tokens[1:],
            "position_ids": torch.arange(self.seq_len, dtype=torch.int64),
            "doc_starts": doc_starts,
        }
