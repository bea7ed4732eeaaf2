"""The planner with packed documents (docs/planner.md): ring steps charged by the visible pairs of the
executor's own kernel pieces, the step at its busiest member; zigzag vs the balanced layout; predictions
without documents unchanged. Pure arithmetic, no processes."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

from loongtrain.attn.masking import AttnMask, dense_mask
from loongtrain.attn.schedule import Compute, pass_events
from loongtrain.commands.plan import main
from loongtrain.model.config import ModelConfig, flops_per_token
from loongtrain.parallel.config import ParallelConfig
from loongtrain.parallel.documents import Documents, balanced_chunk_order, rank_work, visible_pairs
from loongtrain.parallel.layout import DoubleRing, Layout
from loongtrain.parallel.zigzag import shard_indices
from loongtrain.plan.attention_cost import AttnShape, _Link, attention_flops, attention_time, simulate_pass
from loongtrain.plan.cost import Workload, step_cost
from loongtrain.plan.document_work import balance_report, lognormal_documents, pair_work, step_work
from loongtrain.plan.search import plan
from tests.helpers.plan_cases import toy_cluster  # one toy cluster for the planner tests

FAST = toy_cluster(intra_node_gbyte_s=1e6, nic_gbit_s=1e6)  # links vanish: compute-bound


def random_docs(seq: int, rng: random.Random, max_len: int) -> tuple[int, ...]:
    bounds = [0]
    while bounds[-1] < seq:
        bounds.append(min(seq, bounds[-1] + rng.randint(1, max_len)))
    return tuple(bounds)


def dense_pairs(docs: tuple[int, ...] | None, seq: int, cp: int, p: int, s: int, order, window) -> int:
    """Visible pairs of rank ``p``'s tokens (queries) x rank ``s``'s (keys) straight from the dense mask."""
    mask = AttnMask(True, window, None if docs is None else (docs,))
    dense = dense_mask(seq, mask)
    q, k = shard_indices(seq, 1, cp, p, 0, order), shard_indices(seq, 1, cp, s, 0, order)
    return int(dense[q][:, k].sum())


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_pair_work_is_the_dense_mask_between_rank_blocks(cp):
    seq = 2 * cp * 12
    rng = random.Random(cp)
    for docs in (None, random_docs(seq, rng, seq // 3), random_docs(seq, rng, 4)):
        rows = None if docs is None else [docs]
        for window in (None, 1, 5, 17):
            for order in (None, balanced_chunk_order(rows, seq, cp, chunks_per_rank=3, sliding_window=window)):
                work = pair_work(rows, seq, cp, chunk_order=order, sliding_window=window)
                want = [[dense_pairs(docs, seq, cp, p, s, order, window) for s in range(cp)] for p in range(cp)]
                assert [list(r) for r in work] == want, (docs, window, order)
                assert [sum(r) for r in work] == rank_work(rows, seq, cp, chunk_order=order, sliding_window=window)
                assert sum(map(sum, work)) == visible_pairs(docs, seq, sliding_window=window)


def test_document_prediction_hand_computed():
    # S=16, cp=2, zigzag chunks of 4: rank 0 holds tokens 0-3 and 12-15, rank 1 tokens 4-11.
    # Documents [0, 12) and [12, 16). Step 0 (own block): rank 0: 10 + 10 causal pairs, rank 1: 36 (one
    # causal square of 8) -> 36. Step 1: rank 0's queries see none of 4-11, rank 1's 4-11 see all of 0-3
    # (32) -> 32. At 4*H*D = 64 FLOPs a pair and 2048 FLOP/s: 36/32 s and 1 s.
    shape = AttnShape(batch=1, seq_len=16, num_heads=4, num_kv_heads=4, head_dim=4)
    docs = Documents(((0, 12, 16),))
    assert step_work([(0, 12, 16)], 16, 2, 1) == {(0, 0): 36, (1, 0): 32}
    t = attention_time(Layout(2, 1, 2), shape, FAST, docs)
    assert t.compute_fwd == 68 * 64 / 2048 and t.compute_bwd == 2.5 * 68 * 64 / 2048
    # the K/V hop (2*4*8*4*2 = 512 B at 256 B/s: 2 s) overlaps the 1.125-s first step: 0.875 s exposed
    slow = attention_time(Layout(2, 1, 2), shape, toy_cluster(intra_node_gbyte_s=256e-9), docs)
    assert slow.ring_outer_fwd == pytest.approx(2 - 36 * 64 / 2048)
    # the same from the dense mask and the schedule's own sources, for a double ring with hp = 2
    seq, cp, hp, rows = 48, 4, 2, ((0, 5, 30, 48),)
    layout, shape = Layout(8, hp, cp, inner_ring=2), AttnShape(1, seq, 4, 2, 4)
    ring = DoubleRing(layout.num_inner_rings, layout.inner_ring)
    expected = 0.0
    for e in pass_events(2, 2, False):
        if isinstance(e, Compute):
            pairs = max(dense_pairs(rows[0], seq, cp, p, ring.source(p, e.outer, e.inner), None, None)
                        for p in range(cp))
            expected += pairs * 4 * 4 * 4 / hp / 2048
    assert attention_time(layout, shape, FAST, Documents(rows)).compute_fwd == pytest.approx(expected, rel=1e-12)


def test_uniform_documents_lower_compute_bound_time_by_the_visible_fraction():
    seq, cp = 4096, 4
    shape = AttnShape(1, seq, 8, 8, 16)
    layout = Layout(4, 1, cp)
    plain = attention_time(layout, shape, FAST)
    # documents of a quarter chunk: every rank's blocks alike, so every ring step is even
    docs = tuple(range(0, seq + 1, seq // (8 * cp)))
    fraction = visible_pairs(docs, seq) / (seq * (seq + 1) / 2)
    masked = attention_time(layout, shape, FAST, Documents((docs,)))
    assert masked.total / plain.total == pytest.approx(fraction, rel=1e-3)
    # a lognormal mix: the visible fraction times the steps' excess of their busiest rank over the mean
    mix = tuple(lognormal_documents(seq, 64, seed=1))
    fraction = visible_pairs(mix, seq) / (seq * (seq + 1) / 2)
    ratio = attention_time(layout, shape, FAST, Documents((mix,))).total / plain.total
    busiest = sum(step_work([mix], seq, 1, cp).values())
    assert ratio == pytest.approx(fraction * busiest / (visible_pairs(mix, seq) / cp), rel=1e-3)
    assert fraction * (1 - 1e-3) <= ratio < 0.5


def test_balanced_layout_predicted_faster_where_zigzag_is_imbalanced():
    seq, cp = 8192, 4
    skewed = tuple(range(0, seq // 2, 16)) + (seq,)  # short documents, then one as long as half the row
    report = balance_report([skewed], seq, cp)
    assert report["zigzag_imbalance"] > 1.5 > 1.1 > report["balanced_imbalance"]
    shape = AttnShape(1, seq, 4, 4, 4)
    for layout in (Layout(4, 1, cp), Layout(8, 2, cp, inner_ring=2)):
        zigzag = attention_time(layout, shape, FAST, Documents((skewed,)))
        balanced = attention_time(layout, shape, FAST, Documents((skewed,), "balanced"))
        assert balanced.total < 0.8 * zigzag.total
    # evenly short documents: both layouts are balanced, neither is predicted much faster
    even = tuple(range(0, seq + 1, 32))
    a, b = (attention_time(Layout(4, 1, cp), shape, FAST, Documents((even,), name)).total
            for name in ("zigzag", "balanced"))
    assert a == pytest.approx(b, rel=0.05)


def test_no_document_predictions_unchanged():
    # the formula: cp even steps of c = F / cp, backward 2.5 c; the ring replays c per compute event
    shape = AttnShape(2, 256, 8, 4, 16)
    for layout in (Layout(8, 1, 8, inner_ring=4, placement="context_first"), Layout(8, 2, 4), Layout(4, 4, 1)):
        t = attention_time(layout, shape, toy_cluster())
        c = attention_flops(shape, layout.sp) / layout.cp / 2048
        assert t.compute_fwd == layout.cp * c and t.compute_bwd == layout.cp * c * 2.5
    # a compute-time table of equal entries simulates exactly as the single number
    for steps in ((2, 4), (4, 1), (1, 8)):
        table = {(o, i): 0.75 for o in range(steps[0]) for i in range(steps[1])}
        for dkv in (None, 96):
            runs = []
            for c in (0.75, table):
                inner, outer = _Link(100.0, 0.01, 1.0), _Link(40.0, 0.02, 2.0)
                runs.append((simulate_pass(steps, c, inner, outer, 64, dkv), inner.blocked, outer.blocked))
            assert runs[0] == runs[1]
    # one document per row through the document path: the causal formula up to the diagonal (1/S)
    layout = Layout(8, 1, 8, inner_ring=2)
    one = attention_time(layout, shape, toy_cluster(), Documents(((0, 256),)))
    assert one.total == pytest.approx(attention_time(layout, shape, toy_cluster()).total, rel=1e-2)
    # the planner's step and MFU without documents: model FLOPs per token as before
    model = ModelConfig(vocab_size=256, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=128)
    c = step_cost(model, ParallelConfig(cp=4), toy_cluster(), nodes=1, seq_len=256)
    assert c.mfu == pytest.approx(256 * flops_per_token(model, 256) / (c.step_time * 4 * 4096), rel=1e-12)
    assert [x.step_time for x in plan(model, toy_cluster(), nodes=1, seq_len=256)] == [
        x.step_time for x in plan(model, toy_cluster(), nodes=1, seq_len=256, workload=Workload(documents=None))]


def test_documents_in_step_cost_and_errors():
    model = ModelConfig(vocab_size=256, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=128)
    docs = Documents((tuple(lognormal_documents(1024, 64, seed=0)),))
    kw = dict(nodes=1, seq_len=1024)
    dense = step_cost(model, ParallelConfig(cp=4), FAST, **kw)
    packed = step_cost(model, ParallelConfig(cp=4), FAST, workload=Workload(documents=docs), **kw)
    assert packed.step_time < dense.step_time and 0 < packed.mfu < 1
    assert packed.memory == dense.memory
    with pytest.raises(ValueError, match="chunk_order"):
        Documents(((0, 8),), "striped")
    with pytest.raises(ValueError, match="batch=3"):
        attention_time(Layout(4, 1, 4), AttnShape(3, 64, 4, 4, 4), FAST, Documents(((0, 64),) * 2))
    with pytest.raises(ValueError, match="strictly increase"):
        attention_time(Layout(4, 1, 4), AttnShape(1, 64, 4, 4, 4), FAST, Documents(((0, 9, 9, 64),)))
    window = replace(AttnShape(1, 1024, 4, 4, 4), sliding_window=100)  # windows through the same pieces
    w = attention_time(Layout(4, 1, 4), window, FAST, docs)
    unwindowed = attention_time(Layout(4, 1, 4), replace(window, sliding_window=None), FAST, docs)
    assert w.compute_fwd <= unwindowed.compute_fwd


def test_cli_doc_median_predicts_with_documents(capsys):
    base = ["--model", "7b-gqa", "--seq-len", "128K", "--nodes", "2", "--cluster", "h100", "--top", "3"]
    assert main(base + ["--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(base + ["--json", "--doc-median", "1024"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert 0 < out["documents"]["visible_fraction"] < 0.2 and out["documents"]["median"] == 1024
    for row in out["candidates"]:
        d = row["documents"]
        assert d["attention_s"]["zigzag"] < d["attention_s"]["no_mask"]
        assert d["faster_layout"] in ("zigzag", "balanced", "same")
        assert d["work_max_over_mean"]["balanced"] <= d["work_max_over_mean"]["zigzag"]
    assert out["candidates"][0]["step_time_s"] < plain["candidates"][0]["step_time_s"]
    assert set(plain["candidates"][0]) < set(out["candidates"][0])  # fields added, none lost
    assert main(base + ["--doc-median", "1024"]) == 0
    text = capsys.readouterr().out
    assert "packed documents (median 1024, zigzag)" in text and "no mask ms" in text and "balanced ms" in text
