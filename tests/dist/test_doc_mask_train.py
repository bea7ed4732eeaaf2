"""``--doc-mask on``: a sharded training step's loss and gradients equal one process running each packed
document separately (fp64), with positions restarting per document, under zigzag and under
``--chunk-order balanced``; MFU's attention work counts only the visible pairs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loongtrain.launch.config import TrainConfig
from loongtrain.parallel.config import ParallelConfig
from loongtrain.parallel.documents import balanced_chunk_order, cu_seqlens_from_starts, rank_work, visible_pairs
from loongtrain.parallel.mesh import init_mesh
from loongtrain.parallel.zigzag import shard_indices
from tests.helpers.dist_utils import run_distributed
from tests.helpers.doc_batches import MODEL, ROWS, SEQ, packed_batch
from tests.helpers.exact_steps import param_name

pytestmark = pytest.mark.distributed





LAYOUTS = [(2, 2, "zigzag"), (1, 4, "zigzag"), (4, 1, "zigzag"), (1, 4, "balanced"), (2, 2, "balanced")]


def _sharded_step(rank: int, world: int, layouts: list[tuple[int, int, str]]) -> dict:
    from loongtrain.launch.config import run_of
    from loongtrain.train.trainer import Trainer

    out = {}
    for hp, cp, chunk_order in layouts:
        mesh = init_mesh(hp, cp)
        cfg = TrainConfig.from_dict(dict(seq_len=SEQ, batch_size=ROWS, steps=1, warmup=0, clip=0.0, dtype="fp64",
                          parallel=ParallelConfig(hp=hp, cp=cp), doc_mask="on", chunk_order=chunk_order))
        trainer = Trainer(run_of(cfg, MODEL), mesh, torch.device("cpu"))
        order = trainer.ctx.sharding.chunk_order(trainer.ctx.sharding.documents(packed_batch())[0], SEQ)
        assert (order is not None) == (chunk_order == "balanced"), (chunk_order, order)
        result = trainer.step([packed_batch()])
        grads = {param_name(n): p.grad.clone() for n, p in trainer.model.named_parameters()}
        out[(hp, cp, chunk_order)] = (result["loss"], result["attention_pairs"], grads if rank == 0 else None)
    return out


def test_the_balanced_layout_of_the_test_batch_is_not_zigzag():
    """So the balanced cases below exercise another layout (and its work is more even)."""
    cu = [c.tolist() for c in cu_seqlens_from_starts(packed_batch()["doc_starts"])]
    for hp, cp in ((1, 4), (2, 2)):
        order = balanced_chunk_order(cu, SEQ, cp, hp)
        moved = [shard_indices(SEQ, hp, cp, r, 0, order).tolist() != shard_indices(SEQ, hp, cp, r, 0).tolist()
                 for r in range(cp)]
        assert any(moved), (hp, cp, order)
        work = [rank_work(cu, SEQ, cp, chunk_order=layout) for layout in (None, order)]
        assert max(work[1]) < max(work[0]), (hp, cp, work)


def _per_document_reference() -> tuple[float, dict[str, torch.Tensor]]:
    from loongtrain.model.llama import Transformer

    model = Transformer(MODEL, seed=0).double()
    batch = packed_batch()
    loss = torch.zeros((), dtype=torch.float64)
    for b, cu in enumerate(cu_seqlens_from_starts(batch["doc_starts"])):
        bounds = cu.tolist()
        for s, e in zip(bounds, bounds[1:]):
            logits = model(batch["input_ids"][b : b + 1, s:e])  # the document alone, positions from 0
            loss = loss + F.cross_entropy(logits[0], batch["labels"][b, s:e], reduction="sum")
    loss = loss / (ROWS * SEQ)
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in model.named_parameters()}


def test_doc_mask_step_equals_each_document_alone():
    ref_loss, ref_grads = _per_document_reference()
    per_rank = run_distributed(_sharded_step, 4, LAYOUTS)
    pairs = sum(visible_pairs(cu, SEQ) for cu in cu_seqlens_from_starts(packed_batch()["doc_starts"]))
    assert pairs < ROWS * SEQ * (SEQ + 1) // 2  # fewer than causal over the packed rows
    for rank_out in per_rank:
        for layout, (loss, counted, _) in rank_out.items():
            assert abs(loss - ref_loss) < 1e-10, (layout, loss, ref_loss)
            assert counted == pairs, (layout, counted, pairs)
    for layout, (_, _, grads) in per_rank[0].items():
        assert grads.keys() == ref_grads.keys()
        for name, grad in grads.items():
            err = (grad - ref_grads[name]).abs().max().item()
            assert err < 1e-10, (layout, name, err)


# ---- the same through a Hugging Face model (transformers' attention interface) -----------------------


def _hf_dir(path: str) -> str:
    """A tiny Qwen2 (qkv bias, GQA; the byte vocabulary) saved with its weights, so every rank loads the same."""
    import transformers

    config = transformers.Qwen2Config(vocab_size=256, hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      tie_word_embeddings=False)
    torch.manual_seed(11)
    transformers.Qwen2ForCausalLM(config).save_pretrained(path)
    return path


def _hf_sharded_step(rank: int, world: int, directory: str, layouts: list[tuple[int, int, str]]) -> dict:
    from loongtrain.launch.config import run_of
    from loongtrain.train.model_setup import model_config_for
    from loongtrain.train.trainer import Trainer

    out = {}
    for hp, cp, chunk_order in layouts:
        mesh = init_mesh(hp, cp)
        cfg = TrainConfig.from_dict(dict(model=directory, tokenizer="byte", seq_len=SEQ, batch_size=ROWS, steps=1, warmup=0,
                          clip=0.0, dtype="fp64", parallel=ParallelConfig(hp=hp, cp=cp), doc_mask="on",
                          chunk_order=chunk_order))
        trainer = Trainer(run_of(cfg, model_config_for(cfg.model)), mesh, torch.device("cpu"))
        result = trainer.step([packed_batch()])
        grads = {param_name(n): p.grad.clone() for n, p in trainer.model.named_parameters()}
        out[(hp, cp, chunk_order)] = (result["loss"], grads if rank == 0 else None)
    return out


def test_doc_mask_step_equals_each_document_alone_hf(tmp_path):
    pytest.importorskip("transformers", reason="the hf extra is not installed (pip install -e '.[hf]')")
    from loongtrain.hf import load_hf_model

    directory = _hf_dir(str(tmp_path / "qwen2"))
    model = load_hf_model(directory, dtype=torch.float64)  # stock attention, one document at a time
    batch = packed_batch()
    loss = torch.zeros((), dtype=torch.float64)
    for b, cu in enumerate(cu_seqlens_from_starts(batch["doc_starts"])):
        bounds = cu.tolist()
        for s, e in zip(bounds, bounds[1:]):
            logits = model(input_ids=batch["input_ids"][b : b + 1, s:e], use_cache=False).logits
            loss = loss + F.cross_entropy(logits[0], batch["labels"][b, s:e], reduction="sum")
    (loss / (ROWS * SEQ)).backward()
    ref_loss = float(loss.detach()) / (ROWS * SEQ)
    ref_grads = {n: p.grad for n, p in model.named_parameters()}
    per_rank = run_distributed(_hf_sharded_step, 4, directory, [(2, 2, "zigzag"), (1, 4, "zigzag"),
                                                                 (1, 4, "balanced")])
    for rank_out in per_rank:
        for layout, (got, _) in rank_out.items():
            assert abs(got - ref_loss) < 1e-10, (layout, got, ref_loss)
    for layout, (_, grads) in per_rank[0].items():
        assert grads.keys() == ref_grads.keys(), layout
        for name, grad in grads.items():
            err = (grad - ref_grads[name]).abs().max().item()
            assert err < 1e-10, (layout, name, err)
