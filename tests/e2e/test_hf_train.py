"""``loongtrain train --model DIR``, ``loongtrain export`` and ``loongtrain plan --model DIR`` for Hugging Face models.

- Trainer, one process, float64, every family: the chunked loss from the final hidden states equals
  the logits path (``sharded_cross_entropy`` of the full logits), loss and gradients (1e-10).
- World 4 (one gloo spawn): a tiny HF Llama directory made with ``save_pretrained`` trains with full
  ZeRO and selective recompute, and resume is exact (bit-identical losses); with the HF model,
  selective recompute recomputes no attention and sends no extra bytes in backward, full does; a native
  preset run for export.
- Export -> ``from_pretrained`` -> logits equal in float64 (1e-10) for the HF run and the native run.
- Bad input exits 2 naming the problem before any worker starts; the planner reads every family.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from loongtrain.commands import main as cli_main
from loongtrain.launch.config import TrainConfig
from loongtrain.model.config import ModelConfig, flops_per_token
from loongtrain.parallel.config import ParallelConfig
from tests.helpers.dist_utils import run_distributed
from tests.helpers.hf_models import DIR_COMMON as COMMON
from tests.helpers.hf_models import DIR_FAMILIES as FAMILIES
from tests.helpers.hf_models import DIR_VOCAB as VOCAB
from tests.helpers.hf_models import make_hf_dir

pytest.importorskip("transformers", reason="the hf extra is not installed (pip install -e '.[hf]')")

SEQ = 64




def write_corpus(path: Path) -> Path:
    path.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(200)))
    return path


def train_config(out_dir: Path, model: str, corpus: Path, **kw) -> TrainConfig:
    base = dict(model=model, corpus=str(corpus), seq_len=SEQ, batch_size=2, steps=4, warmup=1, lr=1e-2,
                dtype="fp64", out_dir=str(out_dir), peak_tflops=1.0, tensorboard=False, plot=False,
                progress="off", memory_report=False)
    return TrainConfig.from_dict(dict(**{**base, **kw}))


# ---- trainer, one process: the chunked loss equals the logits path --------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
def test_trainer_chunked_loss_equals_logits_path(tmp_path, family):
    import loongtrain
    from loongtrain.data.synthetic import global_batch
    from loongtrain.launch.config import run_of
    from loongtrain.loss.sharded import sharded_cross_entropy
    from loongtrain.train.model_setup import model_config_for
    from loongtrain.train.trainer import Trainer

    model_dir = make_hf_dir(tmp_path / family, family)
    for model in (str(model_dir), "tiny"):
        cfg = train_config(tmp_path / "out", model, tmp_path / "unused.txt", parallel=ParallelConfig(hp=1, cp=1))
        mesh = loongtrain.single_process_mesh()
        trainer = Trainer(run_of(cfg, model_config_for(cfg.model)), mesh, torch.device("cpu"))
        batch = global_batch(0, 1, SEQ, VOCAB, seed=1)
        batch["labels"] = batch["labels"].clone()
        batch["labels"][0, 5:9] = -100
        loss, value = trainer.loss(batch)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
        trainer.model.zero_grad(set_to_none=True)
        if model == "tiny":
            logits = trainer.model(batch["input_ids"], batch["position_ids"])
        else:
            logits = trainer.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        assert logits.dtype == torch.float64 and logits.shape == (1, SEQ, VOCAB)
        ref_loss, ref_value = sharded_cross_entropy(logits, batch["labels"], mesh)
        ref_loss.backward()
        torch.testing.assert_close(value, ref_value, rtol=0, atol=1e-10)
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-10)
        for name, param in trainer.model.named_parameters():
            torch.testing.assert_close(grads[name], param.grad, rtol=0, atol=1e-10, msg=f"{model} {name}")
        assert trainer.step([batch])["loss"] == pytest.approx(float(value), rel=1e-12)


# ---- world 4: train, resume, selective recompute with the HF model; export --------------------------------


def _ring_counts(cfg: TrainConfig, mesh, recompute: str) -> tuple[int, int]:
    """(ring forwards during backward, attention bytes sent during backward) of one micro-batch."""
    import dataclasses

    from loongtrain.data.synthetic import global_batch
    from loongtrain.launch.config import run_of
    from loongtrain.parallel.comm import CommCounter
    from loongtrain.train.model_setup import model_config_for
    from loongtrain.train.trainer import Trainer
    from tests.helpers.counting import count_ring_forward

    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, recompute=recompute))
    trainer = Trainer(run_of(cfg, model_config_for(cfg.model)), mesh, torch.device("cpu"))
    loss, _ = trainer.loss(global_batch(0, 1, SEQ, VOCAB, seed=2))
    with count_ring_forward() as calls, CommCounter() as comm:
        loss.backward()
    return calls["ring_forward"], sum(comm.bytes.values())


def _train_worker(rank: int, world: int, tmp: str, model_dir: str, tied_dir: str, corpus: str) -> dict:
    from loongtrain.parallel.mesh import init_mesh
    from tests.helpers.training import fit

    tmp, corpus_path = Path(tmp), Path(corpus)
    mesh = init_mesh(2, 2)
    opts = dict(parallel=ParallelConfig(hp=2, cp=2, zero="full", recompute="selective"))

    def losses(out: str, model: str = model_dir, **kw) -> list[float]:
        cfg = train_config(tmp / out, model, corpus_path, **{**opts, **kw})
        return [r["loss"] for r in fit(cfg, mesh, torch.device("cpu"))]

    result = {
        "full": losses("full"),
        "first": losses("split", stop_after=2),
        "second": losses("split", resume="latest"),
        "native": losses("native", model="tiny", steps=2),
    }
    cfg = train_config(tmp / "unused", model_dir, corpus_path, parallel=ParallelConfig(hp=2, cp=2))
    result["counts"] = {mode: _ring_counts(cfg, mesh, mode) for mode in ("none", "selective", "full")}
    result["sharded_build"] = [_sharded_build_matches(tmp, d, corpus_path, mesh) for d in (model_dir, tied_dir)]
    return result


def _sharded_build_matches(tmp: Path, model_dir: str, corpus: Path, mesh) -> bool:
    """FSDP2 builds the HF model on meta and reads each shard from the files: the same weights and
    buffers as ``load_hf_model`` (a tied head stays tied)."""
    from loongtrain.hf import load_hf_model
    from loongtrain.launch.config import run_of
    from loongtrain.train.model_setup import model_config_for
    from loongtrain.train.trainer import Trainer

    cfg = train_config(tmp / "unused", model_dir, corpus, parallel=ParallelConfig(hp=2, cp=2, zero="full"))
    model = Trainer(run_of(cfg, model_config_for(cfg.model)), mesh, torch.device("cpu")).model
    ref = load_hf_model(model_dir, dtype=torch.float64)
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    same = set(full) == set(dict(ref.named_parameters())) and all(
        torch.equal(full[n], p) for n, p in ref.named_parameters())
    same &= all(torch.equal(b, dict(model.named_buffers())[n]) for n, b in ref.named_buffers())
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    return same and tied == bool(ref.config.tie_word_embeddings)


def _checkpoint_weights(checkpoint: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """The model tensors of a DCP checkpoint, read by torch's own converter (not by loongtrain)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint, tmp / "weights.pt")
    return torch.load(tmp / "weights.pt", weights_only=False)["model"]


@pytest.mark.distributed
def test_train_resume_selective_and_export_world4(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from loongtrain.hf import load_hf_model
    from loongtrain.model import Transformer
    from tests.helpers.hf_models import force_fp64

    model_dir = make_hf_dir(tmp_path / "llama")
    corpus = write_corpus(tmp_path / "corpus.txt")
    tied_dir = make_hf_dir(tmp_path / "qwen2", "Qwen2ForCausalLM")
    results = run_distributed(_train_worker, 4, str(tmp_path), str(model_dir), str(tied_dir), str(corpus))
    got = results[0]
    assert all(r == got for r in results), "ranks disagree"
    full, first, second = got["full"], got["first"], got["second"]
    assert len(full) == 4 and full[-1] < full[0]
    assert first == full[:2] and second == full[2:], "resume must be bit-identical"
    layers = COMMON["num_hidden_layers"]
    (none_calls, none_bytes), (sel_calls, sel_bytes), (full_calls, full_bytes) = (
        got["counts"][m] for m in ("none", "selective", "full"))
    assert none_calls == 0 and sel_calls == 0 and full_calls == layers
    assert sel_bytes == none_bytes > 0 and full_bytes > none_bytes
    assert got["sharded_build"] == [True, True]

    inputs = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(4))
    positions = torch.arange(SEQ).expand(2, SEQ)
    # HF run: the exported model is the checkpoint's, and it has trained
    checkpoint = tmp_path / "full" / "checkpoints" / "step_00000004"
    assert cli_main(["export", str(tmp_path / "full"), "--hf", str(tmp_path / "hf_out")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf_out", dtype=torch.float64, local_files_only=True)
    assert type(exported).__name__ == "LlamaForCausalLM"
    reference = load_hf_model(model_dir, dtype=torch.float64)
    initial = reference(input_ids=inputs, position_ids=positions).logits
    reference.load_state_dict(_checkpoint_weights(checkpoint, tmp_path))
    expected = reference(input_ids=inputs, position_ids=positions).logits
    logits = exported(input_ids=inputs, position_ids=positions, use_cache=False).logits
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-10)
    assert (logits - initial).abs().max() > 1e-3
    # native preset run: LlamaForCausalLM with the preset's norm eps, equal to loongtrain's own decoder
    out = tmp_path / "native_out"
    assert cli_main(["export", str(tmp_path / "native" / "checkpoints"), "--hf", str(out)]) == 0
    saved = json.loads((out / "config.json").read_text())
    assert saved["architectures"] == ["LlamaForCausalLM"] and saved["rms_norm_eps"] == 1e-5
    native = Transformer(ModelConfig(**json.loads(
        (tmp_path / "native" / "checkpoints" / "step_00000002" / "trainer_state.json").read_text())["model_config"]),
        seed=None).double()
    native.load_state_dict(_checkpoint_weights(tmp_path / "native" / "checkpoints" / "step_00000002", tmp_path))
    hf = force_fp64(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64, local_files_only=True))
    torch.testing.assert_close(hf(input_ids=inputs, position_ids=positions, use_cache=False).logits,
                               native(inputs, positions), rtol=0, atol=1e-10)


def test_cli_train_and_export_one_process(tmp_path):
    """The command line as a user runs it (one worker, in this process): train, resume, export."""
    from transformers import AutoModelForCausalLM

    model_dir = make_hf_dir(tmp_path / "qwen3", "Qwen3ForCausalLM", weights=False)  # random init
    corpus = write_corpus(tmp_path / "corpus.txt")
    args = ["train", "--model", str(model_dir), "--corpus", str(corpus), "--seq-len", str(SEQ), "--nproc", "1",
            "--hp", "1", "--cp", "1", "--steps", "2", "--out-dir", str(tmp_path / "run"), "--progress", "off",
            "--no-tensorboard", "--no-plot", "--peak-tflops", "1", "--no-memory-report", "--recompute", "selective"]
    assert cli_main([*args, "--stop-after", "1"]) == 0
    assert cli_main([*args, "--resume"]) == 0
    from loongtrain.train.metrics import read_jsonl

    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1, 2]
    assert cli_main(["export", str(tmp_path / "run"), "--hf", str(tmp_path / "out"), "--dtype", "bf16"]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True)
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.dtype == torch.bfloat16
    assert cli_main(["export", str(tmp_path / "nothing"), "--hf", str(tmp_path / "x")]) == 2


# ---- bad input: exit 2 naming the problem, before any worker starts -------------------------------


def _bad_dir(tmp_path: Path, case: str) -> Path:
    if case == "no_config":
        (tmp_path / "empty").mkdir()
        return tmp_path / "empty"
    if case == "unsupported":
        from transformers import GPT2Config

        GPT2Config(n_layer=1, n_embd=16, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path / "g")
        return tmp_path / "g"
    if case == "weights":
        path = make_hf_dir(tmp_path / "llama")
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, "intermediate_size": 40}))
        return path
    if case == "tokenizer":
        return make_hf_dir(tmp_path / "small", weights=False, vocab_size=128)
    return tmp_path / "no_such_dir"


BAD_INPUTS = {
    "no_config": r"is not a Hugging Face model directory: it has no config\.json",
    "unsupported": r"unsupported Hugging Face architecture 'GPT2LMHeadModel': GPT2LMHeadModel has no decoder layers "
                   r"at base_model\.layers; tested architectures: \['LlamaForCausalLM', 'MistralForCausalLM', ",
    "weights": r"weight 'model\.layers\.0\.mlp\.down_proj\.weight' has shape \(32, 48\) "
               r"but config\.json needs \(32, 40\)",
    "tokenizer": r"tokenizer 'byte' has 256 tokens but the model .* has a vocabulary of 128",
    "missing": r"unknown preset and no such directory; presets: \[",
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_exits_2_before_workers(tmp_path, capsys, monkeypatch, case):
    import re

    from loongtrain.launch import train_run as launch

    def no_workers(*args, **kwargs):
        raise AssertionError("a worker was started")

    monkeypatch.setattr(launch, "run_local", no_workers)
    monkeypatch.setattr(launch, "run_worker", no_workers)
    path = _bad_dir(tmp_path, case)
    rc = cli_main(["train", "--model", str(path), "--seq-len", str(SEQ), "--nproc", "4",
                   "--out-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert re.search(BAD_INPUTS[case], err), err


def test_local_tokenizer_in_model_dir_is_used(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from loongtrain.train.model_setup import model_config_for, tokenizer_spec

    vocab = {t: i for i, t in enumerate(["<unk>", "</s>", *(f"w{i}" for i in range(198))])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    model_dir = make_hf_dir(tmp_path / "m", weights=False, vocab_size=200)
    tokenizer.save(str(model_dir / "tokenizer.json"))
    cfg = TrainConfig.from_dict(dict(model=str(model_dir)))
    assert tokenizer_spec(cfg.model) == str(model_dir)
    assert model_config_for(cfg.model).vocab_size == 200  # the byte tokenizer (256) would not fit
    assert tokenizer_spec(TrainConfig.from_dict(dict(model=str(model_dir), tokenizer="byte")).model) == "byte"
    with pytest.raises(ValueError, match="has 256 tokens but the model"):
        model_config_for(TrainConfig.from_dict(dict(model=str(model_dir), tokenizer="byte")).model)
    assert tokenizer_spec(TrainConfig.from_dict(dict(model="tiny")).model) == "byte"


# ---- planner -------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
def test_plan_reads_every_family(tmp_path, capsys, family):
    from loongtrain.plan.search import resolve_model

    window = {"MistralForCausalLM": dict(sliding_window=1024)}.get(family, {})
    model_dir = make_hf_dir(tmp_path / family, family, weights=False, num_hidden_layers=3,
                            num_key_value_heads=1, **window)
    for spec in (model_dir, model_dir / "config.json"):
        _, config = resolve_model(str(spec))
        assert (config.num_layers, config.dim, config.num_heads, config.num_kv_heads, config.vocab_size,
                config.ffn_dim) == (3, 32, 4, 1, VOCAB, 48)
        assert config.head_dim == (16 if family == "Qwen3ForCausalLM" else 8)
        assert config.sliding_window == (1024 if window else None)
        assert config.tie_embeddings == (family == "Qwen2ForCausalLM")
    rc = cli_main(["plan", "--model", str(model_dir), "--seq-len", "8K", "--nodes", "1", "--cluster", "h100",
                   "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["model"] == str(model_dir) and out["candidates"]
    if window:  # a window shorter than the sequence: fewer attention FLOPs per token
        full = ModelConfig(**{**config.__dict__, "sliding_window": 0})
        assert flops_per_token(config, 8192) < flops_per_token(full, 8192)
        assert flops_per_token(config, 1024) == flops_per_token(full, 1024)


def test_autoplan_plans_the_hf_model(tmp_path, monkeypatch):
    from loongtrain.launch import autoplan

    model_dir = make_hf_dir(tmp_path / "q", "Qwen3ForCausalLM", weights=False)
    seen = {}

    def best_fitting(model, cluster, **kw):
        seen["model"] = model
        raise ValueError("stop here")

    monkeypatch.setattr(autoplan, "best_fitting", best_fitting)
    cfg = TrainConfig.from_dict(dict(model=str(model_dir), plan="auto", cluster="h100", seq_len=SEQ))
    with pytest.raises(ValueError, match="stop here"):
        autoplan.apply_plan(cfg, 8, under_launcher=False)
    assert seen["model"].head_dim == 16 and seen["model"].num_kv_heads == 2
