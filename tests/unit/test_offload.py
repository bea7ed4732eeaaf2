"""Activation offload and the sequence-tiled MLP in one process (docs/memory.md): exact against the plain
run (fp64, documents on), device activation memory independent of depth, the bad-input rules.
The sharded runs (world 4, and parameter offload) are in tests/dist/test_offload_dist.py."""

from __future__ import annotations

import logging

import pytest
import torch

from loongtrain.launch.config import TrainConfig, run_of
from loongtrain.model.config import ModelConfig
from loongtrain.parallel.config import ParallelConfig, mlp_tile_count, validate_parallel
from loongtrain.parallel.mesh import single_process_mesh
from loongtrain.parallelize.offload import activation_offloader, pinned_memory_available
from loongtrain.train.model_setup import model_config_for
from loongtrain.train.trainer import Trainer
from tests.helpers.doc_batches import MODEL, SEQ, packed_batch

TOL = 1e-10


def make_trainer(model: ModelConfig | str = MODEL, **opts) -> Trainer:
    cfg = TrainConfig.from_dict(dict(model=model if isinstance(model, str) else "tiny", seq_len=SEQ, batch_size=2,
                                     steps=2,
                      warmup=0, clip=0.0, dtype="fp64", parallel=ParallelConfig(hp=1, cp=1, **opts), doc_mask="on"))
    config = model if isinstance(model, ModelConfig) else model_config_for(cfg.model)
    return Trainer(run_of(cfg, config), single_process_mesh(), torch.device("cpu"))


def losses_and_grads(trainer: Trainer) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Two optimizer steps' losses, then the second step's gradients."""
    losses = [trainer.step([packed_batch()])["loss"] for _ in range(2)]
    return losses, {n: p.grad.clone() for n, p in trainer.model.named_parameters()}


def assert_same(got: tuple[list[float], dict], ref: tuple[list[float], dict], case: object) -> None:
    assert max(abs(a - b) for a, b in zip(got[0], ref[0], strict=True)) < TOL, (case, got[0], ref[0])
    for name, grad in ref[1].items():
        assert (got[1][name] - grad).abs().max().item() < TOL, (case, name)


CASES = {
    "offload full": {"recompute": "full", "offload_activations": True},
    "offload selective": {"recompute": "selective", "offload_activations": True},
    "tiles 4": {"mlp_tiles": "4"},
    "tiles auto, offload selective, half the blocks": {"mlp_tiles": "auto", "recompute": "selective",
                                                       "recompute_fraction": 0.5, "offload_activations": True},
    "offload full, the last block kept": {"recompute": "full", "offload_activations": True, "offload_keep": 1},
}


def test_every_mode_equals_the_plain_run():
    ref = losses_and_grads(make_trainer())
    for case, opts in CASES.items():
        trainer = make_trainer(**opts)
        assert_same(losses_and_grads(trainer), ref, case)
        offloader = activation_offloader(trainer.model)
        assert (offloader is not None) == opts.get("offload_activations", False), case
        if offloader is not None:  # something moved, and nothing is left on either side after backward
            assert offloader.offloaded_bytes > 0 and offloader.host_bytes == offloader.device_bytes == 0, case


def test_hf_mlp_is_tiled_exactly(tmp_path):
    from tests.helpers.hf_models import make_hf_dir

    model_dir = str(make_hf_dir(tmp_path / "qwen3", "Qwen3ForCausalLM"))
    ref = losses_and_grads(make_trainer(model_dir))
    trainer = make_trainer(model_dir, mlp_tiles="2", recompute="selective", offload_activations=True)
    from loongtrain.hf.families import decoder_layers

    assert all(layer.mlp.__dict__.get("_loongtrain_tiles") == "2" for layer in decoder_layers(trainer.model))
    assert_same(losses_and_grads(trainer), ref, "hf")


def _device_activations(layers: int, offload: bool) -> tuple[int, int]:
    """(saved activation bytes left on the device after a forward, peak bytes brought back in backward)."""
    config = ModelConfig(vocab_size=64, dim=32, num_layers=layers, num_heads=4, num_kv_heads=2, ffn_dim=64)
    trainer = make_trainer(config, recompute="full", offload_activations=offload)
    report = trainer.memory_report(packed_batch())
    offloader = activation_offloader(trainer.model)
    return report["activations"], offloader.peak_device_bytes if offloader else 0


def test_offloaded_device_activations_do_not_grow_with_depth():
    kept2, back2 = _device_activations(2, True)
    kept8, back8 = _device_activations(8, True)
    plain2, _ = _device_activations(2, False)
    plain8, _ = _device_activations(8, False)
    block = 2 * SEQ * MODEL.dim * 8  # one block's checkpointed input: [2, 32, 32] float64
    assert plain8 - plain2 == 6 * block  # without offload: one more block input per layer
    assert kept8 == kept2 == plain2 - 2 * block  # with it: no block input stays
    # backward: the fetched block inputs the offloader has handed out and autograd still holds (the block being
    # recomputed, and the previous one once prefetched late in this block's backward): the same at any depth
    assert back8 == back2 and block <= back2 <= 2 * block


def test_previous_block_is_prefetched_after_the_query_projections_gradient(monkeypatch):
    """Block i - 1's inputs come back from the hook on block i's query projection (after its MLP's and
    attention kernel's backward, its peaks), not when block i's own inputs are fetched."""
    import traceback

    from loongtrain.parallelize.offload import ActivationOffloader

    fetched: list[tuple[int, str]] = []
    original = ActivationOffloader._fetch

    def spy(self, stash):
        if any(ref() is not None and not ref().fetched for ref in stash.items):
            fetched.append((stash.index, traceback.extract_stack()[-2].name))
        return original(self, stash)

    monkeypatch.setattr(ActivationOffloader, "_fetch", spy)
    config = ModelConfig(vocab_size=64, dim=32, num_layers=4, num_heads=4, num_kv_heads=2, ffn_dim=64)
    losses_and_grads(make_trainer(config, recompute="full", offload_activations=True))
    assert fetched == 2 * [(3, "restore"), (2, "prefetch"), (1, "prefetch"), (0, "prefetch")], fetched  # 2 steps


def test_mem_activations_counts_only_device_bytes():
    from loongtrain.train.memory_report import metrics_fields

    plain = make_trainer(recompute="selective").memory_report(packed_batch())
    offloaded = make_trainer(recompute="selective", offload_activations=True).memory_report(packed_batch())
    assert 0 < offloaded["activations"] < plain["activations"]
    assert metrics_fields(offloaded)["mem_activations_gib"] == offloaded["activations"] / 2**30


def test_no_pinned_memory_warns_once(caplog):
    pinned_memory_available.cache_clear()
    with caplog.at_level(logging.WARNING, logger="loongtrain.train"):
        first = pinned_memory_available()
        assert pinned_memory_available() == first
    warned = [r for r in caplog.records if "pinned host memory" in r.getMessage()]
    assert len(warned) == (0 if first else 1)
    assert first == torch.cuda.is_available()  # this suite's CPU machines: not available


def test_auto_tile_rule():
    assert mlp_tile_count("auto", 8192, 4096, 14336) == 4  # ceil(14336 / 4096) = 4 tiles of 2048 tokens
    assert mlp_tile_count("auto", 2**20, 4096, 14336) == 256  # ALST's rule: tiles of dim = 4096 tokens
    assert mlp_tile_count("auto", 96, 32, 160) == 5  # uneven tiles (96 = 19 + 19 + 20 + 19 + 19 tokens)
    assert mlp_tile_count("auto", 8, 32, 64) == 2 and mlp_tile_count("auto", 8, 64, 64) == 1
    assert mlp_tile_count("auto", 3, 8, 1000) == 3  # at most one tile per token
    assert mlp_tile_count("3", 12, 1, 1) == 3


@pytest.mark.parametrize("opts, seq_len, needle", [
    ({"mlp_tiles": "0"}, None, "mlp_tiles='0'"),
    ({"mlp_tiles": "x"}, None, "mlp_tiles='x'"),
    ({"mlp_tiles": "3", "hp": 2, "cp": 2}, 32, "mlp_tiles=3 must divide the 8 local tokens"),
    ({"offload_activations": True}, None, "--recompute none"),
    ({"offload_activations": True, "recompute": "full", "recompute_fraction": 0.0}, None, "--recompute-fraction 0"),
    ({"offload_params": True}, None, "--offload-params (FSDP2's CPUOffloadPolicy) needs --zero full or hybrid"),
    ({"offload_keep": 2, "recompute": "full"}, None, "--offload-keep 2 names blocks that --offload-activations"),
    ({"offload_keep": -1, "recompute": "full", "offload_activations": True}, None, "offload_keep=-1"),
])
def test_bad_modes_name_the_value(opts, seq_len, needle):
    with pytest.raises(ValueError) as err:
        validate_parallel(ParallelConfig(**opts), seq_len=seq_len)
    assert needle in str(err.value)


def test_train_command_runs_every_mode(tmp_path):
    """``loongtrain train`` with the offload and tiling flags on a preset and a Hugging Face directory; the
    metrics' ``mem_activations_gib`` is what stays on the device (less than the plain run's)."""
    from loongtrain.commands import main
    from loongtrain.train.metrics import read_jsonl
    from tests.helpers.fixtures import QUIET_FLAGS, write_code_corpus
    from tests.helpers.hf_models import make_hf_dir

    corpus = write_code_corpus(tmp_path / "corpus.txt")
    base = ["train", "--nproc", "1", "--hp", "1", "--cp", "1", "--seq-len", "32", "--steps", "2", "--warmup", "1",
            "--corpus", corpus, *QUIET_FLAGS, "--recompute", "selective"]
    runs = {"plain": [], "offload": ["--offload-activations", "--mlp-tiles", "2"],
            "hf": ["--model", str(make_hf_dir(tmp_path / "llama")), "--offload-activations", "--mlp-tiles", "auto",
                   "--offload-params", "--zero", "full"]}
    last = {}
    for name, flags in runs.items():
        assert main([*base, *flags, "--out-dir", str(tmp_path / name)]) == 0, name
        last[name] = read_jsonl(tmp_path / name / "metrics.jsonl")[-1]
    assert 0 < last["offload"]["mem_activations_gib"] < last["plain"]["mem_activations_gib"]
    assert last["hf"]["mem_activations_gib"] > 0


def test_gradient_accumulation_with_offload():
    """Two micro-batches per step: each forward's blocks link to their own backward."""
    def trainer(**opts) -> Trainer:
        cfg = TrainConfig.from_dict(dict(seq_len=SEQ, batch_size=1, grad_accum=2, steps=1, warmup=0, clip=0.0,
                                         dtype="fp64", doc_mask="on", parallel=ParallelConfig(hp=1, cp=1, **opts)))
        return Trainer(run_of(cfg, MODEL), single_process_mesh(), torch.device("cpu"))

    micro = [{k: v[i : i + 1] for k, v in packed_batch().items()} for i in range(2)]
    results = []
    for opts in ({}, {"recompute": "selective", "offload_activations": True, "mlp_tiles": "2"}):
        t = trainer(**opts)
        loss = t.step(micro)["loss"]
        results.append((loss, {n: p.grad.clone() for n, p in t.model.named_parameters()}))
    assert_same(([results[1][0]], results[1][1]), ([results[0][0]], results[0][1]), "grad_accum")


def test_selective_offload_needs_torchs_cache(monkeypatch):
    """A torch whose selective checkpoint keeps no ``storage`` is named instead of silently not offloading."""
    import loongtrain.parallelize.offload as offload

    monkeypatch.setattr(offload, "create_selective_checkpoint_contexts", lambda policy: (object(), object()))
    offloader = offload.ActivationOffloader(torch.device("cpu"))
    with offloader.block(0), pytest.raises(RuntimeError, match="no 'storage'"):
        offloader.selective_contexts(lambda *a, **k: None)


def test_cuda_runs_get_expandable_segments_and_host_collectives(monkeypatch):
    from loongtrain.parallel import runtime

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not runtime.configure_cuda_allocator() and runtime.default_backend(host_collectives=True) == "gloo"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert runtime.default_backend(host_collectives=True) == "cuda:nccl,cpu:gloo"
    assert runtime.configure_cuda_allocator()
    assert runtime.os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:native")
    assert not runtime.configure_cuda_allocator()  # the user's choice stays
    assert runtime.os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "backend:native"


def test_offload_keep_leaves_the_last_blocks_on_the_device():
    """``--offload-keep 1`` of 2 blocks: only the first block's input goes to the host; keeping every
    recomputed block is refused, naming the count, before any step."""
    def host_after_forward(keep: int) -> int:
        trainer = make_trainer(recompute="full", offload_activations=True, offload_keep=keep)
        loss = trainer.loss(packed_batch())  # the graph (and the host copies) live while the loss does
        host = activation_offloader(trainer.model).host_bytes
        del loss
        return host

    block = 2 * SEQ * MODEL.dim * 8  # one block's checkpointed input: float64
    assert MODEL.num_layers == 2 and host_after_forward(0) == 2 * block and host_after_forward(1) == block
    with pytest.raises(ValueError, match="--offload-keep 2 keeps every one of the 2 recomputed blocks"):
        make_trainer(recompute="full", offload_activations=True, offload_keep=2)


def test_offload_keep_of_every_block_exits_2_before_workers(tmp_path, capsys):
    from loongtrain.commands import main

    code = main(["train", "--nproc", "1", "--hp", "1", "--cp", "1", "--steps", "1", "--recompute", "full",
                 "--offload-activations", "--offload-keep", "2", "--out-dir", str(tmp_path / "run")])
    assert code == 2
    err = capsys.readouterr().err
    assert "--offload-keep 2 keeps every one of the 2 recomputed blocks" in err and "at most 1" in err
    assert not (tmp_path / "run").exists()  # nothing started
