"""Changing the RoPE when training continues: ``--rope-theta``, ``--rope-scaling`` and ``--init-from``.

- A preset run with ``--rope-scaling`` records it; ``loongtrain export`` writes it into config.json, and
  ``from_pretrained`` (HF's own modules, fp32) gives the checkpoint's loss at every position (1e-4).
- ``--init-from`` takes the checkpoint's weights only (fresh optimizer, step 0), with the new RoPE; a
  resume may not change the RoPE (the error points at ``--init-from``); ``--init-from`` of another model or
  of the run's own checkpoints exits 2 before any worker.
- A Hugging Face directory with ``--rope-scaling`` keeps HF's modules, computing the new RoPE; with
  ``--init-from`` it takes the checkpoint's recorded RoPE.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from loongtrain.commands import main
from loongtrain.model.rope_scaling import RopeScaling
from tests.helpers.fixtures import QUIET_FLAGS

pytest.importorskip("transformers", reason="the hf extra is not installed (pip install -e '.[hf]')")

YARN = "yarn:factor=4,original_max_position_embeddings=32"
ONE = ["--nproc", "1", "--hp", "1", "--cp", "1", "--warmup", "1", "--no-memory-report", *QUIET_FLAGS]


@pytest.fixture(scope="module")
def scaled_run(tmp_path_factory, line_corpus) -> Path:
    """A 2-step tiny-preset run at seq-len 64 with YaRN over 32 positions and theta 20000."""
    out = tmp_path_factory.mktemp("scaled") / "run"
    argv = ["train", "--corpus", line_corpus, "--seq-len", "64", "--steps", "2", "--rope-scaling", YARN,
            "--rope-theta", "20000", "--out-dir", str(out), *ONE]
    assert main(argv) == 0
    return out


def _per_position_losses(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[0, :-1].float(), tokens[0, 1:], reduction="none")


def test_scaled_run_records_and_exports_its_rope(scaled_run, tmp_path, line_corpus):
    from transformers import AutoModelForCausalLM

    from loongtrain.train.export import load_trained_model

    state = json.loads((scaled_run / "checkpoints" / "step_00000002" / "trainer_state.json").read_text())
    assert state["config"]["rope_scaling"] == YARN and state["config"]["rope_theta"] == 20000.0
    assert state["model_config"]["rope_theta"] == 20000.0
    assert RopeScaling(**state["model_config"]["rope_scaling"]) == RopeScaling(
        "yarn", factor=4.0, original_max_position_embeddings=32)
    assert main(["export", str(scaled_run), "--hf", str(tmp_path / "hf")]) == 0
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)  # fp32, HF's modules
    assert hf.model.rotary_emb.rope_type == "yarn" and hf.model.rotary_emb.attention_scaling > 1
    native = load_trained_model(scaled_run)
    text = Path(line_corpus).read_bytes()[:257]
    tokens = torch.tensor([list(text)])  # 256 inputs: 4x the trained length, 8x the original 32
    with torch.no_grad():
        ref = _per_position_losses(native(tokens), tokens)
        got = _per_position_losses(hf(input_ids=tokens, use_cache=False).logits, tokens)
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-4)
        hf.config.rope_parameters = {"rope_type": "default", "rope_theta": 20000.0}
        plain = AutoModelForCausalLM.from_config(hf.config)
        plain.load_state_dict(hf.state_dict())
        unscaled = _per_position_losses(plain(input_ids=tokens, use_cache=False).logits, tokens)
    assert (unscaled - ref).abs().max() > 1e-3  # 10x the tolerance: without the exported scaling they differ


def test_init_from_takes_weights_only_with_a_new_rope(scaled_run, tmp_path, line_corpus):
    from loongtrain.launch.config import TrainConfig
    from loongtrain.launch.train_run import resolve_run
    from loongtrain.parallel.mesh import single_process_mesh
    from loongtrain.train.export import load_trained_model
    from loongtrain.train.trainer import Trainer

    cfg = TrainConfig.from_dict(dict(corpus=line_corpus, seq_len=128, steps=1, hp=1, cp=1, nproc=1,
                                     init_from=str(scaled_run), rope_scaling="linear:factor=2",
                                     out_dir=str(tmp_path / "next"), memory_report=False, progress="off",
                                     tensorboard=False, plot=False, peak_tflops=1.0))
    run = resolve_run(cfg, 1)
    assert run.cfg.model.init_from == str(scaled_run / "checkpoints" / "step_00000002")
    assert run.model_config.rope_scaling == RopeScaling("linear", factor=2.0)
    assert run.model_config.rope_theta == 20000.0  # the checkpoint's base, kept
    trainer = Trainer(run, single_process_mesh(), torch.device("cpu"))
    fresh = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    assert trainer.resume() == (0, {})
    trained = dict(load_trained_model(scaled_run).named_parameters())
    for name, param in trainer.model.named_parameters():
        assert torch.equal(param.detach(), trained[name].detach()), name
    assert any(not torch.equal(fresh[n], trained[n].detach()) for n in fresh)
    assert not trainer.optimizer.state and trainer.scheduler.last_epoch == 0


def test_rope_changes_need_a_new_run(scaled_run, tmp_path, line_corpus, capsys):
    import shutil

    run = shutil.copytree(scaled_run, tmp_path / "run")  # resumed below: the module's run stays as it was
    base = ["train", "--corpus", line_corpus, "--steps", "3", *ONE]
    resume = [*base, "--seq-len", "64", "--out-dir", str(run), "--resume", "--rope-theta", "20000"]
    cases = [
        ([*resume, "--rope-scaling", "yarn:factor=2,original_max_position_embeddings=32"],
         "--rope-scaling='yarn:factor=2,original_max_position_embeddings=32' differs from the checkpoint's "
         "'yarn:factor=4,original_max_position_embeddings=32'"),
        ([*resume, "--rope-scaling", "linear:factor=4"], "start a new run from them: --init-from"),
        ([*base, "--seq-len", "64", "--out-dir", str(run), "--resume", "--rope-scaling", YARN],
         "--rope-theta=0.0 differs from the checkpoint's 20000.0"),
        ([*base, "--seq-len", "128", "--out-dir", str(run), "--overwrite", "--init-from", str(run)],
         "is a checkpoint of this run"),
        ([*base, "--model", "1b", "--seq-len", "128", "--out-dir", str(tmp_path / "b"), "--init-from", str(run)],
         "holds a run of --model 'tiny', not '1b'"),
        ([*base, "--seq-len", "128", "--out-dir", str(tmp_path / "b"), "--init-from", str(tmp_path / "none")],
         "--init-from"),
    ]
    for argv, needle in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1, (needle, err)
    assert main([*resume, "--rope-scaling", "yarn:original_max_position_embeddings=32,factor=4"]) == 0  # same meaning
    assert (run / "checkpoints" / "step_00000003").is_dir()


def test_hf_model_keeps_hf_modules_with_a_new_rope(tmp_path):
    from loongtrain.data.synthetic import global_batch
    from loongtrain.hf import load_hf_model
    from loongtrain.launch.config import TrainConfig, run_of
    from loongtrain.parallel.config import ParallelConfig
    from loongtrain.parallel.mesh import single_process_mesh
    from loongtrain.train.checkpoint import write_checksums
    from loongtrain.train.model_setup import hf_run_config, model_config_for, model_record
    from loongtrain.train.trainer import Trainer
    from tests.helpers.hf_models import make_hf_dir

    model_dir = make_hf_dir(tmp_path / "llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                  "rope_theta": 10000.0})
    base = dict(model=str(model_dir), seq_len=64, dtype="fp64", parallel=ParallelConfig(hp=1, cp=1),
                out_dir=str(tmp_path / "out"), memory_report=False)
    with pytest.raises(ValueError, match=r"rope type 'dynamic' cannot train: dynamic NTK scaling is inference-only"):
        model_config_for(TrainConfig.from_dict(dict(**base)).model)
    cfg = TrainConfig.from_dict(dict(**base, rope_scaling=YARN, rope_theta=5e5))
    trainer = Trainer(run_of(cfg, model_config_for(cfg.model)), single_process_mesh(), torch.device("cpu"))
    rotary = trainer.model.model.rotary_emb
    assert type(rotary).__name__ == "LlamaRotaryEmbedding" and rotary.rope_type == "yarn"
    expected = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 5e5}
    assert model_record(trainer.model_config, cfg.model)["hf_config"]["rope_parameters"] == expected
    ref = load_hf_model(model_dir, dtype=torch.float64, config=hf_run_config(cfg.model))
    batch = global_batch(0, 1, 64, 256, seed=1)
    _, value = trainer.loss(batch)
    logits = ref(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    torch.testing.assert_close(value, F.cross_entropy(logits[0], batch["labels"][0]), rtol=0, atol=1e-10)
    # --init-from a checkpoint of this model: its recorded RoPE, changed again by the flags
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    record = model_record(trainer.model_config, cfg.model)
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 1, "scheduler": {}, "config": cfg.to_dict(),
                                                         **record}, default=str))
    write_checksums(ckpt)  # a complete checkpoint's record (no weights: only the configs are read here)
    later = TrainConfig.from_dict(dict(**base, init_from=str(ckpt), rope_theta=1e6))
    assert hf_run_config(later.model).rope_parameters == {**expected, "rope_theta": 1e6}
    assert model_config_for(later.model).rope_theta == 1e6


@pytest.mark.parametrize("value, needle", [
    (["--rope-scaling", "ntk:factor=2"], "unknown rope type 'ntk'; valid: ['default', 'linear', 'yarn', 'llama3']"),
    (["--rope-scaling", "yarn:original_max_position_embeddings=8192"], "rope type 'yarn' needs factor"),
    (["--rope-scaling", "linear:factor=0"], "factor=0.0 must be positive"),
    (["--rope-scaling", "linear:factor=2,beta_fast=4"], "'linear' does not take beta_fast=4.0; it takes ['factor']"),
    (["--rope-scaling", "yarn:factor=4"], "'yarn' needs original_max_position_embeddings"),
    (["--rope-scaling", "llama3:factor=8,low_freq_factor=1,high_freq_factor=4"],
     "'llama3' needs original_max_position_embeddings"),
    (["--rope-scaling", "dynamic:factor=2"], "'dynamic': dynamic NTK scaling is inference-only"),
    (["--rope-theta", "-5"], "--rope-theta=-5.0 must be a positive number"),
])
def test_bad_rope_options_exit_2_before_workers(value, needle, tmp_path, capsys, monkeypatch):
    from loongtrain.launch import train_run as launch

    def no_workers(*args, **kwargs):
        raise AssertionError("a worker was started")

    monkeypatch.setattr(launch, "run_local", no_workers)
    monkeypatch.setattr(launch, "run_worker", no_workers)
    assert main(["train", *value, "--nproc", "4", "--out-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("loongtrain train: error: --") and err.count("\n") == 1 and needle in err, err
