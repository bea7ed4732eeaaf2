"""LoRA on 4 gloo ranks (docs/lora.md), one spawn: at hp2 x cp2, hp1 x cp4 (and hp2 x dp2), the trainer's loss and adapter
gradients equal ``peft``'s on the same unsharded base (float64, 1e-10), for an HF Llama and loongtrain's decoder,
with ZeRO none, full and hybrid, recompute, activation offload, MLP tiles and compiled blocks; under ZeRO the
frozen base is sharded too (DTensors) and only the adapters have gradients; a checkpoint of a fully sharded run
holds only the adapters, and resuming it in the other layout without ZeRO continues the run (1e-10)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.helpers.dist_utils import run_distributed
from tests.helpers.lora import full_grads, make_llama_dir, max_diff, peft_reference, set_adapters

pytest.importorskip("peft", reason="the hf extra is not installed (pip install -e '.[hf]')")
pytestmark = pytest.mark.distributed

TOL = 1e-10
SEQ = 32
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NATIVE_TARGETS = ["wq", "wk", "wv", "wo", "w1", "w3", "w2"]
#: (model kind, hp, cp, ParallelConfig memory options, --compile)
CASES = [
    ("hf", 2, 2, {}, "off"),
    ("hf", 1, 4, {"zero": "full", "recompute": "selective"}, "off"),
    ("hf", 2, 2, {"zero": "hybrid", "zero_shard_size": 2, "recompute": "full", "offload_activations": True}, "off"),
    ("native", 1, 4, {}, "off"),
    ("native", 2, 2, {"zero": "full", "recompute": "full", "mlp_tiles": "2"}, "off"),
    ("native", 1, 4, {"zero": "full", "recompute": "selective"}, "on"),
    ("native", 2, 1, {"zero": "hybrid", "zero_shard_size": 2}, "off"),  # dp = 2 (both replicas see the batch)
]


def _native_config() -> Any:
    from loongtrain.model.config import ModelConfig

    return ModelConfig(vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=48)


def _trainer(mesh: Any, model: str, compile: str = "off", **modes: Any) -> Any:
    from loongtrain.parallel.config import ParallelConfig
    from loongtrain.launch.config import TrainConfig, run_of
    from loongtrain.train.model_setup import model_config_for
    from loongtrain.train.trainer import Trainer

    cfg = TrainConfig.from_dict(dict(model=model, seq_len=SEQ, steps=3, warmup=1, dtype="fp64", compile=compile,
                      lora="r=4,alpha=8,targets=" + ",".join(TARGETS), memory_report=False,
                      parallel=ParallelConfig(hp=mesh.hp, cp=mesh.cp, **modes)))
    config = _native_config() if model == "tiny" else model_config_for(cfg.model)
    return Trainer(run_of(cfg, config), mesh, torch.device("cpu"), batches=lambda *a: iter(()))


def _base(model: str) -> Any:
    from loongtrain.hf.load import load_hf_model
    from loongtrain.model.llama import Transformer

    return Transformer(_native_config(), seed=0).double() if model == "tiny" else load_hf_model(
        model, dtype=torch.float64)


def _batch(step: int, vocab: int) -> dict[str, torch.Tensor]:
    from loongtrain.data.synthetic import global_batch

    return global_batch(step, 1, SEQ, vocab, seed=1)


def _lora_worker(rank: int, world: int, hf_dir: str, ckpt_dir: str) -> dict[str, Any]:
    from loongtrain.parallel.mesh import init_mesh
    from loongtrain.parallelize import compile as compile_step
    from loongtrain.train.checkpoint import load_checkpoint, save_checkpoint

    compile_step.BACKEND = "aot_eager"  # the same graphs as inductor, no code generation (docs/compile.md)
    out: dict[str, Any] = {"cases": []}
    references: dict[str, Any] = {}
    for kind, hp, cp, modes, compile in CASES:
        model, vocab = ("tiny", 64) if kind == "native" else (hf_dir, 256)
        batch = _batch(0, vocab)
        if kind not in references:  # peft on the unsharded base, on every rank (cheap at this size)
            targets = NATIVE_TARGETS if kind == "native" else list(TARGETS)
            references[kind] = peft_reference(_base(model), targets, 4, 8.0, batch)
        trainer = _trainer(init_mesh(hp, cp), model, compile, **modes)
        set_adapters(trainer.model)
        loss, value = trainer.loss(batch)
        loss.backward()
        if trainer.grad_sync is not None:
            trainer.grad_sync.reduce()
        frozen = [p for p in trainer.model.parameters() if not p.requires_grad]
        zero = modes.get("zero", "none") != "none"
        out["cases"].append({
            "case": (kind, hp, cp, tuple(sorted(modes.items())), compile),
            "loss": abs(float(value) - references[kind][0]), "grads": max_diff(full_grads(trainer.model),
                                                                                references[kind][1]),
            "frozen_sharded": all(type(p).__name__ == "DTensor" for p in frozen) if zero else None,
            "frozen_grads": sum(p.grad is not None for p in frozen),
        })

    # a fully sharded run's checkpoint: only the adapters; resumed at hp1 x cp4 without ZeRO
    root = Path(ckpt_dir)
    first = _trainer(init_mesh(2, 2), "tiny", zero="full")
    for step in range(2):
        first.step([_batch(step, 64)])
    save_checkpoint(root, 2, first.model, first.optimizer, first.scheduler, {"micro_step": 2})
    want = first.step([_batch(2, 64)])["loss"]
    want_params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
                   for n, p in first.model.named_parameters() if p.requires_grad}
    resumed = _trainer(init_mesh(1, 4), "tiny")
    load_checkpoint(root / "step_00000002", resumed.model, resumed.optimizer, resumed.scheduler)
    out["resume_loss"] = abs(resumed.step([_batch(2, 64)])["loss"] - want)
    got = {n: p.detach() for n, p in resumed.model.named_parameters() if p.requires_grad}
    out["resume_params"] = max_diff(got, want_params)
    if rank == 0:
        import torch.distributed.checkpoint as dcp

        keys = dcp.FileSystemReader(str(root / "step_00000002")).read_metadata().state_dict_metadata
        out["saved_model_keys"] = sorted(k.removeprefix("model.") for k in keys if k.startswith("model."))
        out["adapter_names"] = sorted(got)
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    hf_dir = make_llama_dir(tmp_path_factory.mktemp("lora_llama"))
    return run_distributed(_lora_worker, 4, str(hf_dir), str(tmp_path_factory.mktemp("lora_ckpt")))


def test_sharded_lora_equals_peft_in_every_layout_and_memory_mode(results: list[dict[str, Any]]) -> None:
    for rank_result in results:
        assert len(rank_result["cases"]) == len(CASES)
        for case in rank_result["cases"]:
            assert case["loss"] <= TOL and case["grads"] <= TOL, case
            assert case["frozen_grads"] == 0, case
            assert case["frozen_sharded"] in (None, True), case  # under ZeRO the frozen base is sharded too


def test_checkpoint_holds_only_the_adapters_and_resumes_in_another_layout(results: list[dict[str, Any]]) -> None:
    saved = results[0]["saved_model_keys"]
    assert saved == results[0]["adapter_names"] and all(".lora_" in k for k in saved)
    assert len(saved) == 2 * 7 * 2  # A and B of 7 modules in 2 blocks
    for rank_result in results:
        assert rank_result["resume_loss"] <= TOL and rank_result["resume_params"] <= TOL, rank_result
