"""Tokenizers: a built-in byte tokenizer and a wrapper over local Hugging Face tokenizers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


class Tokenizer:
    """Interface: ``vocab_size``, ``eos_id`` (appended after every document when packing), encode/decode."""

    vocab_size: int
    eos_id: int
    name: str

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        raise NotImplementedError

    def decode(self, ids: list[int] | torch.Tensor) -> str:
        """Text of token ids."""
        raise NotImplementedError

    def encode_tensor(self, text: str) -> torch.Tensor:
        """``encode`` as a 1-D int64 tensor (subclasses may return a narrower integer dtype)."""
        return torch.tensor(self.encode(text), dtype=torch.int64)

    def encode_many(self, texts: list[str]) -> list[np.ndarray]:
        """``encode`` of each text as a 1-D integer array (the tokenizer's batch path where it has one)."""
        return [self.encode_tensor(t).numpy() for t in texts]

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """``(ids [n], offsets [n, 2])``: ``encode(text)`` and each token's ``[start, end)`` in characters of
        ``text`` (what a chat template's target spans are mapped through: loongtrain/data/chat.py)."""
        raise NotImplementedError


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as tokens (vocab 256). End of document = byte 0 (NUL, which text files do not contain)."""

    vocab_size = 256
    eos_id = 0
    name = "byte"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_tensor(self, text: str) -> torch.Tensor:
        data = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()
        return torch.from_numpy(data)

    def encode_many(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """One token per UTF-8 byte; a byte's span is its character's."""
        sizes = np.fromiter((len(c.encode("utf-8")) for c in text), dtype=np.int64, count=len(text))
        chars = np.repeat(np.arange(len(text), dtype=np.int64), sizes)
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64), np.stack([chars, chars + 1], 1)

    def decode(self, ids: list[int] | torch.Tensor) -> str:
        """Invalid UTF-8 (e.g. a sequence cut mid-character) decodes to U+FFFD."""
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return bytes(values).decode("utf-8", errors="replace")


_EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>", "[SEP]")


class HFTokenizer(Tokenizer):
    """A Hugging Face tokenizer read from a local path: a ``tokenizer.json`` file (``tokenizers``) or a
    directory holding one (``tokenizers``), or any local ``transformers`` tokenizer directory.

    ``eos_token`` overrides the end-of-document token; by default the tokenizer's own EOS token is used,
    else the first of ``</s>``, ``<|endoftext|>``, ``<|end_of_text|>``, ``<eos>`` in its vocabulary.
    """

    def __init__(self, path: str | Path, eos_token: str | None = None) -> None:
        path = Path(path)
        if not path.exists():
            raise ValueError(f"tokenizer path {str(path)!r} does not exist")
        self.name = str(path)
        file = path if path.is_file() else path / "tokenizer.json"
        self._tok = self._hf = None
        eos_default = None
        try:
            import tokenizers
        except ImportError:
            tokenizers = None
        if tokenizers is not None and file.is_file():
            try:
                self._tok = tokenizers.Tokenizer.from_file(str(file))
            except BaseException as exc:  # tokenizers raises Exception, or pyo3's PanicException
                _reraise_unless_library_error(exc, file)
            vocab = self._tok.get_vocab(with_added_tokens=True)
            self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        else:
            try:
                import transformers
            except ImportError:
                raise ImportError(
                    f"loading tokenizer {str(path)!r} needs the 'tokenizers' package (for tokenizer.json) "
                    f"or 'transformers': pip install 'loongtrain[hf]'"
                ) from None
            if not path.is_dir():
                raise ValueError(f"tokenizer path {str(path)!r} is neither tokenizer.json nor a directory")
            try:
                self._hf = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
            except BaseException as exc:
                _reraise_unless_library_error(exc, path)
            vocab = self._hf.get_vocab()
            self.vocab_size = len(self._hf)
            eos_default = self._hf.eos_token
        if eos_token is not None and eos_token not in vocab:
            raise ValueError(f"eos_token {eos_token!r} is not in the vocabulary of {str(path)!r}")
        found = [t for t in (eos_token, eos_default, *_EOS_CANDIDATES) if t is not None and t in vocab]
        if not found:
            raise ValueError(f"tokenizer {str(path)!r} has no end-of-document token; pass eos_token=...")
        self.eos_id = vocab[found[0]]

    def encode(self, text: str) -> list[int]:
        if self._tok is not None:
            return self._tok.encode(text, add_special_tokens=False).ids
        return self._hf.encode(text, add_special_tokens=False)

    def encode_tensor(self, text: str) -> torch.Tensor:
        return torch.tensor(self.encode(text), dtype=torch.int32)

    def encode_many(self, texts: list[str]) -> list[np.ndarray]:
        if self._tok is None:
            return super().encode_many(texts)
        return [np.array(e.ids, dtype=np.int64) for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def encode_offsets(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        if self._tok is not None:
            encoding = self._tok.encode(text, add_special_tokens=False)
            ids, offsets = encoding.ids, encoding.offsets
        else:
            encoding = self._hf(text, add_special_tokens=False, return_offsets_mapping=True)
            ids, offsets = encoding["input_ids"], encoding["offset_mapping"]
        return np.asarray(ids, dtype=np.int64), np.asarray(offsets, dtype=np.int64).reshape(-1, 2)

    def decode(self, ids: list[int] | torch.Tensor) -> str:
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        if self._tok is not None:
            return self._tok.decode(values, skip_special_tokens=False)
        return self._hf.decode(values, skip_special_tokens=False)


def _reraise_unless_library_error(exc: BaseException, file: Path) -> None:
    """A tokenizer library's failure to read ``file`` as ValueError naming it (whatever its class: the
    Rust ``tokenizers`` raise ``Exception`` or a ``PanicException`` deriving from BaseException);
    interrupts and exits propagate as they are."""
    if isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit)):
        raise exc
    text = str(exc).strip().splitlines()
    raise ValueError(f"tokenizer file {str(file)!r} cannot be loaded: {type(exc).__name__}: "
                     f"{text[0] if text else 'no details'}") from None


def build_tokenizer(name_or_path: str | Tokenizer = "byte") -> Tokenizer:
    """``"byte"`` -> :class:`ByteTokenizer`; a local path -> :class:`HFTokenizer`; a Tokenizer as is."""
    if isinstance(name_or_path, Tokenizer):
        return name_or_path
    if name_or_path == "byte":
        return ByteTokenizer()
    if Path(name_or_path).exists():
        return HFTokenizer(name_or_path)
    raise ValueError(
        f"unknown tokenizer {name_or_path!r}: use 'byte' or a local path to a Hugging Face tokenizer "
        f"(tokenizer.json or a tokenizer directory); nothing is downloaded"
    )
