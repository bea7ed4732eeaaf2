"""Fast single-process tests: options, TOML precedence, schedule, clipping, checkpoint pointer, MFU peak."""

from __future__ import annotations

import math
from dataclasses import fields

import pytest
import torch

from loongtrain.commands.parser import build_parser, options
from loongtrain.commands.train import parse_args
from loongtrain.data.synthetic import synthetic_source
from loongtrain.launch.config import TrainConfig
from loongtrain.parallel.config import ParallelConfig
from loongtrain.parallel.mesh import single_process_mesh
from loongtrain.plan.cluster import builtin_clusters, cluster_for_device, load_cluster
from loongtrain.train.checkpoint import resolve_checkpoint
from loongtrain.train.metrics import CUDA_PEAK_TFLOPS, device_peak_tflops, measure_cpu_tflops
from loongtrain.train.optim import clip_grad_norm, lr_factor
from tests.helpers.fixtures import tiny_model
from tests.helpers.training import fit


def test_help_documents_every_field_with_default():
    text = " ".join(build_parser(TrainConfig, "loongtrain train", "").format_help().split())
    names = [opt.name for opt in options(TrainConfig)]
    assert set(names) == {f.name for section in TrainConfig.sections().values() for f in fields(section)}
    for name in names:
        flag = "--" + name.replace("_", "-")
        assert flag in text, flag
    assert "(default: 8192)" in text and "(default: 'tiny')" in text
    assert "--hp HP head-parallel degree (all-to-all group size) (default: 2)" in text
    assert "--cp CP context-parallel degree (ring size) (default: 2)" in text


def test_parallel_flags_round_trip_into_cfg_parallel():
    assert TrainConfig().parallel == ParallelConfig(hp=2, cp=2)  # the README's default run: 4 workers
    argv = ["--hp", "1", "--cp", "4", "--inner-ring", "2", "--placement", "context_first", "--interleaved",
            "--zero", "hybrid", "--zero-shard-size", "2", "--no-reshard-after-forward",
            "--recompute", "selective", "--recompute-fraction", "0.5"]
    cfg = parse_args(argv)
    assert cfg.parallel == ParallelConfig(hp=1, cp=4, inner_ring=2, placement="context_first", interleaved=True,
                                          zero="hybrid", zero_shard_size=2, reshard_after_forward=False,
                                          recompute="selective", recompute_fraction=0.5)
    assert parse_args(["--hp", "4"]).parallel == ParallelConfig(hp=4, cp=2)  # the others keep defaults
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg  # what checkpoints record reads back
    assert cfg.to_dict()["parallel"]["recompute"] == "selective"


def test_toml_parallel_keys_flat_or_in_a_table(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('zero = "full"\n[parallel]\nhp = 1\ncp = 4\nrecompute = "full"\n')
    cfg = parse_args(["--config", str(path), "--cp", "8"])
    assert cfg.parallel == ParallelConfig(hp=1, cp=8, zero="full", recompute="full")
    path.write_text('[parallel]\nhp = "two"\n')
    with pytest.raises(ValueError, match="hp = 'two' must be of type int"):
        parse_args(["--config", str(path)])
    with pytest.raises(ValueError, match="inner_ring=3 must divide cp=2"):
        parse_args(["--inner-ring", "3"])
    with pytest.raises(ValueError, match="unknown parallel option"):
        TrainConfig.from_dict({"parallel": {"tp": 2}})


def test_toml_then_command_line_precedence(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('model = "tiny"\nseq-len = 256\nlr = 1\nsteps = 7\n[train]\nhp = 1\n')
    cfg = parse_args(["--config", str(path), "--steps", "9", "--no-tensorboard"])
    assert (cfg.data.seq_len, cfg.optim.lr, cfg.optim.steps, cfg.parallel.hp, cfg.parallel.cp,
            cfg.output.tensorboard) == \
        (256, 1.0, 9, 1, 2, False)
    assert parse_args(["--resume"]).output.resume == "latest"
    assert parse_args([]).output.resume == ""


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--bogus", "1"], "--bogus"),
        (["--steps", "0"], "--steps=0"),
        (["--dtype", "fp8"], "fp8"),
    ],
)
def test_bad_options_raise_value_error(argv, needle):
    with pytest.raises(ValueError, match=needle):
        parse_args(argv)


def test_no_second_names(tmp_path):
    """One name per option: the old names of validation and recompute are unknown options, everywhere."""
    for argv in (["--eval-interval", "3"], ["--ac-mode", "full"], ["--window", "2"], ["--plan-cluster", "h100"],
                 ["--seq-len-schedule", "8K:1"], ["--chunk-layout", "balanced"]):
        with pytest.raises(ValueError, match=argv[0]):
            parse_args(argv)
    toml = tmp_path / "run.toml"
    toml.write_text("eval_interval = 5\n")
    with pytest.raises(ValueError, match="unknown option 'eval_interval'"):
        parse_args(["--config", str(toml)])
    with pytest.raises(ValueError, match="eval_interval"):
        TrainConfig.from_dict({"eval_interval": 3})


def test_bad_toml_key(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("sequence_length = 5\n")
    with pytest.raises(ValueError, match="sequence_length"):
        parse_args(["--config", str(path)])
    path.write_text('steps = "many"\n')
    with pytest.raises(ValueError, match="steps"):
        parse_args(["--config", str(path)])


def test_warmup_cosine_schedule():
    f = [lr_factor(s, warmup=4, total=20, min_ratio=0.1) for s in range(20)]
    assert f[:4] == [0.25, 0.5, 0.75, 1.0]
    assert f[4] == 1.0 and math.isclose(f[-1], 0.1)
    assert all(a >= b for a, b in zip(f[3:], f[4:], strict=False))


def test_clip_grad_norm():
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))]
    params[0].grad = torch.tensor([3.0, 0.0, 0.0])
    params[1].grad = torch.tensor([0.0, 4.0, 0.0, 0.0])
    assert float(clip_grad_norm(params, 1.0)) == pytest.approx(5.0)
    total = torch.cat([p.grad for p in params]).norm()
    assert float(total) == pytest.approx(1.0, rel=1e-5)


def test_checkpoint_pointer_is_atomic_and_resume_is_exact(tmp_path):
    model = tiny_model(num_layers=1, num_kv_heads=4)
    base = dict(seq_len=16, batch_size=2, steps=4, warmup=1, parallel=ParallelConfig(), peak_tflops=1.0,
                tensorboard=False, plot=False, progress="off", out_dir=str(tmp_path))
    source = synthetic_source(64)
    mesh, cpu = single_process_mesh(), torch.device("cpu")
    full = fit(TrainConfig.from_dict(dict(**{**base, "out_dir": str(tmp_path / "full")})), mesh, cpu,
               model_config=model, batch_source=source)
    fit(TrainConfig.from_dict(dict(**base, stop_after=2)), mesh, cpu, model_config=model, batch_source=source)
    root = tmp_path / "checkpoints"
    assert resolve_checkpoint("latest", tmp_path).name == "step_00000002"
    (root / "step_00000003.tmp").mkdir()  # a save that died half-way is never "latest"
    assert resolve_checkpoint("latest", tmp_path).name == "step_00000002"
    rest = fit(TrainConfig.from_dict(dict(**base, resume="latest")), mesh, cpu, model_config=model, batch_source=source)
    assert [r["loss"] for r in rest] == [r["loss"] for r in full[2:]]
    keep = fit(TrainConfig.from_dict(dict(**{**base, "out_dir": str(tmp_path / "keep"), "ckpt_interval": 1,
                              "keep_checkpoints": 2})), mesh, cpu, model_config=model, batch_source=source)
    assert [r["loss"] for r in keep] == [r["loss"] for r in full]
    kept = sorted(p.name for p in (tmp_path / "keep" / "checkpoints").iterdir())
    assert kept == ["latest", "step_00000003", "step_00000004"]
    with pytest.raises(ValueError, match="no complete checkpoint"):
        resolve_checkpoint(str(tmp_path / "nowhere"), tmp_path)


def test_optional_sinks_are_skipped_when_missing(tmp_path, monkeypatch):
    import sys

    from loongtrain.train.metrics import MetricsLogger, plot_loss_curve

    for name in ("matplotlib", "tqdm", "torch.utils.tensorboard"):
        monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
    logger = MetricsLogger(tmp_path, total_steps=1, start_step=0, tensorboard=True, progress="on")
    logger.log({"step": 1, "total_steps": 1, "loss": 1.0, "lr": 0.1, "tokens_per_s": 1.0, "tflops": 0.0,
                "mfu": float("nan"), "peak_mem_gib": 0.1})
    logger.close()
    assert plot_loss_curve(logger.jsonl_path, tmp_path / "loss.png") is False
    assert not (tmp_path / "loss.png").exists() and (tmp_path / "metrics.jsonl").is_file()


def test_peak_table_and_cpu_measurement():
    # one table: preset devices take the cluster TOML's peak, the others CUDA_PEAK_TFLOPS; no name twice
    presets = {key: load_cluster(name) for name in builtin_clusters() for key in load_cluster(name).device_names}
    assert presets and not set(presets) & set(CUDA_PEAK_TFLOPS)
    assert device_peak_tflops("NVIDIA H100 80GB HBM3") == load_cluster("h100").peak_tflops == 989.0
    assert device_peak_tflops("NVIDIA A100-SXM4-80GB") == load_cluster("a100").peak_tflops == 312.0
    assert device_peak_tflops("NVIDIA H100 PCIe") == 756.0  # longest match wins
    assert device_peak_tflops("NVIDIA A10G") == 70.0 and device_peak_tflops("Some GPU") is None
    assert cluster_for_device("NVIDIA H200").name == "h200" and cluster_for_device("NVIDIA L4") is None
    assert 0 < measure_cpu_tflops(size=128, seconds=0.05) < 100


def test_every_option_says_what_a_resume_may_do_with_it():
    """Each option of ``loongtrain train`` declares its resume rule where it is declared; the launcher's resume
    rule is what they declare: what changes the loss is kept, the objective's options included."""
    import dataclasses

    import pytest

    from loongtrain.launch.config import TrainConfig
    from loongtrain.launch.preflight import MUST_MATCH, NEW_RUN_CHANGES
    from loongtrain.train.config import TrainSections

    rules = TrainConfig.resume_rules()
    assert set(rules) == set(TrainConfig.option_sections())
    for name in ("lr", "seed", "corpus", "doc_mask", "position_reset", "decode_errors", "grad_accum", "objective",
                 "loss_on", "chat_template", "on_long", "dpo_beta", "ref_model"):
        assert name in MUST_MATCH, name
    assert set(NEW_RUN_CHANGES) == {"seq_len", "seq_len_stages", "rope_theta", "rope_scaling"} <= set(MUST_MATCH)
    assert not {"hp", "cp", "zero", "steps", "warmup", "clip", "dtype", "out_dir", "batch_size"} & set(MUST_MATCH)

    loose = dataclasses.make_dataclass("Loose", [("undeclared", int, dataclasses.field(default=0))])
    sections = dataclasses.make_dataclass("Sections", [("loose", loose, dataclasses.field(default_factory=loose))],
                                          bases=(TrainSections,))
    with pytest.raises(ValueError, match=r"option --undeclared of section 'loose' declares no resume rule"):
        sections.resume_rules()
