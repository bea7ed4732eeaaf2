"""``loongtrain export CHECKPOINT --hf OUT``: a training checkpoint as a Hugging Face model directory
(:func:`loongtrain.train.export.export_checkpoint`; docs/hf-models.md; a LoRA run's adapters: docs/lora.md).
Exit codes: 0 written, 2 bad input (one line), 1 a full disk, 130 / 143 Ctrl-C / SIGTERM (the target left as it was)."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from loongtrain._options import option
from loongtrain.commands.errors import guarded
from loongtrain.commands.parser import build, naming_the_file, parse

DTYPES = ("fp32", "bf16", "fp16", "fp64")  # the keys of loongtrain.train.export.DTYPES


@dataclass
class ExportConfig:
    """Every option of ``loongtrain export``."""

    checkpoint: str = option(positional=True, help="checkpoint directory (OUT_DIR/checkpoints/step_N), checkpoints "
                             "root or run directory (its latest checkpoint)")
    hf: str = option(metavar="OUT", help="output Hugging Face model directory")
    dtype: str = option("", choices=DTYPES, help="dtype of the written tensors (default: as trained)")
    overwrite: bool = option(False, "replace an earlier export in --hf (its files are deleted; a directory holding "
                             "files loongtrain did not write is never touched)")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def body() -> None:
        with naming_the_file(ExportConfig, argv):
            write(argv)

    return guarded("export", body)


def write(argv: list[str]) -> None:
    """Parse ``argv``, export, and say what was written."""
    cfg = build(ExportConfig, parse(ExportConfig, argv, "loongtrain export", "Write a training checkpoint's "
                                    "model as a Hugging Face directory (config.json + model.safetensors) for "
                                    "from_pretrained."))
    from loongtrain.train.export import DTYPES as TORCH_DTYPES
    from loongtrain.train.export import TOKENIZER_NAMES, export_checkpoint

    out = export_checkpoint(cfg.checkpoint, cfg.hf, dtype=TORCH_DTYPES.get(cfg.dtype), overwrite=cfg.overwrite)
    tokenizer = [name for name in TOKENIZER_NAMES if (out / name).is_file()]
    lora = [f"{out / name}/" for name in ("adapter", "base") if (out / name).is_dir()]
    print(f"wrote {out / 'config.json'} and {out / 'model.safetensors'}"
          + (f" and the run's tokenizer ({', '.join(tokenizer)})" if tokenizer else "")
          + (f"; LoRA: the merged model, and {' and '.join(lora)} (PEFT's adapter; the base)" if lora else ""))


if __name__ == "__main__":
    sys.exit(main())
