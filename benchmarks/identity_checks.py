"""The time the ownership, checksum and identity checks of issue 41 add to ``loongtrain train``'s default run
(docs/files-and-checkpoints.md). Target: at most 0.1 s.

It trains the default run (``loongtrain train`` with its defaults, ``--steps`` shortened unless ``--full``),
times that run's wall clock as the baseline, then times each check on the run's own files directly,
``--repeats`` times (median, min, max):

- the fresh start's checks (what the default run executes): the output path's links, ``--init-from``'s
  identity (none given), the resume candidates of an empty checkpoints directory, the RoPE log text;
- the resume path's (``--resume auto`` of the same run): the newest complete checkpoint, its checksums
  over every file, the recorded vocabulary and architecture against the run's;
- export's trained length, and ``plan --out``'s file rule.

Usage::

    python -m benchmarks.identity_checks [--repeats 20] [--full] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from loongtrain.commands import main as loongtrain


def _timed(fn, repeats: int) -> dict[str, float]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--full", action="store_true", help="the default run's 40 steps (else 4)")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)

    from loongtrain._files import check_output_file, follow_link
    from loongtrain.data.tokenizer import build_tokenizer
    from loongtrain.launch.config import TrainConfig
    from loongtrain.launch.preflight import _newest_complete, check_init_identity, check_same_model
    from loongtrain.train.checkpoint import find_checkpoint, resume_candidates, verify_checkpoint
    from loongtrain.train.export import trained_positions
    from loongtrain.train.model_setup import model_config_for, tokenizer_spec
    from loongtrain.train.trainer import rope_text

    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        argv_run = ["train", "--out-dir", str(run), "--progress", "off"] + ([] if args.full else ["--steps", "4"])
        t0 = time.perf_counter()
        assert loongtrain(argv_run) == 0
        wall = time.perf_counter() - t0
        ckpt = find_checkpoint(run)
        state = verify_checkpoint(ckpt)
        cfg = TrainConfig.from_dict(state["config"])
        tokenizer = build_tokenizer(tokenizer_spec(cfg.model))
        model_config = model_config_for(cfg.model, tokenizer)
        empty = Path(tmp) / "fresh" / "checkpoints"
        plan_out = Path(tmp) / "cluster.toml"

        def fresh() -> None:
            follow_link("--out-dir", str(Path(tmp) / "fresh"))
            check_init_identity(cfg, tokenizer)
            resume_candidates(empty)
            rope_text(model_config)

        def resume() -> None:
            path, _ = _newest_complete(run / "checkpoints")
            check_same_model(cfg, tokenizer, state, path)

        rows = {
            "fresh start (the default run's checks)": _timed(fresh, args.repeats),
            "resume: newest complete checkpoint + checksums + model identity": _timed(resume, args.repeats),
            "export: trained length": _timed(lambda: trained_positions(state), args.repeats),
            "plan --out: the file rule": _timed(lambda: check_output_file("--out", plan_out, "plan"), args.repeats),
        }
        size = sum(f.stat().st_size for f in ckpt.iterdir())
    print(f"default run ({'40' if args.full else '4'} steps): {wall:.2f} s wall; checkpoint {size / 2**20:.1f} MiB")
    print(f"{'check':<66} {'median ms':>10} {'min ms':>8} {'max ms':>8} {'of the run':>10}")
    for name, r in rows.items():
        print(f"{name:<66} {1e3 * r['median_s']:>10.3f} {1e3 * r['min_s']:>8.3f} {1e3 * r['max_s']:>8.3f} "
              f"{r['median_s'] / wall:>10.2e}")
    worst = max(r["median_s"] for r in rows.values())
    print(f"largest added: {1e3 * worst:.2f} ms (target: at most 100 ms)")
    if args.json:
        Path(args.json).write_text(json.dumps({"run_wall_s": wall, "checkpoint_bytes": size, "rows": rows}, indent=1))
    return 0 if worst <= 0.1 else 1


if __name__ == "__main__":
    raise SystemExit(main())
