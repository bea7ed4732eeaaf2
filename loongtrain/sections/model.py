"""The model section of a run (``--model``, its tokenizer, RoPE, ``--init-from``, ``--lora``, ``--dtype``,
``--compile``) and the one ``--dtype`` rule of every command (docs/configuration.md#the-compute-dtype).

``--dtype`` takes ``auto``, ``fp32``, ``bf16`` or ``fp64``: fp64 runs store and compute in float64, every other
choice stores fp32 weights; ``bf16`` computes in bf16, ``auto`` in bf16 on a device with native bf16 (CUDA sm80+)
and in fp32 elsewhere (:func:`compute_dtype`). The planner plans GPUs with native bf16, so there ``auto`` is bf16
(:func:`planned_dtype_bytes`); an evaluation's default is the dtype its model trained with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from loongtrain._options import option
from loongtrain.hf.families import family_names
from loongtrain.model.lora import LoraConfig, parse_lora
from loongtrain.model.rope_scaling import RopeChange, rope_change
from loongtrain.parallel.config import COMPILE_MODES

if TYPE_CHECKING:  # the dtype functions import it: the section's options and their checks need none
    import torch

DTYPES = ("auto", "fp32", "bf16", "fp64")
_BYTES = {"fp32": 4, "bf16": 2, "fp64": 8, "auto": 2}


@dataclass
class ModelSection:
    """What model a run trains and how it computes: one field = one ``--option`` = one TOML key."""

    model: str = option("tiny", group="model", help="model preset (tiny, 1b, 7b-mha, 7b-gqa, 13b) or a local Hugging "
                        f"Face model directory (config.json + optional *.safetensors) of a tested family "
                        f"({family_names()}) or any causal LM whose layers match (docs/hf-models.md#families)",
                        resume="keep")
    rope_theta: float = option(0.0, "RoPE base (0: the model's own: the preset's, config.json's, or the --init-from "
                               "checkpoint's), e.g. raised to extend the context", resume="new_run")
    rope_scaling: str = option("", "RoPE scaling as TYPE:key=value,... with Hugging Face's types (linear, yarn, "
                               "llama3) and keys (factor, original_max_position_embeddings, low_freq_factor, "
                               "high_freq_factor, beta_fast, beta_slow, attention_factor), e.g. "
                               "yarn:factor=4,original_max_position_embeddings=8192; 'default': plain RoPE; '': the "
                               "model's own (docs/context-extension.md)", resume="new_run")
    tokenizer: str = option("auto", "tokenizer: 'auto' (the --model directory's Hugging Face tokenizer when it "
                            "has one, else 'byte'), 'byte' (UTF-8 bytes, vocab 256) or a local Hugging Face "
                            "tokenizer path", resume="keep")
    init_from: str = option("", "start this run from the weights of a loongtrain checkpoint (a checkpoint, "
                            "checkpoints or run directory: its latest), with a fresh optimizer, lr scheduler and data "
                            "stream; the model and its RoPE are the checkpoint's, changed by --rope-theta / "
                            "--rope-scaling; --seq-len may differ. A run that has checkpoints of its own resumes "
                            "those instead (--resume)", resume="free")
    lora: str = option("", "train LoRA adapters on a frozen base instead of every weight: "
                       "r=16,alpha=32,dropout=0,targets=q_proj,k_proj,v_proj,o_proj (each key optional, these are the "
                       "defaults; targets: Hugging Face's module names, or all-linear; loongtrain's decoder also "
                       "takes its own, wq,wk,wv,wo,w1,w2,w3); checkpoints hold only the adapters, export also "
                       "writes them in PEFT's format (docs/lora.md); '': off", resume="keep")
    dtype: str = option("auto", "compute dtype: auto (bf16 on CUDA devices with native bf16, else fp32), fp32, bf16 "
                        "(fp32 weights, bf16 compute: FSDP2 gathers bf16 weights under ZeRO, autocast otherwise), fp64",
                        choices=DTYPES, resume="free")
    compile: str = option("off", "torch.compile each decoder block: off or on (docs/compile.md)", resume="free")

    def validate(self) -> None:
        """ValueError naming the value: the dtype and compile choices, RoPE and --lora that do not parse, --lora
        with --init-from."""
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype={self.dtype!r} is not one of {DTYPES}")
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"--compile={self.compile!r} is not one of {COMPILE_MODES}")
        self.rope_change()
        if self.lora_config() is not None and self.init_from:
            raise ValueError(f"--lora with --init-from {self.init_from!r}: a LoRA run's base is a preset or a Hugging "
                             f"Face directory; export the checkpoint (loongtrain export) and pass it as --model")

    def lora_config(self) -> LoraConfig | None:
        """``--lora`` parsed (:func:`loongtrain.model.lora.parse_lora`; None without adapters)."""
        return parse_lora(self.lora)

    def rope_change(self) -> RopeChange:
        """``--rope-theta`` / ``--rope-scaling`` parsed (:func:`loongtrain.model.rope_scaling.rope_change`)."""
        return rope_change(self.rope_theta, self.rope_scaling)


def param_dtype(dtype: str) -> torch.dtype:
    """Storage dtype of the weights (and optimizer state) for ``--dtype``: float64 for fp64, else float32."""
    import torch

    return torch.float64 if dtype == "fp64" else torch.float32


def autocast_dtype(dtype: str, device: torch.device) -> torch.dtype | None:
    """The low-precision compute dtype of ``--dtype``: bf16 for bf16, and for auto on a CUDA device with native
    bf16 (``bf16_supported``: sm80+); None: compute in :func:`param_dtype`.

    How it is applied (:class:`~loongtrain.train.trainer.Trainer`): under FSDP2 the weights are gathered in bf16
    (``MixedPrecisionPolicy``) and the forward runs WITHOUT autocast, since autocast would cache a bf16 copy of
    every gathered fp32 weight until the region ends, i.e. a whole unsharded bf16 model; without FSDP (replicated
    weights) it is ``torch.autocast``. Either way norms, RoPE, the softmax statistics and the loss are computed in
    fp32 by the model and loss themselves."""
    import torch

    from loongtrain.attn.kernel_choice import bf16_supported

    if dtype == "bf16" or (dtype == "auto" and device.type == "cuda" and bf16_supported(device)):
        return torch.bfloat16
    return None


def compute_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The dtype a run computes in on ``device`` (module docstring)."""
    return autocast_dtype(dtype, device) or param_dtype(dtype)


def planned_dtype_bytes(dtype: str) -> int:
    """Bytes per element of ``--dtype`` on the devices the planner plans (GPUs with native bf16: auto is bf16)."""
    if dtype not in _BYTES:
        raise ValueError(f"--dtype={dtype!r} is not one of {DTYPES}")
    return _BYTES[dtype]
