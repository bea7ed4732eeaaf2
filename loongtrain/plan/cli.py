"""``loongtrain plan``: rank 2D-Attention configurations for a model, sequence length and cluster.

Examples::

    loongtrain plan --model 7b-gqa --seq-len 1M --nodes 8 --cluster a100
    loongtrain plan --config my_plan.toml --json
    loongtrain plan --model path/to/hf_model --seq-len 128K --nodes 4 --cluster h100
    loongtrain plan --calibrate --calibrate-world 4 --out this_machine.toml

``--config FILE`` is a TOML file whose keys are the long option names with ``_`` for ``-`` (``model``,
``seq_len``, ``nodes``, ``cluster``, ...); ``model`` may be a preset name, a Hugging Face model
directory or config.json, or a table of :class:`~loongtrain.model.config.ModelConfig` fields. Options
given on the command line win.
Exit codes: 0 ok, 2 invalid request or nothing fits (the message names the value and alternatives).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from loongtrain._toml import tomllib
from loongtrain.model.config import PRESETS, ModelConfig
from loongtrain.parallel.config import AC_ALIASES, AC_MODES, PLACEMENTS, ZERO_MODES
from loongtrain.parallel.documents import Documents
from loongtrain.plan.attention_cost import AttnShape, attention_time
from loongtrain.plan.calibrate import calibrate
from loongtrain.plan.cluster import builtin_clusters, cluster_to_toml, load_cluster
from loongtrain.plan.cost import Candidate
from loongtrain.plan.document_work import balance_report, lognormal_documents
from loongtrain.plan.search import no_fit_message, plan, resolve_model
from loongtrain.plan.traffic import format_traffic_report, traffic_report

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
FILTERS = ("sp", "hp", "cp", "window", "placement", "zero", "ac_mode")
DEPRECATED = {"ckpt": "ac_mode"}  # old option / TOML key -> its name now
DOC_LAYOUTS = 5  # attention layouts the --doc-median text report shows


def parse_size(text: str | int) -> int:
    """``131072``, ``128K`` or ``1M`` (binary: K = 1024, M = 1024**2) -> int."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    m = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", str(text))
    if not m:
        raise ValueError(f"seq_len={text!r} is not a length like 131072, 128K or 1M")
    return int(m.group(1)) * {"": 1, "k": 1024, "m": 1024**2}[m.group(2).lower()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="loongtrain plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help=f"preset {sorted(PRESETS)}, or a local Hugging Face model directory or its "
                   "config.json (Llama, Mistral, Qwen2, Qwen3)")
    p.add_argument("--seq-len", help="sequence length per sample, e.g. 131072, 128K, 1M")
    p.add_argument("--nodes", type=int)
    p.add_argument("--cluster", help=f"built-in {builtin_clusters()} or a TOML file (default a100)")
    p.add_argument("--batch", type=int, help="sequences per replica per step (default 1)")
    p.add_argument("--dtype", choices=sorted(DTYPE_BYTES), help="compute dtype (default bf16)")
    p.add_argument("--config", type=Path, help="TOML file with any of these options")
    for name in ("sp", "hp", "cp", "window"):
        p.add_argument(f"--{name}", type=int, help=f"only configurations with this {name}")
    p.add_argument("--placement", choices=PLACEMENTS)
    p.add_argument("--zero", choices=ZERO_MODES,
                   help="none | hybrid (shard inside each node) | full (all dp*sp ranks)")
    modes = [*AC_MODES, *AC_ALIASES]
    p.add_argument("--ac-mode", choices=modes, help="activation checkpointing: none | full | selective "
                   "(Selective Checkpoint++; alias selective++)")
    p.add_argument("--ckpt", dest="ac_mode", choices=modes, help="deprecated alias of --ac-mode")
    p.add_argument("--top", type=int, default=None, help="rows to print (default 15)")
    p.add_argument("--all", action="store_true", help="print every configuration")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--traffic", action="store_true",
                   help="also print the per-rank bytes of one attention layer for the best configuration")
    p.add_argument("--doc-median", type=int, default=0, metavar="TOKENS",
                   help="predict for packed documents with lognormal lengths of this median (seeded, one mix per "
                   "batch row, zigzag layout), and print per attention layout the attention time without the "
                   "document mask, with it under zigzag and under the balanced layout, and the per-rank work "
                   "(max/mean) of both layouts")
    p.add_argument("--calibrate", action="store_true", help="measure this machine, write a cluster TOML")
    p.add_argument("--calibrate-world", type=int, default=4, help="ranks of the calibrated node")
    p.add_argument("--out", type=Path, default=Path("cluster-calibrated.toml"), help="--calibrate output")
    return p


def _load_config(path: Path) -> dict:
    if not path.is_file():
        raise ValueError(f"--config {str(path)!r} is not a file")
    with path.open("rb") as f:
        data = tomllib.load(f)
    for old, new in DEPRECATED.items():
        if old in data:
            data.setdefault(new, data.pop(old))
    known = {"model", "seq_len", "nodes", "cluster", "batch", "dtype", "top", *FILTERS}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{path}: unknown keys {unknown}; known keys: {sorted(known)}")
    if isinstance(data.get("model"), dict):
        try:
            data["model"] = ModelConfig(**data["model"])
        except TypeError as exc:
            raise ValueError(f"{path}: [model]: {exc}") from None
    return data


def _settings(args: argparse.Namespace) -> dict:
    s = _load_config(args.config) if args.config else {}
    for key in ("model", "seq_len", "nodes", "cluster", "batch", "dtype", "top", *FILTERS):
        if getattr(args, key) is not None:
            s[key] = getattr(args, key)
    missing = [k for k in ("model", "seq_len", "nodes") if k not in s]
    if missing:
        names = ", ".join("--" + m.replace("_", "-") for m in missing)
        raise ValueError(f"missing {names} (or --config FILE)")
    s["seq_len"] = parse_size(s["seq_len"])
    s.setdefault("cluster", "a100")
    s.setdefault("batch", 1)
    dtype = s.setdefault("dtype", "bf16")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype={dtype!r} is not one of {sorted(DTYPE_BYTES)}")
    return s


def collapse_windows(cands: list[Candidate]) -> list[tuple[Candidate, list[int]]]:
    """Merge rows that differ only in ``window`` and predict the same step time (within 0.1%):
    each kept row (the smallest such window) with the list of equivalent windows."""
    kept: list[tuple[Candidate, list[int]]] = []
    index: dict[tuple, int] = {}
    for c in cands:
        g = c.config
        key = (g.hp, g.cp, g.placement, g.zero, g.ac_mode, c.fits)
        i = index.get(key)
        if i is not None and abs(kept[i][0].step_time - c.step_time) <= 1e-3 * c.step_time:
            kept[i][1].append(g.window)
            continue
        index[key] = len(kept)
        kept.append((c, [g.window]))
    return kept


def _windows(ws: list[int]) -> str:
    ws = sorted(ws)
    return str(ws[0]) if len(ws) == 1 else f"{ws[0]}-{ws[-1]}" if len(ws) > 2 else f"{ws[0]},{ws[1]}"


def format_table(rows: list[tuple[Candidate, list[int]]]) -> str:
    head = (f"{'#':>3} {'hp':>3} {'cp':>3} {'win':>5} {'placement':<13} {'zero':<6} {'ac_mode':<9} {'dp':>3} "
            f"{'step s':>9} {'MFU':>6} {'mem GiB':>8} {'fits':<4} bottleneck")
    lines = [head, "-" * len(head)]
    for i, (c, ws) in enumerate(rows, 1):
        g = c.config
        lines.append(
            f"{i:>3} {g.hp:>3} {g.cp:>3} {_windows(ws):>5} {g.placement:<13} {g.zero:<6} {g.ac_mode:<9} "
            f"{c.dp:>3} {c.step_time:>9.3f} {c.mfu:>6.1%} {c.memory['total'] / 2**30:>8.1f} "
            f"{'yes' if c.fits else 'NO':<4} {c.bottleneck}"
        )
    return "\n".join(lines)


def packed_documents(seq_len: int, median: int, batch: int) -> Documents:
    """``--doc-median``: one seeded lognormal mix per batch row (row ``b``: seed ``b``)."""
    return Documents(tuple(tuple(lognormal_documents(seq_len, median, seed=row)) for row in range(batch)))


def document_report(rows: list[tuple[Candidate, list[int]]], model, cluster, s: dict,
                    documents: Documents) -> list[dict]:
    """Per candidate: attention seconds of one layer's call (forward + backward) without the document mask,
    with it under zigzag and under the balanced layout (docs/design.md §9), and per-rank work max/mean."""
    world = s["nodes"] * cluster.gpus_per_node
    window = model.sliding_window if model.sliding_window and model.sliding_window < s["seq_len"] else None
    shape = AttnShape(s["batch"], s["seq_len"], model.num_heads, model.num_kv_heads, model.head_dim,
                      DTYPE_BYTES[s["dtype"]], model.sliding_window)
    out = []
    for c, _ in rows:
        layout = c.config.layout(world)
        times = {"no_mask": attention_time(layout, shape, cluster).total}
        for name in ("zigzag", "balanced"):
            times[name] = attention_time(layout, shape, cluster, Documents(documents.cu_seqlens, name)).total
        r = balance_report(documents.rows(s["batch"]), s["seq_len"], layout.cp, layout.hp, sliding_window=window)
        same = abs(times["zigzag"] - times["balanced"]) <= 1e-3 * times["zigzag"]
        faster = "same" if same else min(("zigzag", "balanced"), key=times.get)
        out.append({"attention_s": times, "faster_layout": faster,
                    "work_max_over_mean": {"zigzag": r["zigzag_imbalance"], "balanced": r["balanced_imbalance"]},
                    "visible_fraction": r["visible_fraction"]})
    return out


def format_document_report(rows: list[tuple[Candidate, list[int]]], report: list[dict]) -> str:
    """The ``--doc-median`` table: one line per attention layout (hp, cp, window, placement)."""
    head = (f"{'layout':<32} {'no mask ms':>10} {'zigzag ms':>10} {'balanced ms':>11} "
            f"{'work max/mean zigzag':>20} {'balanced':>8}  faster")
    lines, seen = [head, "-" * len(head)], set()
    for (c, _), r in zip(rows, report):
        g = c.config
        key = (g.hp, g.cp, g.window, g.placement, g.interleaved)
        if key in seen or len(seen) == DOC_LAYOUTS:
            continue
        seen.add(key)
        t, w = r["attention_s"], r["work_max_over_mean"]
        label = f"hp={g.hp} cp={g.cp} w={g.window} {g.placement}" + (" interleaved" if g.interleaved else "")
        lines.append(f"{label:<32} {t['no_mask'] * 1e3:>10.3f} {t['zigzag'] * 1e3:>10.3f} {t['balanced'] * 1e3:>11.3f} "
                     f"{w['zigzag']:>20.2f} {w['balanced']:>8.2f}  {r['faster_layout']}")
    lines.append("(balanced: `loongtrain train --chunk-layout balanced`; the ranking above assumes zigzag)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.calibrate:
        cluster = calibrate(world=args.calibrate_world)
        args.out.write_text(cluster_to_toml(cluster))
        print(cluster_to_toml(cluster))
        print(f"wrote {args.out}  (use: loongtrain plan --cluster {args.out} ...)")
        return 0
    s = _settings(args)
    name, model = resolve_model(s["model"])
    cluster = load_cluster(s["cluster"])
    filters = {k: s[k] for k in FILTERS if s.get(k) is not None}
    kw = dict(nodes=s["nodes"], seq_len=s["seq_len"], batch=s["batch"], dtype_bytes=DTYPE_BYTES[s["dtype"]])
    documents = packed_documents(s["seq_len"], args.doc_median, s["batch"]) if args.doc_median else None
    cands = plan(model, cluster, **kw, documents=documents, **filters)
    rows = collapse_windows(cands)
    top = len(rows) if args.all else (s.get("top") or 15)
    world = s["nodes"] * cluster.gpus_per_node
    report = document_report(rows[:top], model, cluster, s, documents) if documents else None
    if args.json:
        doc_fields = {} if report is None else {"documents": {
            "median": args.doc_median, "count": [len(cu) - 1 for cu in documents.cu_seqlens],
            "visible_fraction": report[0]["visible_fraction"] if report else None}}
        print(json.dumps({
            "model": name, "seq_len": s["seq_len"], "nodes": s["nodes"], "world_size": world,
            "cluster": cluster.name, "batch": s["batch"], "dtype": s["dtype"], "evaluated": len(cands),
            "fits": cands[0].fits, **doc_fields,
            "candidates": [dict(c.to_dict(), equivalent_windows=ws,
                                **({} if report is None else {"documents": report[i]}))
                           for i, (c, ws) in enumerate(rows[:top])],
        }, indent=1))
    else:
        window = f", sliding window {model.sliding_window}" if model.sliding_window else ""
        docs = "" if documents is None else f", packed documents (median {args.doc_median}, zigzag)"
        print(f"model {name} ({model.num_layers} layers, dim {model.dim}, {model.num_heads} heads, "
              f"{model.num_kv_heads} KV heads, head_dim {model.head_dim}, FFN {model.ffn_dim}, "
              f"vocab {model.vocab_size}{window}), "
              f"seq_len {s['seq_len']}, {s['nodes']} nodes x {cluster.gpus_per_node} = {world} devices of "
              f"{cluster.name}, batch {s['batch']}/replica, {s['dtype']}{docs}; {len(cands)} configurations, "
              f"best {min(top, len(rows))} (rows differing only in an equally fast window merged):")
        print(format_table(rows[:top]))
    if args.traffic and not args.json:
        best = cands[0]
        rows_t = traffic_report(best.config.layout(world), cluster.gpus_per_node, batch=s["batch"],
                                seq_len=s["seq_len"], num_heads=model.num_heads,
                                num_kv_heads=model.num_kv_heads, head_dim=model.head_dim,
                                dtype_bytes=DTYPE_BYTES[s["dtype"]])
        print(f"\nper-rank traffic of one attention layer (forward + backward), {best.config.label()}:")
        print(format_traffic_report(rows_t))
    if report and not args.json:
        counts = sorted({len(cu) - 1 for cu in documents.cu_seqlens})
        count = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
        print(f"\npacked documents (lognormal, median {args.doc_median}, {count} in {s['seq_len']} tokens per row): "
              f"{report[0]['visible_fraction']:.1%} of causal attention visible; one attention layer's call "
              f"(forward + backward) without the document mask, with it under zigzag and under the balanced "
              f"layout, and per-rank work max/mean:")
        print(format_document_report(rows[:top], report))
    if not cands[0].fits:
        print("loongtrain plan: " + no_fit_message(model, cluster, cands, **kw, **filters), file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2)
        return int(exc.code or 0)
    try:
        return run(args)
    except ValueError as exc:
        print(f"loongtrain plan: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
