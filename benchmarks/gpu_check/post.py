"""gpu_check's ``post_training`` section (``python -m benchmarks.gpu_check``): one SFT run, one DPO run and one
SFT-with-LoRA run of ``loongtrain train`` on one device, in this process, each a few steps on packed documents
(conversations and preference pairs packed whole into rows of 16K tokens on the GPU): tokens/s of its timed steps
(the first is the warm-up), its loss and targets, the kernels it chose. The model is a Llama directory made here
(``config.json`` only: loongtrain initialises it) with a byte-level ChatML tokenizer (tests/helpers/chat_data.py,
which needs the ``hf`` extra: without it the section says so)."""

from __future__ import annotations

import importlib.util
import json
import statistics
import time
from pathlib import Path
from typing import Any

SIZES: dict[str, dict[str, Any]] = {
    "gpu": {"model": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=32,
                          num_key_value_heads=4), "seq": 16384, "steps": 3, "turns": 24, "rows": 320},
    "cpu": {"model": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2), "seq": 256, "steps": 2, "turns": 1, "rows": 24},
}
RUNS = {"sft": ["--objective", "sft"], "dpo": ["--objective", "dpo"],
        "lora": ["--objective", "sft", "--lora", "r=16,alpha=32,targets=q_proj,k_proj,v_proj,o_proj"]}
RUN_S = {"gpu": 25.0, "cpu": 2.0}  # one run: the model, its optimizer (DPO: its reference too) and its steps


def probe_shapes(kind: str) -> list[tuple]:
    import torch

    m = SIZES[kind]["model"]
    dtype = torch.bfloat16 if kind == "gpu" else torch.float32
    head_dim = m["hidden_size"] // m["num_attention_heads"]
    return [(dtype, head_dim, m["num_attention_heads"], m["num_key_value_heads"], SIZES[kind]["seq"])]


def _inputs(root: Path, kind: str) -> tuple[Path, Path, Path]:
    """The model directory (config and chat tokenizer), conversations and preference pairs."""
    from tests.helpers import chat_data

    size = SIZES[kind]
    model = root / "model"
    model.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": chat_data.VOCAB,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": size["seq"],
              "tie_word_embeddings": False, "hidden_act": "silu", **size["model"]}
    (model / "config.json").write_text(json.dumps(config))
    chat_data.make_tokenizer(model)
    conversations = chat_data.write_conversations(root / "conversations.jsonl", size["rows"], size["turns"])
    pairs = chat_data.write_pairs(root / "pairs.jsonl", size["rows"])
    return model, conversations, pairs


def _run(ctx, name: str, model: Path, corpus: Path, out_dir: Path) -> dict[str, Any]:
    import torch

    from loongtrain.commands import main as cli_main

    size = SIZES[ctx.kind]
    argv = ["train", "--model", str(model), "--corpus", str(corpus), "--seq-len", str(size["seq"]),
            "--steps", str(size["steps"]), "--warmup", "1", "--nproc", "1", "--hp", "1", "--cp", "1",
            "--progress", "off", "--no-plot", "--no-tensorboard", "--no-memory-report", "--out-dir", str(out_dir),
            "--dtype", "auto" if ctx.device.type == "cuda" else "fp32", "--recompute", "selective", *RUNS[name]]
    if ctx.device.type == "cpu":  # this process's threads (a one-rank run would otherwise take every core)
        argv += ["--threads", str(torch.get_num_threads())]
    t0 = time.perf_counter()
    code = cli_main(argv)
    wall = time.perf_counter() - t0
    if code != 0:
        return {"error": f"loongtrain train exited {code}", "argv": argv, "wall_s": wall}
    records = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "tokens_per_s" in r and "loss" in r]
    timed = steps[1:] or steps
    return {"wall_s": wall, "steps": len(steps), "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
            "loss": steps[-1]["loss"], "targets": steps[-1].get("targets"), "pairs": steps[-1].get("pairs"),
            "mfu": steps[-1].get("mfu"),
            "attention_kernels": steps[-1].get("attention_kernels")}


def check_post_training(ctx) -> dict[str, Any]:
    if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("tokenizers") is None:
        return {"skipped": "the hf extra is not installed (pip install -e '.[hf]'): chat templates need it"}
    import tempfile

    out: dict[str, Any] = {"seq_len": SIZES[ctx.kind]["seq"], "model": SIZES[ctx.kind]["model"], "runs": {}}
    with tempfile.TemporaryDirectory(prefix="gpu_check_post_") as tmp:
        model, conversations, pairs = _inputs(Path(tmp), ctx.kind)
        import transformers.utils.chat_template_utils  # noqa: F401 - imported before the runs are timed
        estimate = RUN_S[ctx.kind]
        for name in RUNS:
            if not ctx.enough(estimate, name):
                continue
            corpus = pairs if name == "dpo" else conversations
            row = ctx.attempt(name, lambda name=name, corpus=corpus: _run(ctx, name, model, corpus,
                                                                            Path(tmp) / f"run_{name}"))
            if row is not None:
                out["runs"][name] = row
                estimate = row["wall_s"]  # the runs are alike: the last one's time
            ctx.flush()
    return out
