"""``PlanConfig``: every ``loongtrain plan`` option, one field each; the parser and the TOML keys are
generated from it (as ``loongtrain train``'s are from ``TrainConfig``, docs/design.md §8), with
``train``'s names (``--batch-size``, ``--ac-mode``, ``--offload-activations``, ...) and its size parser
(``--seq-len 128K``). The configuration filters take their help from
:class:`~loongtrain.parallel.config.ParallelConfig`'s own fields. Old names stay as aliases:
``--batch`` (= ``--batch-size``), ``--ckpt`` (= ``--ac-mode``, deprecated), and ``--plan-cluster``
(``train``'s name, = ``--cluster``). Precedence: field default < TOML file (``--config``) < command line.
"""

from __future__ import annotations

import argparse
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from loongtrain._input import OneLineParser, check_fields, check_value, parse_size, read_toml, size_argument
from loongtrain.model.config import PRESETS, ModelConfig
from loongtrain.parallel.config import AC_ALIASES, AC_MODES, PLACEMENTS, ZERO_MODES, ParallelConfig
from loongtrain.plan.cluster import builtin_clusters
from loongtrain.plan.search import MODE_SEARCH

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
#: old option / TOML key -> its name now (each still accepted)
ALIASES = {"batch": "batch_size", "ckpt": "ac_mode", "plan_cluster": "cluster"}
_PARALLEL_HELP = {f.name: f.metadata["help"] for f in fields(ParallelConfig)}


def _opt(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


def _filter(name: str, kind: type, **extra: Any) -> Any:
    """A configuration filter (None: any value): ``ParallelConfig.<name>``'s help."""
    return _opt(None, f"only configurations with this {name}: {_PARALLEL_HELP[name]}", kind=kind, **extra)


@dataclass
class PlanConfig:
    """Every option of ``loongtrain plan``: one field = one ``--option`` = one TOML key."""

    model: str = _opt("", f"preset {sorted(PRESETS)}, or a local Hugging Face model directory or its config.json "
                      "(Llama, Mistral, Qwen2, Qwen3); in --config also a [model] table of ModelConfig fields")
    seq_len: int = _opt(0, "tokens per sequence, e.g. 131072, 128K, 1M", size=True)
    max_seq_len: bool = _opt(False, "instead of ranking at --seq-len: bisect the longest sequence that fits "
                             "(device and host memory) and print it with its best configuration")
    gpus: int = _opt(0, "devices to plan for: part of one node (1, 2, 4, ...) or whole nodes (0: --nodes)")
    nodes: int = _opt(0, "whole nodes to plan for (0: --gpus)")
    cluster: str = _opt("a100", f"built-in {builtin_clusters()} or a TOML file")
    batch_size: int = _opt(1, "sequences per data-parallel replica per step")
    dtype: str = _opt("bf16", "compute dtype", choices=tuple(DTYPE_BYTES))
    sp: int | None = _opt(None, "only configurations with this sequence-parallel degree hp*cp", kind=int)
    hp: int | None = _filter("hp", int)
    cp: int | None = _filter("cp", int)
    window: int | None = _filter("window", int)
    placement: str | None = _filter("placement", str, choices=PLACEMENTS)
    zero: str | None = _filter("zero", str, choices=ZERO_MODES)
    ac_mode: str | None = _filter("ac_mode", str, choices=(*AC_MODES, *AC_ALIASES))
    offload_activations: bool | None = _filter("offload_activations", bool)
    mlp_tiles: str | None = _filter("mlp_tiles", str)
    offload_params: bool | None = _filter("offload_params", bool)
    modes: str = _opt("auto", "offload and tiling modes to consider: off, auto (only when nothing fits without "
                      "them), on", choices=MODE_SEARCH)
    simulate: bool = _opt(False, "also run the trainer's step for the best configuration under fake tensors "
                          "(memory at full size without the hardware) and print its peak beside the prediction")
    top: int = _opt(15, "rows to print")
    all: bool = _opt(False, "print every configuration")
    json: bool = _opt(False, "machine-readable output")
    traffic: bool = _opt(False, "also print the per-rank bytes of one attention layer for the best configuration")
    doc_median: int = _opt(0, "predict for packed documents with lognormal lengths of this median (seeded, one "
                           "mix per batch row, zigzag layout), and print per attention layout the attention time "
                           "without the document mask, with it under zigzag and under the balanced layout, and "
                           "the per-rank work (max/mean) of both layouts", metavar="TOKENS")
    calibrate: bool = _opt(False, "measure this machine, write a cluster TOML")
    calibrate_world: int = _opt(4, "ranks of the calibrated node")
    calibrate_from: str = _opt("", "write a cluster TOML (--out) from a device run (`python -m benchmarks.gpu_check "
                               "--out FILE`): its attention kernel, matmul and memory-bandwidth measurements, "
                               "everything else from --calibrate-base", metavar="GPU_CHECK_JSON")
    calibrate_base: str = _opt("", "the cluster whose other values --calibrate-from keeps: built-in or a TOML file "
                               "(default: the built-in cluster of the run's device)")
    out: str = _opt("cluster-calibrated.toml", "--calibrate / --calibrate-from output")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def filters(self) -> dict[str, Any]:
        """The configuration filters that are set (``search.plan``'s keyword arguments)."""
        names = ("sp", "hp", "cp", "window", "placement", "zero", "ac_mode", "offload_activations", "mlp_tiles",
                 "offload_params")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def devices(self) -> dict[str, int]:
        """``nodes=`` and/or ``gpus=`` as given (``search.world_size`` checks them against the cluster)."""
        return {k: getattr(self, k) for k in ("nodes", "gpus") if getattr(self, k)}

    def check_complete(self) -> None:
        """ValueError naming what a planning request lacks: the model, the length, the devices."""
        missing = [name for name, absent in (("--model", not self.model),
                                             ("--seq-len", not self.seq_len and not self.max_seq_len),
                                             ("--nodes", not self.devices())) if absent]
        if missing:
            raise ValueError(f"missing {', '.join(missing)}{' (or --gpus)' if '--nodes' in missing else ''} "
                             "(or --config FILE)")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    """An argparse parser generated from :class:`PlanConfig` (defaults suppressed in the namespace, so only
    options given on the command line override the TOML file)."""
    parser = OneLineParser(prog="loongtrain plan", argument_default=argparse.SUPPRESS, allow_abbrev=False,
                     description="Rank 2D-Attention configurations for a model, sequence length and cluster "
                     "with the cost model (docs/design.md §9).")
    parser.add_argument("--config", metavar="FILE", help="TOML file with any of these options (same names)")
    aliases = {new: old for old, new in ALIASES.items()}
    for f in fields(PlanConfig):
        flags = [_flag(f.name)] + ([_flag(aliases[f.name])] if f.name in aliases else [])
        help_text = f.metadata["help"] + ("" if f.default in (None, "", 0, False) else f" (default: {f.default!r})")
        if f.name in aliases:
            help_text += f"; {flags[1]}: {'deprecated ' if f.name == 'ac_mode' else ''}alias"
        kind = f.metadata.get("kind", type(f.default))
        if kind is bool:
            parser.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction, help=help_text)
        elif f.metadata.get("size"):
            parser.add_argument(*flags, dest=f.name, type=size_argument, metavar="N", help=help_text)
        else:
            parser.add_argument(*flags, dest=f.name, type=kind, choices=f.metadata.get("choices"),
                                metavar=f.metadata.get("metavar"), help=help_text)
    return parser


#: integer options and their least valid value (checked when given, from the command line or the file)
AT_LEAST = {"gpus": 1, "nodes": 1, "batch_size": 1, "top": 1, "sp": 1, "hp": 1, "cp": 1, "window": 1,
            "doc_median": 0, "calibrate_world": 1}


def _load_toml(path: Path) -> dict[str, Any]:
    where = f"--config {str(path)!r}"
    data = read_toml(path, "--config")
    hints = typing.get_type_hints(PlanConfig)
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = ALIASES.get(key.replace("-", "_"), key.replace("-", "_"))
        if name not in hints:
            raise ValueError(f"{where}: unknown keys {[key]}; known keys: {sorted(set(hints) | set(ALIASES))}")
        if name == "model" and isinstance(value, dict):
            values = check_fields(f"{where}: [model]", value, ModelConfig)
            try:
                out[name] = ModelConfig(**values)
            except ValueError as exc:
                raise ValueError(f"{where}: [model]: {exc}") from None
            continue
        if name == "seq_len" and isinstance(value, str):
            value = parse_size(value)
        out[name] = check_value(where, key, value, hints[name])
    return out


def _check(values: dict[str, Any]) -> None:
    """Ranges and choices of the given options (the same messages from a TOML file as from the command line)."""
    for key, low in AT_LEAST.items():
        if values.get(key) is not None and values[key] < low:
            raise ValueError(f"--{key.replace('_', '-')}={values[key]} must be >= {low}")
    for f in fields(PlanConfig):
        allowed = f.metadata.get("choices")
        if allowed and values.get(f.name) is not None and values[f.name] not in allowed:
            raise ValueError(f"--{f.name.replace('_', '-')}={values[f.name]!r} is not one of {list(allowed)}")


def parse_plan_args(argv: list[str]) -> PlanConfig:
    """PlanConfig from command-line arguments (and the TOML file they name). Raises ValueError."""
    given = vars(build_parser().parse_args(argv))
    values = _load_toml(Path(given.pop("config"))) if "config" in given else {}
    values.update(given)
    _check(values)
    return PlanConfig(**values)
