"""The evaluation's outputs in ``--out``: ``results.json``, a table on stdout, and a plot (matplotlib;
skipped with a warning when it is missing): ``passkey.png`` (accuracy heatmap, depth x length) or
``position_loss.png`` (loss per position bucket)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from loongtrain._files import disk_space, write_atomic
from loongtrain.train.metrics import size_label

log = logging.getLogger("loongtrain.eval")


def write_results(out: Path, task: str, rows: list[dict], meta: dict) -> Path:
    """``out/results.json``: the rows (passkey cells or position buckets) and, beside it, ``meta.json``
    (model, task, layout, lengths); returns the results path."""
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "results.json", json.dumps(rows, indent=1) + "\n")  # whole or not at all
    write_atomic(out / "meta.json", json.dumps({"task": task, **meta}, indent=1) + "\n")
    return out / "results.json"


def table(task: str, rows: list[dict]) -> str:
    """The results as a plain-text table."""
    if task == "position-loss":
        lines = [f"{'positions':>20s} {'tokens':>10s} {'loss':>8s}"]
        for r in rows:
            loss = "-" if r["loss"] is None else f"{r['loss']:.4f}"
            lines.append(f"{span_label(r['start'], r['end']):>20s} {r['tokens']:>10d} {loss:>8s}")
        return "\n".join(lines)
    lengths = sorted({r["length"] for r in rows})
    depths = sorted({r["depth"] for r in rows})
    by = {(r["length"], r["depth"]): r for r in rows}
    lines = ["accuracy (correct/trials) by depth (rows) and length (columns)",
             f"{'depth':>6s} " + " ".join(f"{size_label(n):>8s}" for n in lengths)]
    for d in depths:
        cells = [by.get((n, d)) for n in lengths]
        lines.append(f"{d:>6.2f} " + " ".join(f"{c['correct']:>4d}/{c['trials']:<3d}" if c else f"{'':8s}"
                                             for c in cells))
    total = sum(r["correct"] for r in rows), sum(r["trials"] for r in rows)
    digits = sum(r["digits_correct"] for r in rows), sum(r["digits"] for r in rows)
    lines.append(f"overall: {total[0]}/{total[1]} keys, {digits[0]}/{digits[1]} digits")
    return "\n".join(lines)


def span_label(start: int, end: int) -> str:
    """A position bucket as ``1K-2K``."""
    return f"{size_label(start)}-{size_label(end)}"


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: skipping the plot (pip install matplotlib)")
        return None
    return plt


def plot(out: Path, task: str, rows: list[dict]) -> Path | None:
    """``passkey.png`` or ``position_loss.png`` in ``out``; None (with a warning) without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4))
    if task == "position-loss":
        shown = [r for r in rows if r["loss"] is not None]
        ax.plot(range(len(shown)), [r["loss"] for r in shown], marker="o")
        ax.set_xticks(range(len(shown)), [span_label(r["start"], r["end"]) for r in shown], rotation=30)
        ax.set_xlabel("token position")
        ax.set_ylabel("mean loss")
        ax.set_title("loss by position")
        ax.grid(alpha=0.3)
        path = out / "position_loss.png"
    else:
        lengths = sorted({r["length"] for r in rows})
        depths = sorted({r["depth"] for r in rows})
        by = {(r["length"], r["depth"]): r for r in rows}
        grid = [[by[(n, d)]["correct"] / by[(n, d)]["trials"] if (n, d) in by else float("nan")
                 for n in lengths] for d in depths]
        image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto", origin="upper")
        for i, d in enumerate(depths):
            for j, n in enumerate(lengths):
                if (n, d) in by:
                    ax.text(j, i, f"{by[(n, d)]['correct']}/{by[(n, d)]['trials']}", ha="center", va="center")
        ax.set_xticks(range(len(lengths)), [size_label(n) for n in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("key depth")
        ax.set_title("passkey retrieval accuracy")
        fig.colorbar(image, ax=ax, label="accuracy")
        path = out / "passkey.png"
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with disk_space(path):
            fig.savefig(tmp, dpi=100, format="png")
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return path
