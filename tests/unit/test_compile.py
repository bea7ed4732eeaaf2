"""``--compile``: compiled decoder blocks (docs/compile.md), single process.

Compiled training equals eager training (fp64, 1e-10, documents and a sliding window, Selective
Checkpoint++) over 20 steps whose document mix changes every step; 12-block native and Hugging Face models
(Selective++ and full checkpointing; documents, then none, then documents again) run at most two graphs
shared by all blocks (counted by the test's own backend, never dynamo's global counters), without graph breaks
(an error inside ``no_graph_breaks``), with eager's gradients; the attention ops'
fake implementations agree with the real ones for every input form (``torch.library.opcheck``); the memory
report counts what compiled blocks save; a missing toolchain and compile failures (in forward and in a
compiled backward) are named. Compiles with ``aot_eager`` (the same graphs as inductor, no code
generation: fast on CPU); tests/dist/test_compile_dist.py runs inductor on 4 ranks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch._dynamo

from loongtrain.attn import ops
from loongtrain.launch.config import TrainConfig
from loongtrain.model.config import ModelConfig
from loongtrain.model.llama import Transformer, rope_cos_sin
from loongtrain.parallel.config import ParallelConfig
from loongtrain.parallel.mesh import single_process_mesh
from loongtrain.parallelize import compile as compile_step
from loongtrain.parallelize import compile_errors
from loongtrain.parallelize.compose import parallelize
from tests.helpers.compiled_graphs import GraphCounter, no_graph_breaks
from tests.helpers.doc_batches import doc_batch

TOL = 1e-10
SEQ = 32
MODEL = ModelConfig(vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=64,
                    sliding_window=12)


@pytest.fixture(autouse=True)
def aot_eager(monkeypatch):
    """The blocks compile through this test's own counter (of aot_eager): its graphs, nobody else's."""
    counter = GraphCounter("aot_eager")
    monkeypatch.setattr(compile_step, "BACKEND", counter)
    torch._dynamo.reset()
    yield counter
    torch._dynamo.reset()




def trainer(compile: str, recompute: str = "selective"):
    from loongtrain.launch.config import run_of
    from loongtrain.train.trainer import Trainer

    cfg = TrainConfig.from_dict(dict(seq_len=SEQ, steps=20, warmup=1, dtype="fp64",
                                     parallel=ParallelConfig(recompute=recompute),
                      doc_mask="on", compile=compile))
    return Trainer(run_of(cfg, MODEL), single_process_mesh(), torch.device("cpu"))


def test_compiled_training_equals_eager_with_changing_documents_in_at_most_two_graphs(aot_eager):
    eager, compiled = trainer("off"), trainer("on")
    for step in range(20):
        batch = [doc_batch(step)]
        with no_graph_breaks():
            a, b = eager.step(batch), compiled.step(batch)
        assert abs(a["loss"] - b["loss"]) < TOL and abs(a["grad_norm"] - b["grad_norm"]) < TOL, (step, a, b)
    for (name, p), q in zip(eager.model.named_parameters(), compiled.model.parameters()):
        assert (p - q).abs().max().item() < TOL, name
    graphs = aot_eager.count
    assert 1 <= graphs <= 2, graphs  # all blocks share them
    # the memory report counts what the compiled blocks save: under Selective++ eager's activations (the
    # weights a compiled block saves are parameters, not activations), up to one more copy of the
    # documents' int64 boundaries per layer
    eager_bytes, compiled_bytes = (t.memory_report(doc_batch(0))["activations"] for t in (eager, compiled))
    assert eager_bytes > 0 and abs(compiled_bytes - eager_bytes) <= 8 * SEQ * MODEL.num_layers, (eager_bytes,
                                                                                                 compiled_bytes)
    assert aot_eager.count == graphs  # no new compilation for the report either


def _block_inputs():
    x = torch.randn(1, SEQ, MODEL.dim, dtype=torch.float64)
    cos, sin = rope_cos_sin(torch.arange(SEQ)[None], MODEL.head_dim, MODEL.rope_theta, x.dtype)
    return x, cos, sin


def test_native_block_compiles_to_one_graph_with_documents_window_and_selective_checkpointing():
    model = parallelize(Transformer(MODEL).double(), single_process_mesh(), ParallelConfig(recompute="selective"),
                        torch.device("cpu"))
    block = model.layers[0]
    x, cos, sin = _block_inputs()
    args, kwargs = compile_step.block_inputs(compile_step.inspect.signature(block._loongtrain_forward),
                                             (x.requires_grad_(), cos, sin, [torch.tensor([0, 5, SEQ])]), {})
    explained = torch._dynamo.explain(block.forward)(*args, **kwargs)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
    targets = {str(n.target) for g in explained.graphs for n in g.graph.nodes}
    assert "higher_order.tag_activation_checkpoint" in "".join(targets) or any("checkpoint" in t for t in targets)


def _deep_model(family: str) -> torch.nn.Module:
    """A 12-block fp64 model: loongtrain's (window 12), or a Hugging Face Mistral (window 12)."""
    if family == "native":
        return Transformer(dataclasses.replace(MODEL, num_layers=12)).double()
    from tests.helpers.hf_models import tiny_hf

    return tiny_hf(family, num_hidden_layers=12, sliding_window=12)


@pytest.mark.parametrize(("family", "recompute"), [("native", "selective"), ("MistralForCausalLM", "full")])
def test_twelve_blocks_share_at_most_two_graphs_and_train_like_eager(family, recompute, aot_eager):
    """All blocks run one compiled graph (two: one more once a batch without documents follows documents),
    never near dynamo's recompile limit (8), without graph breaks; gradients equal eager's (fp64), under
    Selective++ (native) and full checkpointing (Hugging Face)."""
    from loongtrain.train.model_setup import loss_inputs

    parallel, cpu = ParallelConfig(recompute=recompute), torch.device("cpu")
    eager = parallelize(_deep_model(family), single_process_mesh(), parallel, cpu)
    compiled = parallelize(_deep_model(family), single_process_mesh(), parallel, cpu, compile=True)
    vocab = 64 if family == "native" else compiled.config.vocab_size
    for step, cu in enumerate(([0, 5, SEQ], None, [0, 3, 17, 29, SEQ])):  # a new mix after none: no new graph
        ids = torch.randint(0, vocab, (1, SEQ), generator=torch.Generator().manual_seed(step))
        positions, docs = torch.arange(SEQ)[None], None if cu is None else [torch.tensor(cu)]
        grads = []
        for model in (eager, compiled):
            model.zero_grad(set_to_none=True)
            with no_graph_breaks():
                hidden, head, _ = loss_inputs(model, ids, positions, docs)
                (hidden @ head.t()).square().mean().backward()
            grads.append({n: p.grad for n, p in model.named_parameters()})
        for name, g in grads[0].items():  # (the final norm's weight has none: the loss would apply it)
            other = grads[1][name]
            assert (g is None) == (other is None) and (g is None or (g - other).abs().max().item() < TOL), name
    assert 1 <= aot_eager.count <= 2, aot_eager.count


@pytest.mark.parametrize("masks", [
    {},
    {"cu_seqlens": [0, 3, 20, SEQ, 0, SEQ]},
    {"cu_seqlens": [0, 9, SEQ, 0, 1, SEQ], "sliding_window": 5},
    {"chunk_order": [1, 0], "sliding_window": 7},
    {"cu_seqlens": [0, 2, SEQ, 0, 30, SEQ], "chunk_order": [1, 0]},
])
def test_attention_ops_fakes_match_real_for_every_input_form(masks):
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, SEQ, 4, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    k = torch.randn(2, SEQ, 2, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    v = torch.randn(2, SEQ, 2, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    cu = ops.as_index_tensor(masks.get("cu_seqlens"))
    order = ops.as_index_tensor(masks.get("chunk_order"))
    key = ops.ring_key(single_process_mesh())
    args = (q, k, v, key, True, 0.3, cu, masks.get("sliding_window"), order)
    torch.library.opcheck(ops.ring_attention, args, test_utils=("test_schema", "test_faketensor",
                                                                "test_autograd_registration"))
    out, lse = ops.ring_attention(*args)
    dout = torch.randn_like(out)
    bwd = (dout, q.detach(), k.detach(), v.detach(), out.detach(), lse, key, True, 0.3, cu,
           masks.get("sliding_window"), order)
    torch.library.opcheck(ops.ring_attention_backward, bwd, test_utils=("test_schema", "test_faketensor"))


def test_compile_modes():
    cpu = torch.device("cpu")
    assert compile_step.compile_enabled("on", cpu) and not compile_step.compile_enabled("off", cpu)
    with pytest.raises(ValueError, match="'fast'.*off"):
        compile_step.compile_enabled("fast", cpu)
    with pytest.raises(ValueError, match="--compile='fast'"):
        TrainConfig.from_dict(dict(compile="fast")).validate()
    compile_step.check_compile_options(ParallelConfig())
    with pytest.raises(ValueError, match="--offload-activations.*--compile off"):
        compile_step.check_compile_options(ParallelConfig(recompute="selective", offload_activations=True))
    with pytest.raises(ValueError, match="--mlp-tiles 4"):
        compile_step.check_compile_run("on", ParallelConfig(mlp_tiles="4"), "cpu")


def test_compile_cache_key_tag_carries_the_ops_digest_beside_the_users():
    with torch.compiler.config.patch(cache_key_tag="mine"):
        compile_step.compile_blocks(Transformer(MODEL), [], backend="eager")
        compile_step.compile_blocks(Transformer(MODEL), [], backend="eager")  # once only
        digest = compile_step.ops_digest()
        assert torch.compiler.config.cache_key_tag == f"mine+loongtrain-ops-{digest}" and len(digest) == 16


def test_missing_compiler_is_named(monkeypatch, tmp_path):
    import shutil
    import sysconfig

    monkeypatch.setattr(compile_step, "BACKEND", "inductor")
    assert compile_errors.missing_compiler("cpu", "inductor") is None  # this machine builds inductor's kernels
    which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(ValueError, match="C\\+\\+ compiler.*--compile off"):
        compile_step.check_compile_backend("on", "cpu")
    compile_step.check_compile_backend("off", "cpu")  # nothing to compile: nothing missing
    monkeypatch.setattr(shutil, "which", which)
    # a compiler without OpenMP's header (its own error line is quoted)
    fake = tmp_path / "g++"
    fake.write_text("#!/bin/sh\necho '<stdin>:2:10: fatal error: omp.h: No such file or directory' >&2\nexit 1\n")
    fake.chmod(0o755)
    from torch._inductor import config as inductor_config

    with inductor_config.patch({"cpp.cxx": (str(fake),)}), pytest.raises(
            ValueError, match=r"cannot build inductor's kernels: it lacks OpenMP.*omp\.h: No such file"):
        compile_step.check_compile_backend("on", "cpu")
    # no Python.h where inductor looks for it
    real = sysconfig.get_path
    monkeypatch.setattr(sysconfig, "get_path", lambda name, *a, **k: str(tmp_path) if name == "include"
                        else real(name, *a, **k))
    with pytest.raises(ValueError, match=f"Python.h is not in {tmp_path}.*-dev"):
        compile_step.check_compile_backend("on", "cpu")
    monkeypatch.setattr(torch._dynamo, "is_dynamo_supported", lambda: False)
    with pytest.raises(ValueError, match="torch._dynamo does not support Python"):
        compile_step.check_compile_backend("on", "cpu")


def test_on_cuda_the_cpu_compiler_with_openmp_is_checked_too(monkeypatch, tmp_path):
    """A compiled block holds CPU ops too (the documents' cu_seqlens): with Triton and a C compiler present, a
    g++ without OpenMP still stops --compile on for CUDA, in one line."""
    import importlib.util

    from torch._inductor import config as inductor_config

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "triton" else
                        find_spec(name, *a))
    assert compile_errors.missing_compiler("cuda", "inductor") is None
    fake = tmp_path / "g++"
    fake.write_text("#!/bin/sh\necho '<stdin>:2:10: fatal error: omp.h: No such file or directory' >&2\nexit 1\n")
    fake.chmod(0o755)
    with inductor_config.patch({"cpp.cxx": (str(fake),)}):
        missing = compile_errors.missing_compiler("cuda", "inductor")
    assert "lacks OpenMP" in missing and missing.endswith("which a compiled block's CPU ops need on CUDA too")


def test_compile_failure_names_block_and_op():
    from loongtrain.parallel.failures import restartable

    def failing_backend(gm, example_inputs):
        op = next(n.target for n in gm.graph.nodes if n.op == "call_function" and "mm" in str(n.target)
                  or n.op == "call_function")
        raise NotImplementedError(f"no lowering for aten.{getattr(op, '__name__', op)}")

    model = parallelize(Transformer(MODEL).double(), single_process_mesh(), ParallelConfig(),
                        torch.device("cpu"))
    compile_step.compile_block(model.layers[1], "layers.1", backend=failing_backend)
    with pytest.raises(compile_errors.CompileError, match=r"decoder block layers\.1 at op aten\.\w+.*--compile off"
                       ) as failure:
        model(torch.randint(0, MODEL.vocab_size, (1, SEQ)))
    assert "\n" not in str(failure.value) and restartable(failure.value)[0] is False  # one line; no retry


def _wrong_stride_backend():
    """A backend whose compiled backward fails as inductor's generated code does on an op output whose
    strides differ from its fake's: ``assert_size_stride`` in a module of inductor's code cache."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._inductor.codecache import PyCodeCache

    source = ("from torch._C._dynamo.guards import assert_size_stride\n"
              "def call(args):\n"
              "    t = args[-1]\n"
              "    assert_size_stride(t, tuple(t.shape), tuple(2 * s + 1 for s in t.stride()),\n"
              "                       'torch.ops.loongtrain.head_all_to_all.default')\n")

    def backward(gm, example_inputs):
        generated = PyCodeCache.load(source)
        return make_boxed_func(lambda *args: generated.call(args) or gm(*args))

    return aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm.forward), bw_compiler=backward)


def test_compiled_backward_failure_names_the_block_in_flight_and_the_op():
    model = parallelize(Transformer(dataclasses.replace(MODEL, num_layers=3)).double(), single_process_mesh(),
                        ParallelConfig(recompute="selective"), torch.device("cpu"))
    for i, block in enumerate(model.layers):  # eager blocks 0 and 2 around the failing one
        if i == 1:
            compile_step.compile_block(block, "layers.1", backend=_wrong_stride_backend())
    loss = model(torch.randint(0, MODEL.vocab_size, (1, SEQ))).square().mean()
    with pytest.raises(compile_errors.CompileError) as failure, compile_errors.named_compile_failures():
        loss.backward()
    message = str(failure.value)
    assert message.startswith("torch.compile failed on decoder block layers.1 at op "
                              "loongtrain.head_all_to_all.default: AssertionError: expected size"), message
    assert message.endswith("; run with --compile off") and "\n" not in message, message
    # an error of an op the compiled code calls (not of the compiler) passes unchanged
    with pytest.raises(RuntimeError, match="^peer closed$"), compile_errors.named_compile_failures():
        raise RuntimeError("peer closed")


def test_compile_on_end_to_end_trains_like_eager_and_a_compile_failure_stops_it_in_one_line(
        tmp_path, monkeypatch, capsys, aot_eager):
    from loongtrain.commands import main
    from loongtrain.train.metrics import read_jsonl

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(200)))
    losses = {}

    def train(mode: str) -> int:
        argv = ["train", "--model", "tiny", "--nproc", "1", "--hp", "1", "--cp", "1", "--steps", "3",
                "--warmup", "1", "--seq-len", "64", "--corpus", str(corpus), "--out-dir", str(tmp_path / mode),
                "--progress", "off", "--peak-tflops", "1", "--no-tensorboard", "--no-plot", "--threads", "1",
                "--no-memory-report", "--compile", "off" if mode == "off" else "on"]
        return main(argv)

    for mode in ("off", "on"):
        assert train(mode) == 0
        losses[mode] = [r["loss"] for r in read_jsonl(tmp_path / mode / "metrics.jsonl")]
    assert len(losses["on"]) == 3 and losses["on"] == pytest.approx(losses["off"], rel=1e-6, abs=1e-6), losses
    assert aot_eager.count >= 1  # it did compile (--nproc 1: the worker is this process)
    capsys.readouterr()
    monkeypatch.setattr(compile_step, "BACKEND", _wrong_stride_backend())  # fails in the first backward
    assert train("failing") == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("loongtrain train:")]
    assert len(err) == 1 and err[0].startswith("loongtrain train: failed: torch.compile failed on decoder "
                                               "block layers.1 at op loongtrain.head_all_to_all"), err
    assert err[0].endswith("run with --compile off"), err


def test_compile_on_without_a_compiler_exits_2_before_any_worker(monkeypatch, tmp_path, capsys):
    import shutil

    from loongtrain.commands import main

    monkeypatch.setattr(compile_step, "BACKEND", "inductor")
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert main(["train", "--compile", "on", "--nproc", "4", "--out-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--compile on" in err and "C++ compiler" in err, err
