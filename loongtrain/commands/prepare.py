"""``loongtrain prepare CORPUS... --tokenizer byte|PATH --out DIR``: tokenize once for memory-mapped training
(:mod:`loongtrain.data.prepare`; docs/data.md). Exit codes: 0 done (or already done), 2 bad input or an
output directory in use (one line), 1 a full disk (one line naming the path; the temporary files removed),
130 / 143 Ctrl-C / SIGTERM (the temporary files removed)."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

from loongtrain._options import option
from loongtrain.commands.errors import guarded
from loongtrain.commands.parser import build, naming_the_file, parse
from loongtrain.data.corpus import DECODE_ERRORS
from loongtrain.data.prepare import DEFAULT_SHARD_BYTES

PROGRESS = {"auto": None, "on": True, "off": False}
DESCRIPTION = ("Tokenize corpora once into a directory that `loongtrain train --corpus DIR` reads by memory map "
               "(token shards, a document index, a manifest with the tokenizer's identity and checksums). "
               "Rerunning on a finished directory does nothing; an interrupted run is restarted cleanly.")


@dataclass(kw_only=True)
class PrepareConfig:
    """Every option of ``loongtrain prepare``."""

    corpus: tuple[str, ...] = option((), positional=True, help="'stdlib', .txt/.jsonl files, directories of them, "
                                     "or saved Hugging Face datasets (concatenated in the order given)")
    out: str = option(metavar="DIR", help="output directory")
    tokenizer: str = option("byte", "'byte' or a local Hugging Face tokenizer path")
    workers: int = option(0, "tokenizer processes (0: one per core)", at_least=0)
    overwrite: bool = option(False, "prepare again into a DIR that holds another (or an outdated) prepared corpus: "
                             "loongtrain's own files there are replaced once the new corpus is whole; a DIR holding "
                             "files loongtrain did not write is never touched")
    text_field: str = option("text", "JSON field holding the text")
    decode_errors: str = option("strict", "bytes that are not UTF-8: strict (an error naming the file and byte "
                                "offset), replace (U+FFFD) or ignore (dropped)", choices=DECODE_ERRORS)
    shard_bytes: int = option(DEFAULT_SHARD_BYTES, "characters of text per shard", at_least=1)
    min_doc_tokens: int = option(0, "keep only the documents of at least N tokens (e.g. a long-document corpus for "
                                 "the long stages of --seq-len-stages, mixed with a short one: docs/data.md); 0: "
                                 "keep all", metavar="N", at_least=0)
    progress: str = option("auto", "progress bar on stderr (auto: when it is a terminal and tqdm is installed)",
                           choices=tuple(PROGRESS))
    objective: str = option("pretrain", "what the corpus is for (as `loongtrain train --objective`, an objective "
                            "whose corpora can be prepared): pretrain (text), sft (rows of TRL's SFT forms: "
                            "{\"messages\": [...]} or {\"prompt\", \"completion\"}: their tokens and target masks) or "
                            "dpo (preference pairs, explicit or implicit prompt; docs/post-training.md)")
    chat_template: str = option("", "--objective sft/dpo: a Jinja chat template file ('': the tokenizer's own)")
    loss_on: str = option("assistant", "--objective sft: the targets: assistant or all (as `loongtrain train`)",
                          choices=("assistant", "all"))
    verify: bool = option(False, "check every byte of the finished DIR against its manifest's checksums instead "
                          "of preparing")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logger = logging.getLogger("loongtrain")
    handler = None
    if not logger.handlers:  # INFO to stderr for this command (removed again when it returns)
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    try:
        return guarded("prepare", lambda: _run(argv))
    finally:
        if handler is not None:
            logger.removeHandler(handler)


def _run(argv: list[str]) -> None:
    from loongtrain.data.prepare import Sharding, prepare
    from loongtrain.data.prepared import verify_prepared
    from loongtrain.objectives.options import option_owners
    from loongtrain.objectives.registry import OBJECTIVES

    with naming_the_file(PrepareConfig, argv):  # a value its --config file set, refused later: the file named
        cfg = build(PrepareConfig, parse(PrepareConfig, argv, "loongtrain prepare", DESCRIPTION))
        if cfg.verify:
            manifest = verify_prepared(cfg.out, full=True)
            print(f"{cfg.out}: {manifest.num_tokens} tokens, {manifest.num_documents} documents, "
                  "every checksum matches")
            return
        if not cfg.corpus:
            raise ValueError("prepare needs at least one CORPUS (or --verify)")
        spec = OBJECTIVES.get(cfg.objective)
        if spec is None or not spec.prepares:
            preparable = tuple(name for name, entry in OBJECTIVES.items() if entry.prepares)
            raise ValueError(f"--objective={cfg.objective!r} is not one of {preparable}")
        for name, given in (("chat_template", bool(cfg.chat_template)), ("loss_on", cfg.loss_on != "assistant")):
            owners = option_owners(name)
            if given and spec.name not in owners:
                raise ValueError(f"--{name.replace('_', '-')} applies to --objective {' or '.join(owners)}, not "
                                 f"--objective {spec.name}")
        sharding = Sharding(cfg.text_field, cfg.shard_bytes, cfg.decode_errors, cfg.min_doc_tokens)
        prepare(list(cfg.corpus), cfg.out, cfg.tokenizer, sharding, workers=cfg.workers, overwrite=cfg.overwrite,
                progress=PROGRESS[cfg.progress], rows=lambda tokenizer: spec.row_encoder(tokenizer, cfg))


if __name__ == "__main__":
    sys.exit(main())
