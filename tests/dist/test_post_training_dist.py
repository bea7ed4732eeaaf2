"""``--objective sft`` and ``--objective dpo`` (docs/post-training.md): a sharded training step's loss, metrics
and gradients equal an unsharded reference built from Hugging Face's own pieces (float64, 1e-10) at world 4:
hp2 x cp2, hp1 x cp4, and dp2 x cp2 with two micro-steps a replica (the shared layouts of
tests/helpers/exact_steps.py). The step is the run's: the corpus file through the objective's reader and
sampler, DPO's reference log-probabilities by the objective's ``prepare`` with ``--ref-model`` a model unlike the
policy. The reference (tests/helpers/post_training_reference.py): SFT, transformers' model on each conversation
alone with ``apply_chat_template``'s assistant mask; DPO, TRL's tokenization and loss
``-logsigmoid(beta * ((pc - rc) - (pr - rr)))`` with the policy's and the reference's summed completion
log-probabilities, each sequence alone. RMSNorm and RoPE angles in float64 on both sides
(``fp64_hf_numerics``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from loongtrain.launch.config import TrainConfig, run_of
from loongtrain.parallel.config import ParallelConfig
from loongtrain.parallel.mesh import init_mesh
from loongtrain.train.model_setup import build_run_tokenizer, model_config_for
from tests.helpers import chat_data
from tests.helpers.dist_utils import run_distributed
from tests.helpers.exact_steps import WORLD4_LAYOUTS, assert_steps_equal, step_with_grads
from tests.helpers.post_training_reference import (
    dpo_reference,
    fp64_hf_numerics,
    hf_model,
    hf_tokenizer,
    restore_hf_numerics,
    sft_sums,
)

pytestmark = pytest.mark.distributed

SEQ, ROWS, BETA = 256, 4, 0.5
#: 7 conversations of one or two turns, and 16 text pairs: 4 rows of 256 tokens each (asserted below)
CONVERSATIONS = [chat_data.conversation(i, 1 + i % 2) for i in range(7)]
PAIRS = [chat_data.pair(i) for i in range(16)]


def _cases(tmp: Path) -> dict[str, dict]:
    """Each objective's options."""
    return {"sft": dict(corpus=str(tmp / "chat.jsonl")),
            "dpo": dict(corpus=str(tmp / "pairs.jsonl"), ref_model=str(tmp / "reference"), dpo_beta=BETA)}


def _config(tmp: Path, objective: str, hp: int, cp: int, dp: int) -> TrainConfig:
    return TrainConfig.from_dict(dict(
        model=str(tmp / "policy"), objective=objective, seq_len=SEQ, batch_size=1, grad_accum=ROWS // dp, steps=1,
        warmup=0, clip=0.0, dtype="fp64", parallel=ParallelConfig(hp=hp, cp=cp), **_cases(tmp)[objective]))


def _sharded(rank: int, world: int, tmp: Path) -> dict:
    from loongtrain.train.trainer import Trainer

    fp64_hf_numerics()  # this worker's own classes
    out = {}
    for hp, cp in WORLD4_LAYOUTS:
        mesh = init_mesh(hp, cp)
        for objective in _cases(tmp):
            cfg = _config(tmp, objective, hp, cp, mesh.dp)
            tokenizer = build_run_tokenizer(cfg.model)
            trainer = Trainer(run_of(cfg, model_config_for(cfg.model, tokenizer), tokenizer=tokenizer), mesh,
                              torch.device("cpu"))
            stream = trainer.open_data(0, {})
            trainer.objective.prepare(stream, 0, 1)  # DPO: the reference's values of the step's rows
            out[(hp, cp, objective)] = step_with_grads(trainer, stream.micro_batches(), rank)
    return out


def _references(tmp: Path) -> dict:
    tokenizer = hf_tokenizer(tmp / "policy")
    policy = hf_model(tmp / "policy")
    total, count = sft_sums(policy, tokenizer, CONVERSATIONS)
    (total / count).backward()
    sft = (float(total.detach() / count), {n: p.grad for n, p in policy.named_parameters()}, {"targets": count})
    policy = hf_model(tmp / "policy")
    loss, metrics = dpo_reference(policy, hf_model(tmp / "reference"), tokenizer, PAIRS, BETA)
    loss.backward()
    dpo = (float(loss.detach()), {n: p.grad for n, p in policy.named_parameters()}, {**metrics, "pairs": len(PAIRS)})
    return {"sft": sft, "dpo": dpo}


def test_sft_and_dpo_steps_equal_the_hf_reference_world_4(tmp_path):
    chat_data.make_model_dir(tmp_path / "policy", seed=3)
    chat_data.make_model_dir(tmp_path / "reference", seed=5)
    chat_data.write_rows(tmp_path / "chat.jsonl", [{"messages": m} for m in CONVERSATIONS])
    chat_data.write_rows(tmp_path / "pairs.jsonl", PAIRS)
    for objective in _cases(tmp_path):  # the step holds every row once
        cfg = _config(tmp_path, objective, 1, 1, 1)
        reader = cfg.spec().reader(cfg, build_run_tokenizer(cfg.model))
        assert reader.dataset(cfg.data.corpus).num_samples() == ROWS, objective
    fp64_hf_numerics()
    try:
        references = _references(tmp_path)
    finally:
        restore_hf_numerics()
    assert abs(references["dpo"][2]["rewards/margins"]) > 1e-3  # the reference differs from the policy
    assert_steps_equal(run_distributed(_sharded, 4, tmp_path), references)
