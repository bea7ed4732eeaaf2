"""LoRA in one process (docs/lora.md): ``--lora`` parsed; loongtrain's decoder takes Hugging Face's module names
and its own; the trainer's loss and adapter gradients equal ``peft``'s on the same base (float64, 1e-10) for an HF
Llama and loongtrain's decoder, plain and under every memory mode; the first forward is the base model's, bit for
bit; only the adapters get gradients and optimizer state; merging equals the unmerged forward; mixture-of-experts
expert weights are refused; the planner counts the adapters' states and matches the simulation."""

from __future__ import annotations

import pytest
import torch

from loongtrain.data.synthetic import global_batch
from loongtrain.launch.config import TrainConfig, run_of
from loongtrain.model.config import ModelConfig, num_params
from loongtrain.model.llama import Transformer
from loongtrain.model.lora import LoraConfig, adapter_params, parse_lora
from loongtrain.parallel.config import ParallelConfig
from loongtrain.parallel.mesh import single_process_mesh
from loongtrain.parallelize.lora import apply_lora, find_targets, is_adapter, merge_lora
from loongtrain.train.model_setup import model_config_for
from loongtrain.train.trainer import Trainer
from tests.helpers.lora import full_grads, make_llama_dir, max_diff, peft_reference, set_adapters

pytest.importorskip("peft", reason="the hf extra is not installed (pip install -e '.[hf]')")

TOL = 1e-10
SEQ = 32
NATIVE = ModelConfig(vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=48)
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_llama_dir(tmp_path_factory.mktemp("lora_llama"))


@pytest.mark.parametrize("text, want", [
    ("r=16,alpha=32,dropout=0,targets=q_proj,k_proj,v_proj,o_proj",
     LoraConfig(16, 32.0, 0.0, ("q_proj", "k_proj", "v_proj", "o_proj"))),
    ("r=8", LoraConfig(r=8)),
    ("targets=wq,down_proj,alpha=4", LoraConfig(alpha=4.0, targets=("wq", "down_proj"))),
    (" r = 4 , dropout = 0.05 , targets = all-linear ", LoraConfig(r=4, dropout=0.05, targets=("all-linear",))),
    ("", None),
])
def test_parse_lora(text, want):
    got = parse_lora(text)
    assert got == want
    if got is not None:
        assert parse_lora(got.to_text()) == got  # what the log and the checkpoints write reads back
        assert got.scaling == got.alpha / got.r


def test_native_decoder_takes_both_spellings():
    model = Transformer(NATIVE, seed=0)
    hf = [n for n, _ in find_targets(model, LoraConfig(targets=("q_proj", "down_proj")))]
    own = [n for n, _ in find_targets(model, LoraConfig(targets=("wq", "w2")))]
    assert hf == own == ["layers.0.attention.wq", "layers.0.feed_forward.w2", "layers.1.attention.wq",
                         "layers.1.feed_forward.w2"]
    every = find_targets(model, LoraConfig(targets=("all-linear",)))
    assert len(every) == 7 * NATIVE.num_layers


def test_mixture_of_experts_expert_weights_are_refused():
    import transformers

    config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=2)
    with torch.device("meta"):
        model = transformers.MixtralForCausalLM(config)
    with pytest.raises(ValueError, match=r"it names mixture-of-experts expert weights \(model.layers.0.mlp.experts\)"
                                         r", which LoRA does not adapt.*from: k_proj, o_proj, q_proj, v_proj$"):
        find_targets(model, LoraConfig(targets=("q_proj", "down_proj")))
    with pytest.raises(ValueError, match=r"all-linear reaches mixture-of-experts expert weights"):
        find_targets(model, LoraConfig(targets=("all-linear",)))
    # a name that matches nothing: the message offers only what is accepted, never all-linear on such a model
    with pytest.raises(ValueError) as err:
        find_targets(model, LoraConfig(targets=("qkv",)))
    assert "valid module names: k_proj, o_proj, q_proj, v_proj" in str(err.value)
    assert "all-linear" not in str(err.value)
    assert len(find_targets(model, LoraConfig(targets=("q_proj", "v_proj")))) == 2  # attention: fine


def _trainer(model: str, targets: tuple[str, ...], *, compile: str = "off", **modes) -> Trainer:
    cfg = TrainConfig.from_dict(dict(model=model, seq_len=SEQ, steps=2, warmup=1, dtype="fp64", compile=compile,
                      lora=LoraConfig(r=4, alpha=8.0, targets=targets).to_text(), memory_report=False,
                      parallel=ParallelConfig(**modes)))
    config = NATIVE if model == "tiny" else model_config_for(cfg.model)
    return Trainer(run_of(cfg, config), single_process_mesh(), torch.device("cpu"), batches=lambda *a: iter(()))


def _reference_base(model: str):
    if model == "tiny":
        return Transformer(NATIVE, seed=0).double()
    from loongtrain.hf.load import load_hf_model

    return load_hf_model(model, dtype=torch.float64)


MODES = {"plain": {}, "recompute-full": {"recompute": "full"},
         "selective-offload": {"recompute": "selective", "offload_activations": True},
         "tiles": {"mlp_tiles": "2", "recompute": "full"}}


@pytest.mark.parametrize("mode", [*MODES, "compile"])
@pytest.mark.parametrize("kind", ["hf", "native"])
def test_loss_and_adapter_gradients_equal_peft(kind, mode, hf_dir, monkeypatch):
    from loongtrain.parallelize import compile as compile_step

    monkeypatch.setattr(compile_step, "BACKEND", "aot_eager")  # the same graphs as inductor, no code generation
    model = "tiny" if kind == "native" else str(hf_dir)
    vocab = NATIVE.vocab_size if kind == "native" else 256
    trainer = _trainer(model, ALL, compile="on" if mode == "compile" else "off", **MODES.get(mode, {}))
    names = set_adapters(trainer.model)
    assert len(names) == 2 * 7 * 2  # A and B of 7 modules in 2 blocks
    batch = global_batch(0, 1, SEQ, vocab, seed=1)
    loss, value = trainer.loss(batch)
    loss.backward()
    targets = list(ALL) if kind == "hf" else ["wq", "wk", "wv", "wo", "w1", "w3", "w2"]
    want_loss, want_grads = peft_reference(_reference_base(model), targets, 4, 8.0, batch)
    assert abs(float(value) - want_loss) <= TOL
    grads = full_grads(trainer.model)
    assert max_diff(grads, want_grads) <= TOL
    assert min(float(g.abs().max()) for g in grads.values()) > 1e-6  # A's gradients too: B is not zero
    assert all(p.grad is None for p in trainer.model.parameters() if not p.requires_grad)


def test_first_forward_is_the_base_models_and_only_adapters_train():
    plain = Trainer(run_of(TrainConfig.from_dict(dict(seq_len=SEQ, dtype="fp64", memory_report=False,
                                                      parallel=ParallelConfig())),
                        NATIVE), single_process_mesh(), torch.device("cpu"), batches=lambda *a: iter(()))
    lora = _trainer("tiny", ("q_proj", "v_proj"))
    batch = global_batch(0, 1, SEQ, NATIVE.vocab_size, seed=1)
    assert float(lora.loss(batch)[1]) == float(plain.loss(batch)[1])  # B = 0: bit for bit the base model
    before = {n: p.detach().clone() for n, p in lora.model.named_parameters()}
    trained = {n for n, p in lora.model.named_parameters() if p.requires_grad}
    assert trained and all(is_adapter(n) for n in trained)
    assert sum(lora.model.get_parameter(n).numel() for n in trained) == adapter_params(
        NATIVE, lora.cfg.model.lora_config())
    optimized = {id(p) for g in lora.optimizer.param_groups for p in g["params"]}
    assert optimized == {id(lora.model.get_parameter(n)) for n in trained}
    for step in range(2):
        lora.step([global_batch(step, 1, SEQ, NATIVE.vocab_size, seed=1)])
    assert {id(p) for p in lora.optimizer.state} == optimized  # AdamW state for the adapters only
    for name, param in lora.model.named_parameters():
        assert torch.equal(param, before[name]) != (name in trained), name  # the base is frozen, adapters move


def test_merge_equals_the_unmerged_forward():
    model = Transformer(NATIVE, seed=0).double()
    apply_lora(model, LoraConfig(r=4, alpha=8.0, targets=("all-linear",)), seed=0)
    set_adapters(model)
    ids = global_batch(0, 1, SEQ, NATIVE.vocab_size, seed=2)["input_ids"]
    with torch.no_grad():
        unmerged = model(ids)
        merged = merge_lora(model)(ids)
    assert (merged - unmerged).abs().max() <= TOL
    assert sorted(model.state_dict()) == sorted(Transformer(NATIVE, seed=0).state_dict())  # a plain model again
    assert all(type(m) is torch.nn.Linear for m in model.modules() if isinstance(m, torch.nn.Linear))


def test_planner_counts_the_adapters_states_only():
    from tests.helpers.plan_cases import memory

    lora = parse_lora("r=16,targets=q_proj,k_proj,v_proj,o_proj")
    layout = ParallelConfig().layout(4)
    full = memory(NATIVE, layout, seq_len=64, batch=1, zero_size=4, recompute="full")
    adapted = memory(NATIVE, layout, seq_len=64, batch=1, zero_size=4, recompute="full", lora=lora)
    p, a = num_params(NATIVE), adapter_params(NATIVE, lora)
    d, q, kv = NATIVE.dim, NATIVE.num_heads * NATIVE.head_dim, NATIVE.num_kv_heads * NATIVE.head_dim
    assert a == NATIVE.num_layers * 16 * ((d + q) + 2 * (d + kv) + (q + d))
    assert full["states"] == 16 * p / 4 and adapted["states"] == (4 * p + 16 * a) / 4


#: a shape whose peak is the activations' (as tests/unit/test_simulate.py's)
WIDE = ModelConfig(vocab_size=8192, dim=1024, num_layers=4, num_heads=8, num_kv_heads=2, ffn_dim=3584)


@pytest.mark.parametrize("world, modes, seq, lora", [
    (2, {"cp": 2, "zero": "full", "recompute": "full"}, 131072, "r=16"),
    (1, {"recompute": "none"}, 16384, "r=8,targets=gate_proj,dropout=0.1"),
    (1, {"recompute": "full", "zero": "full", "offload_params": True, "offload_activations": True}, 65536,
     "r=16,targets=all-linear"),
], ids=["zero-cp2", "none-mlp-dropout", "offload"])
def test_planner_matches_the_simulation_with_lora(world, modes, seq, lora):
    from loongtrain.launch.simulate import simulate_step
    from loongtrain.plan.memory_model import memory_per_rank
    from loongtrain.plan.memory_terms import feature_terms

    parallel = ParallelConfig(**modes)
    predicted = memory_per_rank(WIDE, parallel.layout(world), parallel, seq_len=seq, batch=1, dtype_bytes=2,
                                zero_size=world if parallel.zero != "none" else 1,
                                features=feature_terms(parse_lora(lora)))
    simulated = simulate_step(WIDE, parallel, world, seq_len=seq, lora=lora)
    assert abs(predicted["total"] / simulated.peak_bytes - 1) <= 0.10, (predicted, simulated)
    assert simulated.parts["optstate"] <= 16 * adapter_params(WIDE, parse_lora(lora))  # AdamW's m, v: adapters'
    if parallel.offload_activations:
        assert predicted["host"] == pytest.approx(simulated.host_bytes, rel=1e-6)  # AdamW's step counters aside


@pytest.mark.parametrize("world, modes", [
    (4, {"hp": 2, "cp": 2, "zero": "full", "recompute": "selective"}),
    (4, {"hp": 2, "cp": 2, "zero": "full", "recompute": "full", "offload_activations": True, "offload_params": True,
         "mlp_tiles": "2"}),
], ids=["zero", "zero-offload-tiles"])
def test_simulation_of_a_lora_step_matches_real_tensors(world, modes):
    """The bf16 step (FSDP2 gathering bf16 weights, frozen base and adapters in one group) on real CPU tensors as
    one rank of four (torch's fake process group), against the same step under fake tensors."""
    from loongtrain.launch.simulate import simulate_step

    small = ModelConfig(vocab_size=256, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=192)
    parallel = ParallelConfig(**modes)
    kw = dict(seq_len=512, dtype="bf16", lora="r=4,targets=all-linear")
    fake, real = (simulate_step(small, parallel, world, fake=f, **kw) for f in (True, False))
    assert real.parts["activation"] > 0 and real.parts["optstate"] <= 16 * adapter_params(small, parse_lora(kw["lora"]))
    assert abs(fake.peak_bytes - real.peak_bytes) <= 0.05 * real.peak_bytes, (fake, real)
    assert abs(fake.host_bytes - real.host_bytes) <= 0.05 * real.host_bytes, (fake, real)


def test_a_preset_base_of_another_shape_is_refused():
    import dataclasses

    from loongtrain.train.lora_base import base_record, check_base

    cfg = TrainConfig.from_dict(dict(lora="r=4"))
    state = {"model_config": json_record(NATIVE), "lora": base_record(cfg.model, cfg.optim.seed,
                                                                                {"model_config": json_record(NATIVE)})}
    check_base(state, "ckpt", NATIVE)  # the same shape: fine
    with pytest.raises(ValueError, match="checkpoint 'ckpt': its LoRA base, preset 'tiny' with seed 0, has another "
                                         "shape now than it trained on"):
        check_base(state, "ckpt", dataclasses.replace(NATIVE, norm_eps=1e-6))


def json_record(config: ModelConfig) -> dict:
    """A ModelConfig as a checkpoint's trainer_state.json holds it."""
    import dataclasses
    import json

    return json.loads(json.dumps(dataclasses.asdict(config), default=str))


def test_dropout_drops_in_training_only():
    batch = global_batch(0, 1, SEQ, NATIVE.vocab_size, seed=1)
    values = {}
    for dropout in (0.0, 0.5):
        cfg = TrainConfig.from_dict(dict(seq_len=SEQ, dtype="fp64", memory_report=False, parallel=ParallelConfig(),
                          lora=f"r=4,alpha=8,dropout={dropout},targets=q_proj,up_proj"))
        trainer = Trainer(run_of(cfg, NATIVE), single_process_mesh(), torch.device("cpu"), batches=lambda *a: iter(()))
        set_adapters(trainer.model)
        trainer.model.train()
        values[dropout, "train"] = float(trainer.loss(batch)[1])
        trainer.model.eval()
        with torch.no_grad():
            values[dropout, "eval"] = float(trainer.loss(batch)[1])
    assert values[0.5, "eval"] == values[0.0, "eval"] == values[0.0, "train"]
    assert abs(values[0.5, "train"] - values[0.0, "train"]) > 1e-6
