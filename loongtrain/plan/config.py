"""``PlanConfig``: every ``loongtrain plan`` option, one field each; the parser and the TOML keys are
generated from it (:mod:`loongtrain.commands.parser`, as ``loongtrain train``'s are from ``TrainConfig``),
with ``train``'s names (``--batch-size``, ``--recompute``, ``--offload-activations``, ``--cluster``, ...)
and its size parser (``--seq-len 128K``). It reuses ``train``'s model section (``--lora``, ``--dtype``: one rule,
:mod:`loongtrain.sections.model`) and data section (``--seq-len``, ``--batch-size``); the configuration filters
take their help from :class:`~loongtrain.parallel.config.ParallelConfig`'s own fields. Precedence: field default
< TOML file (``--config``) < command line.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from loongtrain._options import option
from loongtrain.hf.families import family_names
from loongtrain.model.config import PRESETS, ModelConfig
from loongtrain.model.lora import LoraConfig
from loongtrain.parallel.config import PLACEMENTS, RECOMPUTE_MODES, ZERO_MODES, ParallelConfig
from loongtrain.plan.cluster import builtin_clusters
from loongtrain.plan.search import FILTERS, MODE_SEARCH
from loongtrain.sections.data import DataSection
from loongtrain.sections.model import ModelSection, planned_dtype_bytes

_PARALLEL_HELP = {f.name: f.metadata["help"] for f in fields(ParallelConfig)}


def _filter(name: str, kind: type, **extra: Any) -> Any:
    """A configuration filter (None: any value): ``ParallelConfig.<name>``'s help."""
    return option(None, f"only configurations with this {name}: {_PARALLEL_HELP[name]}", kind=kind, **extra)


@dataclass
class PlanConfig:
    """Every option of ``loongtrain plan``: one field = one ``--option`` = one TOML key."""

    model: str | ModelConfig = option("", toml_table=ModelConfig, kind=str, help=f"preset {sorted(PRESETS)}, or a "
                                      "local Hugging Face model directory or its config.json of a tested family "
                                      f"({family_names()}) or any causal LM whose layers match; in --config also a "
                                      "[model] table of ModelConfig fields")
    data: DataSection = option(factory=lambda: DataSection(seq_len=0), only=("seq_len", "batch_size"), helps={
        "seq_len": "tokens per sequence, e.g. 131072, 128K, 1M",
        "batch_size": "sequences per data-parallel replica per step"})
    max_seq_len: bool = option(False, "instead of ranking at --seq-len: bisect the longest sequence that fits "
                             "(device and host memory) and print it with its best configuration")
    gpus: int = option(0, at_least=1, help="devices to plan for: part of one node (1, 2, 4, ...) or whole nodes "
                       "(0: --nodes)")
    nodes: int = option(0, at_least=1, help="whole nodes to plan for (0: --gpus)")
    cluster: str = option("a100", f"built-in {builtin_clusters()} or a TOML file")
    model_options: ModelSection = option(factory=ModelSection, only=("dtype", "lora"), helps={
        "dtype": "compute dtype: auto (bf16: the planned GPUs have it natively), bf16, fp32, fp64 (as loongtrain "
        "train --dtype)",
        "lora": "plan a LoRA run: adapters on a frozen base, as loongtrain train --lora takes them "
        "(r=16,alpha=32,dropout=0,targets=q_proj,k_proj,v_proj,o_proj; docs/lora.md): smaller optimizer state and "
        "gradients, no weight gradients for the base"})
    sp: int | None = option(None, "only configurations with this sequence-parallel degree hp*cp", kind=int, at_least=1)
    hp: int | None = _filter("hp", int, at_least=1)
    cp: int | None = _filter("cp", int, at_least=1)
    inner_ring: int | None = _filter("inner_ring", int, at_least=1)
    placement: str | None = _filter("placement", str, choices=PLACEMENTS)
    zero: str | None = _filter("zero", str, choices=ZERO_MODES)
    recompute: str | None = _filter("recompute", str, choices=RECOMPUTE_MODES)
    offload_activations: bool | None = _filter("offload_activations", bool)
    mlp_tiles: str | None = _filter("mlp_tiles", str)
    offload_params: bool | None = _filter("offload_params", bool)
    modes: str = option("auto", "offload and tiling modes to consider: off, auto (only when nothing fits without "
                      "them), on", choices=MODE_SEARCH)
    objective: str = option("pretrain", "what the run trains (as `loongtrain train --objective`; its memory phases "
                            "before the first step counted too, e.g. DPO's reference pass: docs/post-training.md)")
    simulate: bool = option(False, "also run the trainer's step for the best configuration under fake tensors "
                          "(memory at full size without the hardware) and print its peak beside the prediction")
    top: int = option(15, at_least=1, help="rows to print")
    all: bool = option(False, "print every configuration")
    json: bool = option(False, "machine-readable output")
    traffic: bool = option(False, "also print the per-rank bytes of one attention layer for the best configuration")
    doc_median: int = option(0, at_least=0, help="predict for packed documents with lognormal lengths of this "
                             "median (seeded, one "
                           "mix per batch row, zigzag layout), and print per attention layout the attention time "
                           "without the document mask, with it under zigzag and under the balanced layout, and "
                           "the per-rank work (max/mean) of both layouts", metavar="TOKENS")
    calibrate: bool = option(False, "measure this machine, write a cluster TOML")
    calibrate_world: int = option(4, at_least=1, help="ranks of the calibrated node")
    calibrate_from: str = option("", "write a cluster TOML (--out) from a device run (`python -m benchmarks.gpu_check "
                               "--out FILE`): its attention kernel, matmul and memory-bandwidth measurements, "
                               "everything else from --calibrate-base", metavar="GPU_CHECK_JSON")
    calibrate_base: str = option("", "the cluster whose other values --calibrate-from keeps: built-in or a TOML file "
                               "(default: the built-in cluster of the run's device)")
    out: str = option("cluster-calibrated.toml", "--calibrate / --calibrate-from output (a file loongtrain did not "
                      "write, or an input, is never replaced)")
    overwrite: bool = option(False, "replace an earlier --out of loongtrain's (never a file loongtrain did not write)")

    @property
    def dtype_bytes(self) -> int:
        """Bytes of ``--dtype`` on the planned GPUs (:func:`~loongtrain.sections.model.planned_dtype_bytes`)."""
        return planned_dtype_bytes(self.model_options.dtype)

    def lora_config(self) -> LoraConfig | None:
        """``--lora`` parsed (None: full training)."""
        return self.model_options.lora_config()

    def filters(self) -> dict[str, Any]:
        """The configuration filters that are set (``search.plan``'s keyword arguments)."""
        return {n: getattr(self, n) for n in FILTERS if getattr(self, n) is not None}

    def devices(self) -> dict[str, int]:
        """``nodes=`` and/or ``gpus=`` as given (``search.world_size`` checks them against the cluster)."""
        return {k: getattr(self, k) for k in ("nodes", "gpus") if getattr(self, k)}

    def check_complete(self) -> None:
        """ValueError naming what a planning request lacks: the model, the length, the devices."""
        missing = [name for name, absent in (("--model", not self.model),
                                             ("--seq-len", not self.data.seq_len and not self.max_seq_len),
                                             ("--nodes", not self.devices())) if absent]
        if missing:
            raise ValueError(f"missing {', '.join(missing)}{' (or --gpus)' if '--nodes' in missing else ''} "
                             "(or --config FILE)")
