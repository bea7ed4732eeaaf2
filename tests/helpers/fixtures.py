"""What many tests share: the tiny model, small corpora and the flags of a quiet CLI run. Worker functions
(which run in other processes, without pytest's fixtures) import these directly; tests may also take the
fixtures of ``conftest.py`` built from them."""

from __future__ import annotations

from pathlib import Path

from loongtrain.model import ModelConfig
from loongtrain.model.rope_scaling import (
    RopeScaling,
)

#: flags that keep a ``loongtrain train`` run quiet and cheap (no progress bar, plots or TensorBoard;
#: the MFU peak given instead of measured; one thread)
QUIET_FLAGS = ["--progress", "off", "--peak-tflops", "1", "--no-tensorboard", "--no-plot", "--threads", "1"]


def tiny_model(*, num_layers: int = 2, num_kv_heads: int = 2, vocab_size: int = 64) -> ModelConfig:
    """The tests' tiny decoder: dim 32, 4 query heads, FFN 64 (GQA by default)."""
    return ModelConfig(vocab_size=vocab_size, dim=32, num_layers=num_layers, num_heads=4, num_kv_heads=num_kv_heads,
                       ffn_dim=64)


def write_code_corpus(path: Path, functions: int = 200) -> str:
    """A small Python-like text corpus (``functions`` three-line functions); returns its path."""
    path.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(functions)))
    return str(path)


def write_line_corpus(path: Path, lines: int = 400) -> str:
    """A small English-like text corpus (``lines`` numbered lines); returns its path."""
    path.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(lines)))
    return str(path)


#: one scaling of each type; original_max_position_embeddings=16 lies well inside the test sequences
SCALINGS = {
    "linear": RopeScaling("linear", factor=3.0),
    "yarn": RopeScaling("yarn", factor=4.0, original_max_position_embeddings=16),
    "llama3": RopeScaling("llama3", factor=8.0, original_max_position_embeddings=16, low_freq_factor=1.0,
                          high_freq_factor=4.0),
}
