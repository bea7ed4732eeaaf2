"""What ``loongtrain plan`` prints: the ranked configurations (:func:`run`), ``--max-seq-len``, ``--simulate``,
``--traffic``, ``--doc-median`` and the calibrations, from a :class:`~loongtrain.plan.config.PlanConfig`
(the command itself: :mod:`loongtrain.commands.plan`). Exit codes: 0 ok, 2 an invalid request or nothing
fits (the message names the value and alternatives)."""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from loongtrain._files import FILE_HEADER, check_output_file, write_atomic
from loongtrain.model.config import ModelConfig, active_params, num_params
from loongtrain.model.memory import MemoryTerm
from loongtrain.parallel.documents import Documents
from loongtrain.plan.attention_cost import AttnShape, attention_time
from loongtrain.plan.calibrate import calibrate, calibrate_from_run, read_run
from loongtrain.plan.cluster import Cluster, builtin_clusters, cluster_for_device, cluster_to_toml, load_cluster
from loongtrain.plan.config import PlanConfig
from loongtrain.plan.cost import Candidate, Workload
from loongtrain.plan.document_work import balance_report, lognormal_documents
from loongtrain.plan.max_seq import max_seq_len
from loongtrain.plan.search import no_fit_message, plan, resolve_model, world_size
from loongtrain.plan.traffic import format_traffic_report, traffic_report

__all__ = ["Simulator", "run"]
DOC_LAYOUTS = 5  # attention layouts the --doc-median text report shows
#: ``simulate(model, candidate, cfg) -> dict`` with ``simulated_device_gib``: the trainer's step under fake
#: tensors (:func:`loongtrain.launch.simulate.simulate_candidate`, which ``loongtrain plan`` passes in)
Simulator = Callable[[Any, Candidate, PlanConfig], dict]


def collapse_windows(cands: list[Candidate]) -> list[tuple[Candidate, list[int]]]:
    """Merge rows that differ only in ``inner_ring`` and predict the same step time (within 0.1%):
    each kept row (the smallest such inner ring) with the list of equivalent inner rings."""
    kept: list[tuple[Candidate, list[int]]] = []
    index: dict[tuple, int] = {}
    for c in cands:
        g = c.config
        key = (g.hp, g.cp, g.placement, g.zero, g.recompute, c.fits)
        i = index.get(key)
        if i is not None and abs(kept[i][0].step_time - c.step_time) <= 1e-3 * c.step_time:
            kept[i][1].append(g.inner_ring)
            continue
        index[key] = len(kept)
        kept.append((c, [g.inner_ring]))
    return kept


def _windows(ws: list[int]) -> str:
    ws = sorted(ws)
    return str(ws[0]) if len(ws) == 1 else f"{ws[0]}-{ws[-1]}" if len(ws) > 2 else f"{ws[0]},{ws[1]}"


def format_table(rows: list[tuple[Candidate, list[int]]]) -> str:
    modes = any(_modes(c.config) for c, _ in rows)  # the column only when some row uses them
    head = (f"{'#':>3} {'hp':>3} {'cp':>3} {'inner':>5} {'placement':<13} {'zero':<6} {'recompute':<9} {'dp':>3} "
            f"{'step s':>9} {'compute':>8} {'mem-bnd':>8} {'comm':>8} {'optim':>7} {'MFU':>6} {'mem GiB':>8} "
            f"{'fits':<4} bottleneck" + ("   offload/tiling" if modes else ""))
    lines = [head, "-" * len(head)]
    for i, (c, ws) in enumerate(rows, 1):
        g, terms = c.config, c.terms
        lines.append(
            f"{i:>3} {g.hp:>3} {g.cp:>3} {_windows(ws):>5} {g.placement:<13} {g.zero:<6} {g.recompute:<9} "
            f"{c.dp:>3} {c.step_time:>9.3f} {terms['compute']:>8.3f} {terms['memory_bound']:>8.3f} "
            f"{terms['exposed_communication']:>8.3f} {terms['optimizer']:>7.3f} {c.mfu:>6.1%} "
            f"{c.memory['total'] / 2**30:>8.1f} {'yes' if c.fits else 'NO':<4} {c.bottleneck}"
            + (f"{'':<4} {_modes(g) or '-'}" if modes else "")
        )
    lines.append("(step s = compute + mem-bnd + comm + optim: matmuls and attention kernels; the memory-bound ops; "
                 "the communication not hidden; the AdamW step)")
    return "\n".join(lines)


def _terms(c: Candidate) -> str:
    """The step's four terms, in words."""
    t = c.terms
    return (f"compute {t['compute']:.2f} + memory-bound {t['memory_bound']:.2f} + exposed communication "
            f"{t['exposed_communication']:.2f} + optimizer {t['optimizer']:.2f}")


def _modes(g) -> str:
    """The offload and tiling modes of a configuration, short (``acts+params tiles=auto``)."""
    names = [n for n, on in (("acts", g.offload_activations), ("params", g.offload_params)) if on]
    tiles = f"tiles={g.mlp_tiles}" if g.mlp_tiles != "1" else ""
    keep = f"keep={g.offload_keep}" if g.offload_keep else ""
    return " ".join(filter(None, ["+".join(names), keep, tiles]))


def packed_documents(seq_len: int, median: int, batch: int) -> Documents:
    """``--doc-median``: one seeded lognormal mix per batch row (row ``b``: seed ``b``)."""
    return Documents(tuple(tuple(lognormal_documents(seq_len, median, seed=row)) for row in range(batch)))


def document_report(rows: list[tuple[Candidate, list[int]]], model, cluster, cfg: PlanConfig,
                    documents: Documents) -> list[dict]:
    """Per candidate: attention seconds of one layer's call (forward + backward) without the document mask,
    with it under zigzag and under the balanced layout (docs/planner.md), and per-rank work max/mean."""
    window = model.uniform_window if model.uniform_window and model.uniform_window < cfg.data.seq_len else None
    shape = AttnShape(cfg.data.batch_size, cfg.data.seq_len, model.num_heads, model.num_kv_heads, model.head_dim,
                      cfg.dtype_bytes, model.uniform_window, model.v_head_dim)
    out = []
    for c, _ in rows:
        layout = c.config.layout(c.world_size)
        times = {"no_mask": attention_time(layout, shape, cluster).total}
        for name in ("zigzag", "balanced"):
            times[name] = attention_time(layout, shape, cluster, Documents(documents.cu_seqlens, name)).total
        r = balance_report(documents.rows(cfg.data.batch_size), cfg.data.seq_len, layout.cp, layout.hp,
                           sliding_window=window)
        same = abs(times["zigzag"] - times["balanced"]) <= 1e-3 * times["zigzag"]
        faster = "same" if same else min(("zigzag", "balanced"), key=times.get)
        out.append({"attention_s": times, "faster_layout": faster,
                    "work_max_over_mean": {"zigzag": r["zigzag_imbalance"], "balanced": r["balanced_imbalance"]},
                    "visible_fraction": r["visible_fraction"]})
    return out


def format_document_report(rows: list[tuple[Candidate, list[int]]], report: list[dict]) -> str:
    """The ``--doc-median`` table: one line per attention layout (hp, cp, inner_ring, placement)."""
    head = (f"{'layout':<32} {'no mask ms':>10} {'zigzag ms':>10} {'balanced ms':>11} "
            f"{'work max/mean zigzag':>20} {'balanced':>8}  faster")
    lines, seen = [head, "-" * len(head)], set()
    for (c, _), r in zip(rows, report):
        g = c.config
        key = (g.hp, g.cp, g.inner_ring, g.placement, g.interleaved)
        if key in seen or len(seen) == DOC_LAYOUTS:
            continue
        seen.add(key)
        t, w = r["attention_s"], r["work_max_over_mean"]
        label = (f"hp={g.hp} cp={g.cp} inner_ring={g.inner_ring} {g.placement}"
                 + (" interleaved" if g.interleaved else ""))
        lines.append(f"{label:<32} {t['no_mask'] * 1e3:>10.3f} {t['zigzag'] * 1e3:>10.3f} {t['balanced'] * 1e3:>11.3f} "
                     f"{w['zigzag']:>20.2f} {w['balanced']:>8.2f}  {r['faster_layout']}")
    lines.append("(balanced: `loongtrain train --chunk-order balanced`; the ranking above assumes zigzag)")
    return "\n".join(lines)


def _check_out(cfg: PlanConfig) -> Path:
    """``--out`` by the ownership rule for files (:func:`loongtrain._files.check_output_file`), checked before
    the minutes of measuring: never a file loongtrain did not write, nor this command's input."""
    inputs = [cfg.calibrate_from, cfg.calibrate_base, cfg.cluster]
    return check_output_file("--out", cfg.out, "plan", inputs=[str(i) for i in inputs if i],
                             overwrite=cfg.overwrite)


def _calibrate_from(cfg: PlanConfig) -> Cluster:
    """``--calibrate-from``: the base cluster (``--calibrate-base``, else the preset of the run's device) with the
    run's measured rates."""
    device = str(read_run(cfg.calibrate_from)["environment"].get("name", ""))
    base = load_cluster(cfg.calibrate_base) if cfg.calibrate_base else cluster_for_device(device)
    if base is None:
        raise ValueError(f"--calibrate-from {cfg.calibrate_from!r}: no built-in cluster describes the run's device "
                         f"{device!r}; give --calibrate-base (built-in {builtin_clusters()} or a TOML file)")
    return calibrate_from_run(cfg.calibrate_from, base)[0]


def run(cfg: PlanConfig, simulate: Simulator, phases: Sequence[MemoryTerm] = ()) -> int:
    """Carry out one ``loongtrain plan`` request; the exit code (ValueError for a bad request). ``phases``: the
    memory phases of ``--objective`` (its registry entry's, which ``loongtrain plan`` passes in)."""
    if cfg.calibrate or cfg.calibrate_from:
        if cfg.calibrate and cfg.calibrate_from:
            raise ValueError("--calibrate measures this machine, --calibrate-from reads a device run: give one")
        out = _check_out(cfg)
        cluster = calibrate(world=cfg.calibrate_world) if cfg.calibrate else _calibrate_from(cfg)
        how = "--calibrate" if cfg.calibrate else "--calibrate-from"
        text = f"{FILE_HEADER}plan {how}` (--overwrite replaces it)\n{cluster_to_toml(cluster)}"
        write_atomic(out, text)
        print(cluster_to_toml(cluster))
        print(f"wrote {out}  (use: loongtrain plan --cluster {out} ...)")
        return 0
    cfg.check_complete()
    name, model = resolve_model(cfg.model)
    cluster = load_cluster(cfg.cluster)
    devices = cfg.devices()
    world, nodes = world_size(cluster, **devices)
    if cfg.max_seq_len:
        return _run_max_seq_len(cfg, name, model, cluster, devices, simulate, phases)
    documents = packed_documents(cfg.data.seq_len, cfg.doc_median, cfg.data.batch_size) if cfg.doc_median else None
    kw = dict(seq_len=cfg.data.seq_len, batch=cfg.data.batch_size, dtype_bytes=cfg.dtype_bytes, modes=cfg.modes,
              workload=Workload(cfg.lora_config(), documents, tuple(phases)), **devices)
    cands = plan(model, cluster, **kw, **cfg.filters())
    if cfg.simulate:
        return _print_simulation(cfg, name, model, cands[0], simulate)
    rows = collapse_windows(cands)
    top = len(rows) if cfg.all else cfg.top
    report = document_report(rows[:top], model, cluster, cfg, documents) if documents else None
    if cfg.json:
        doc_fields = {} if report is None else {"documents": {
            "median": cfg.doc_median, "count": [len(cu) - 1 for cu in documents.cu_seqlens],
            "visible_fraction": report[0]["visible_fraction"] if report else None}}
        print(json.dumps({
            "model": name, "seq_len": cfg.data.seq_len, "nodes": nodes, "world_size": world,
            "cluster": cluster.name, "batch": cfg.data.batch_size, "dtype": cfg.model_options.dtype,
            "evaluated": len(cands),
            "fits": cands[0].fits, **doc_fields,
            "candidates": [dict(c.to_dict(), equivalent_windows=ws,
                                **({} if report is None else {"documents": report[i]}))
                           for i, (c, ws) in enumerate(rows[:top])],
        }, indent=1))
    else:
        window = _window_text(model)
        docs = "" if documents is None else f", packed documents (median {cfg.doc_median}, zigzag)"
        whole = world % cluster.gpus_per_node == 0
        devices_text = f"{nodes} nodes x {cluster.gpus_per_node} = {world}" if whole else f"{world} (part of a node)"
        print(f"model {name} ({model.num_layers} layers, dim {model.dim}, {model.num_heads} heads, "
              f"{model.num_kv_heads} KV heads, head_dim {model.head_dim}, FFN {model.ffn_dim}, "
              f"vocab {model.vocab_size}{window}{_experts_text(model)}; {_param_text(model)}), "
              f"seq_len {cfg.data.seq_len}, {devices_text} devices of "
              f"{cluster.name}, batch {cfg.data.batch_size}/replica, {cfg.model_options.dtype}{docs}; "
              f"{len(cands)} configurations, "
              f"best {min(top, len(rows))} (rows differing only in an equally fast inner ring merged):")
        print(format_table(rows[:top]))
    if cfg.traffic and not cfg.json:
        best = cands[0]
        rows_t = traffic_report(best.config.layout(world), cluster.gpus_per_node, batch=cfg.data.batch_size,
                                seq_len=cfg.data.seq_len, num_heads=model.num_heads,
                                num_kv_heads=model.num_kv_heads, head_dim=model.head_dim,
                                dtype_bytes=cfg.dtype_bytes)
        print(f"\nper-rank traffic of one attention layer (forward + backward), {best.config.label()}:")
        print(format_traffic_report(rows_t))
    if report and not cfg.json:
        counts = sorted({len(cu) - 1 for cu in documents.cu_seqlens})
        count = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
        print(f"\npacked documents (lognormal, median {cfg.doc_median}, {count} in {cfg.data.seq_len} tokens per row): "
              f"{report[0]['visible_fraction']:.1%} of causal attention visible; one attention layer's call "
              f"(forward + backward) without the document mask, with it under zigzag and under the balanced "
              f"layout, and per-rank work max/mean:")
        print(format_document_report(rows[:top], report))
    if not cands[0].fits:
        print("loongtrain plan: " + no_fit_message(model, cluster, cands, **kw, **cfg.filters()), file=sys.stderr)
        return 2
    return 0


def _run_max_seq_len(cfg: PlanConfig, name: str, model, cluster: Cluster, devices: dict,
                     simulate: Simulator, phases: Sequence[MemoryTerm]) -> int:
    """``--max-seq-len``: the bisected length and its best configuration (text or JSON); with ``--lora`` also the
    length full training fits, for the comparison."""
    lora = cfg.lora_config()
    kw = dict(batch=cfg.data.batch_size, dtype_bytes=cfg.dtype_bytes, modes=cfg.modes, **devices, **cfg.filters())
    length, best = max_seq_len(model, cluster, workload=Workload(lora, phases=tuple(phases)), **kw)
    if cfg.simulate:
        at_length = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=length))
        return _print_simulation(at_length, name, model, best, simulate)
    full = max_seq_len(model, cluster, workload=Workload(phases=tuple(phases)), **kw)[0] if lora is not None else None
    if cfg.json:
        print(json.dumps({"model": name, "cluster": cluster.name, "world_size": best.world_size,
                          "max_seq_len": length, "dtype": cfg.model_options.dtype, "batch": cfg.data.batch_size,
                          **({"lora": lora.to_text(), "full_training_max_seq_len": full} if lora else {}),
                          "total_params": num_params(model), "active_params": active_params(model),
                          "configuration": best.config.label(), "candidate": best.to_dict()}, indent=1))
    else:
        with_lora = f" with --lora {lora.to_text()}" if lora else ""
        print(f"longest sequence for {name}{with_lora} on {best.world_size} devices of {cluster.name}: {length} "
              f"tokens ({length / 2**20:.2f}M), {best.config.label()}: {best.memory['total'] / 2**30:.1f} GiB per "
              f"device (usable {cluster.usable_memory / 2**30:.1f}), host {best.host_per_node / 2**30:.1f} GiB per "
              f"node (usable {cluster.usable_host_memory / 2**30:.1f}), step {best.step_time:.2f} s "
              f"({_terms(best)}), MFU {best.mfu:.1%}; {_param_text(model)}")
        if full is not None:
            print(f"full training (without --lora) fits {full} tokens ({full / 2**20:.2f}M): LoRA fits "
                  f"{length / full:.2f}x as long a sequence")
    return 0


def _experts_text(model: Any) -> str:
    if not model.moe_layers:
        return ""
    return (f", {model.num_experts} experts of FFN {model.moe_ffn_dim}, top-{model.top_k}, in "
            f"{len(model.moe_layers)} of the layers")


def _param_text(model: Any) -> str:
    """``parameters 30.53B`` (a dense model), or ``parameters 30.53B total, 3.35B active`` (with experts: memory
    counts them all, FLOPs and MFU the active ones)."""
    total, active = num_params(model) / 1e9, active_params(model) / 1e9
    return f"parameters {total:.2f}B total, {active:.2f}B active" if model.moe_layers else f"parameters {total:.2f}B"


def _print_simulation(cfg: PlanConfig, name: str, model, best: Candidate, simulate: Simulator) -> int:
    """``--simulate``: the best configuration's predicted and simulated busiest-rank peak."""
    result = {"model": name, "seq_len": cfg.data.seq_len, "world_size": best.world_size,
              "configuration": best.config.label(), "fits": best.fits,
              "predicted_device_gib": best.memory["total"] / 2**30,
              "predicted_host_gib_per_rank": best.memory.get("host", 0.0) / 2**30,
              "predicted_host_gib_per_node": best.host_per_node / 2**30,
              **simulate(model, best, cfg)}
    result["device_ratio"] = result["predicted_device_gib"] / result["simulated_device_gib"]
    if result.get("simulated_host_gib"):
        result["host_ratio"] = result["predicted_host_gib_per_rank"] / result["simulated_host_gib"]
    if cfg.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"{name}, seq_len {cfg.data.seq_len}, {best.world_size} devices, {best.config.label()}: predicted "
              f"{result['predicted_device_gib']:.2f} GiB per device, simulated {result['simulated_device_gib']:.2f} "
              f"GiB (predicted/simulated {result['device_ratio']:.3f}); host per rank predicted "
              f"{result['predicted_host_gib_per_rank']:.2f} GiB, simulated "
              f"{result.get('simulated_host_gib', 0.0):.2f} GiB")
    return 0


def _window_text(model: ModelConfig) -> str:
    """``, sliding window W`` (on every layer), ``, sliding window W on N of L layers``, or ''."""
    windows = {w: n for w, n in model.layer_windows().items() if w}
    if not windows:
        return ""
    return ", ".join([""] + [f"sliding window {w}" + ("" if n == model.num_layers else f" on {n} of "
                                                     f"{model.num_layers} layers") for w, n in windows.items()])
