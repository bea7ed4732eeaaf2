"""Token counts as users write them: ``131072``, ``128K`` or ``1M`` (binary: K = 1024, M = 1024**2).

The one size parser of ``loongtrain train --seq-len`` and ``loongtrain plan --seq-len`` (command line and
TOML files alike).
"""

from __future__ import annotations

import argparse
import re

_UNITS = {"": 1, "k": 1024, "m": 1024**2}


def parse_size(text: str | int, name: str = "seq_len") -> int:
    """``131072``, ``128K`` or ``1M`` -> int; ValueError naming ``name`` and the value otherwise."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    m = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", str(text))
    if not m:
        raise ValueError(f"{name}={text!r} is not a length like 131072, 128K or 1M")
    return int(m.group(1)) * _UNITS[m.group(2).lower()]


def size_argument(text: str) -> int:
    """:func:`parse_size` as an argparse ``type`` (its message becomes argparse's)."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
