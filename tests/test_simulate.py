"""The full-size memory simulation (docs/design.md §9) checked where real tensors fit: the trainer's step
under FakeTensorMode peaks within 5% of the same step on real CPU tensors (both counted by torch's
MemTracker, storage by storage), on one rank and as one rank of four with the fake process group; and
``loongtrain plan --simulate --json`` prints the simulated and predicted peaks side by side."""

from __future__ import annotations

import json

import pytest

from loongtrain.cli import main as loongtrain_main
from loongtrain.model.config import ModelConfig
from loongtrain.parallel.config import ParallelConfig
from loongtrain.train.simulate import check_simulable, simulate_step

MODEL = ModelConfig(vocab_size=256, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=192)
TOLERANCE = 0.05


@pytest.mark.parametrize("world, parallel", [
    (1, ParallelConfig(ac_mode="full")),
    (4, ParallelConfig(hp=2, cp=2, zero="full", ac_mode="selective")),
    (4, ParallelConfig(hp=1, cp=2, zero="none", ac_mode="none")),  # dp = 2: the gradient all-reduce too
])
def test_simulation_matches_real_tensors(world, parallel):
    fake = simulate_step(MODEL, parallel, world, seq_len=512, dtype="bf16")
    real = simulate_step(MODEL, parallel, world, seq_len=512, dtype="bf16", fake=False)
    assert real.peak_bytes > 0 and real.parts["activation"] > 0  # the step ran and was counted
    assert abs(fake.peak_bytes - real.peak_bytes) <= TOLERANCE * real.peak_bytes, (fake, real)


def test_modes_the_trainer_lacks_are_refused():
    with pytest.raises(ValueError, match="offload_activations=True cannot be simulated yet"):
        check_simulable(ParallelConfig(ac_mode="full", offload_activations=True))


def test_plan_simulate_json(tmp_path, capsys):
    config = tmp_path / "plan.toml"
    config.write_text("[model]\nvocab_size = 256\ndim = 64\nnum_layers = 2\nnum_heads = 4\nnum_kv_heads = 2\n"
                      "ffn_dim = 192\n")
    argv = ["plan", "--config", str(config), "--gpus", "1", "--cluster", "h200", "--seq-len", "1K", "--simulate",
            "--json", "--modes", "off"]
    assert loongtrain_main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["simulated_device_gib"] > 0 and out["predicted_device_gib"] > 0 and out["world_size"] == 1
    assert out["device_ratio"] == pytest.approx(out["predicted_device_gib"] / out["simulated_device_gib"])
