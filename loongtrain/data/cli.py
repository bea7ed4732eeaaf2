"""``loongtrain prepare CORPUS... --tokenizer byte|PATH --out DIR``: tokenize once for memory-mapped
training (:mod:`loongtrain.data.prepare`; docs/design.md §12). Exit codes: 0 done (or already done),
2 bad input or an output directory in use (one line on stderr), 1 a full disk (one line naming the path;
the temporary files removed), 130/143 Ctrl-C/SIGTERM (the temporary files removed)."""

from __future__ import annotations

import argparse
import logging
import sys

from loongtrain._files import DiskFullError
from loongtrain._input import failure, user_error
from loongtrain.data.corpus import DECODE_ERRORS
from loongtrain.data.prepare import DEFAULT_SHARD_BYTES, prepare
from loongtrain.data.prepared import verify_prepared

PROGRESS = {"auto": None, "on": True, "off": False}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise ValueError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="loongtrain prepare", description=(
        "Tokenize corpora once into a directory that `loongtrain train --corpus DIR` reads by memory map "
        "(token shards, a document index, a manifest with the tokenizer's identity and checksums). "
        "Rerunning on a finished directory does nothing; an interrupted run is restarted cleanly."))
    parser.add_argument("corpus", nargs="*", metavar="CORPUS",
                        help="'stdlib', .txt/.jsonl files, directories of them, or saved Hugging Face datasets "
                        "(concatenated in the order given)")
    parser.add_argument("--tokenizer", default="byte", help="'byte' or a local Hugging Face tokenizer path "
                        "(default: byte)")
    parser.add_argument("--out", required=True, metavar="DIR", help="output directory")
    parser.add_argument("--workers", type=int, default=0, help="tokenizer processes (default 0: one per core)")
    parser.add_argument("--overwrite", action="store_true", help="prepare again into a DIR that holds another "
                        "(or an outdated) prepared corpus: loongtrain's own files there are replaced once the new "
                        "corpus is whole; a DIR holding files loongtrain did not write is never touched")
    parser.add_argument("--text-field", default="text", help="JSON field holding the text (default: text)")
    parser.add_argument("--decode-errors", choices=DECODE_ERRORS, default="strict",
                        help="bytes that are not UTF-8: strict (an error naming the file and byte offset), "
                        "replace (U+FFFD) or ignore (dropped) (default: strict)")
    parser.add_argument("--shard-bytes", type=int, default=DEFAULT_SHARD_BYTES,
                        help=f"characters of text per shard (default: {DEFAULT_SHARD_BYTES})")
    parser.add_argument("--min-doc-tokens", type=int, default=0, metavar="N", help="keep only the documents of "
                        "at least N tokens (e.g. a long-document corpus for the long stages of a --seq-len-schedule, "
                        "mixed with a short one: README, Data; default 0: keep all)")
    parser.add_argument("--progress", choices=sorted(PROGRESS), default="auto",
                        help="progress bar on stderr (auto: when it is a terminal and tqdm is installed)")
    parser.add_argument("--verify", action="store_true", help="check every byte of the finished DIR against "
                        "its manifest's checksums instead of preparing")
    return parser


def main(argv: list[str] | None = None) -> int:
    logger = logging.getLogger("loongtrain")
    handler = None
    if not logger.handlers:  # INFO to stderr for this command (removed again when it returns)
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    try:
        return _run(argv)
    finally:
        if handler is not None:
            logger.removeHandler(handler)


def _run(argv: list[str] | None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if args.verify:
            manifest = verify_prepared(args.out, full=True)
            print(f"{args.out}: {manifest.num_tokens} tokens, {manifest.num_documents} documents, "
                  f"every checksum matches")
            return 0
        if not args.corpus:
            raise ValueError("prepare needs at least one CORPUS (or --verify)")
        prepare(args.corpus, args.out, args.tokenizer, workers=args.workers, overwrite=args.overwrite,
                text_field=args.text_field, shard_bytes=args.shard_bytes, decode_errors=args.decode_errors,
                progress=PROGRESS[args.progress], min_doc_tokens=args.min_doc_tokens)
    except DiskFullError as exc:
        return failure("prepare", exc)
    except (ValueError, ImportError, OSError) as exc:
        return user_error("prepare", exc)
    return 0
