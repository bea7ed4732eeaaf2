"""``--objective grpo``: a sharded actor update's loss and gradients equal the unsharded reference (fp64, 1e-10)
at world 1 and world 4 (hp2 x cp2, and dp2 x cp2), for dapo with the KL term against another reference model,
grpo with sequence-level ratios and behaviour log-probabilities that leave the clip range, and dr_grpo: a
group split across rows, micro-steps and replicas, a micro-batch (so every rank of it) without a completion
token, and rows whose completions sit on some context ranks only. The reference runs each prompt +
completion alone through loongtrain's decoder and applies TRL's definitions (tests/helpers/grpo_reference.py);
TRL's metrics too."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from loongtrain.data.rollouts import Rollout, RolloutDataset, with_advantages
from loongtrain.launch.config import TrainConfig, run_of
from loongtrain.parallel.config import ParallelConfig
from loongtrain.parallel.mesh import init_mesh
from tests.helpers.dist_utils import run_distributed
from tests.helpers.exact_steps import assert_steps_equal, step_with_grads
from tests.helpers.fixtures import tiny_model
from tests.helpers.grpo_reference import completion_logps, formula_loss

pytestmark = pytest.mark.distributed

MODEL = tiny_model()
SEQ, TEMPERATURE, REF_SEED = 32, 0.8, 5
#: (prompt length, completion length, group, reward); rows below: group 0 split over rows 0 and 1
SHAPES = [(3, 5, 0, 1.0), (2, 7, 0, 0.0), (4, 3, 1, 0.5), (3, 9, 0, 0.25), (2, 4, 1, 0.0), (5, 6, 2, 1.0),
          (3, 2, 2, 0.0)]
ROWS = [[0, 1, 2], [3, 4], [], [5, 6]]  # the third row holds no completion
#: (loss, importance sampling, beta, behaviour log-probabilities off by +-0.5)
SETTINGS = [("dapo", "token", 0.04, False), ("grpo", "sequence", 0.0, True), ("dr_grpo", "token", 0.04, True)]


def _tokens() -> list[tuple[list[int], list[int]]]:
    gen = torch.Generator().manual_seed(3)
    return [(torch.randint(1, MODEL.vocab_size, (p,), generator=gen).tolist(),
             torch.randint(1, MODEL.vocab_size, (c,), generator=gen).tolist()) for p, c, _, _ in SHAPES]


def _models():
    from loongtrain.model.llama import Transformer

    return Transformer(MODEL, seed=0).double(), Transformer(MODEL, seed=REF_SEED).double()


def _old_logps() -> list[np.ndarray]:
    """The policy's own log-probabilities moved by 0.5 against each completion's advantage sign (ratios of
    exp(0.5) for positive advantages, exp(-0.5) for negative: both clipped)."""
    policy, _ = _models()
    with torch.no_grad():
        logps = [completion_logps(policy, p, c, TEMPERATURE)[0] for p, c in _tokens()]
    signs = [np.sign(r.advantage) for r in _rollouts(None)]
    return [(lp - 0.5 * s).numpy() for lp, s in zip(logps, signs)]


def _rollouts(old: list[np.ndarray] | None) -> list[Rollout]:
    out = [Rollout(np.array(p), np.array(c), reward, f"g{group}", f"row {i}", old_logps=None if old is None else old[i])
           for i, ((p, c), (_, _, group, reward)) in enumerate(zip(_tokens(), SHAPES))]
    return with_advantages(out, "group")


def _batches(old, dp: int, dp_rank: int) -> list[dict[str, torch.Tensor]]:
    from loongtrain.data.pipeline import _collate

    dataset = RolloutDataset(_rollouts(old), SEQ, 0, "test", rows=[np.array(r, dtype=np.int64) for r in ROWS],
                             max_sequences=3)
    accum = len(ROWS) // dp
    return [_collate([dataset[m * dp + dp_rank]]) for m in range(accum)]


def _sharded(rank: int, world: int, layouts: list[tuple[int, int]], old: list[np.ndarray]) -> dict:
    from loongtrain.objectives.grpo import TokenReference
    from loongtrain.train.model_setup import build_model
    from loongtrain.train.trainer import Trainer

    out = {}
    for hp, cp in layouts:
        mesh = init_mesh(hp, cp)
        for loss_type, level, beta, with_old in SETTINGS:
            cfg = TrainConfig.from_dict(dict(
                seq_len=SEQ, batch_size=1, grad_accum=len(ROWS) // mesh.dp, steps=1, warmup=0, clip=0.0, dtype="fp64",
                parallel=ParallelConfig(hp=hp, cp=cp), objective="grpo", doc_mask="on", position_reset=True,
                grpo_loss=loss_type, importance_sampling=level, grpo_beta=beta, grpo_epsilon_high=0.28,
                temperature=TEMPERATURE, max_completion_length=10))
            trainer = Trainer(run_of(cfg, MODEL), mesh, torch.device("cpu"))
            if beta:  # another reference than the policy's initial weights, sharded like it
                other = build_model(MODEL, cfg.replace(seed=REF_SEED), mesh, torch.device("cpu"))
                trainer.objective.reference = TokenReference(other, trainer.ctx, TEMPERATURE)
            out[(hp, cp, loss_type)] = step_with_grads(
                trainer, _batches(old if with_old else None, mesh.dp, mesh.dp_rank), rank)
    return out


def _reference(loss_type: str, level: str, beta: float, old) -> tuple[float, dict, dict]:
    policy, ref_model = _models()
    pieces = [completion_logps(policy, p, c, TEMPERATURE) for p, c in _tokens()]
    with torch.no_grad():
        ref = [completion_logps(ref_model, p, c, TEMPERATURE)[0] for p, c in _tokens()] if beta else None
    rollouts = _rollouts(None)
    loss, metrics = formula_loss([lp for lp, _ in pieces], [r.advantage for r in rollouts], loss_type=loss_type,
                                 epsilon=0.2, epsilon_high=0.28, beta=beta, importance_sampling=level,
                                 max_completion_length=10, old=old, ref=ref, entropies=[e for _, e in pieces])
    loss.backward()
    rewards = np.array([s[3] for s in SHAPES])
    metrics.update({"reward": rewards.mean(), "reward_std": rewards.std(ddof=1), "completions": len(SHAPES),
                    "completions/mean_length": np.mean([s[1] for s in SHAPES])})
    return float(loss.detach()), {n: p.grad for n, p in policy.named_parameters()}, metrics


def test_grpo_step_equals_the_unsharded_reference_world_1_and_4():
    old = _old_logps()
    references = {s[0]: _reference(s[0], s[1], s[2], old if s[3] else None) for s in SETTINGS}
    assert references["grpo"][2]["clip_ratio/region_mean"] > 0.5  # the behaviour log-probabilities clip
    assert references["dapo"][2]["kl"] > 1e-3  # the reference differs from the policy
    for world, layouts in ((1, [(1, 1)]), (4, [(2, 2), (1, 2)])):
        assert_steps_equal(run_distributed(_sharded, world, layouts, old), references)


def _actor(rank: int, world: int, hp: int, cp: int) -> tuple[list[torch.Tensor], float]:
    from loongtrain.objectives.grpo_actor import Actor
    from loongtrain.train.trainer import Trainer

    mesh = init_mesh(hp, cp)
    cfg = TrainConfig.from_dict(dict(seq_len=SEQ, batch_size=1, grad_accum=4 // mesh.dp, steps=1, warmup=0, clip=0.0,
                                     dtype="fp64", parallel=ParallelConfig(hp=hp, cp=cp), objective="grpo",
                                     doc_mask="on", position_reset=True, temperature=TEMPERATURE))
    trainer = Trainer(run_of(cfg, MODEL), mesh, torch.device("cpu"))
    actor = Actor(trainer.ctx, trainer.run, trainer.step)
    prompts, completions = zip(*_tokens())
    logps = actor.logps(prompts, completions)
    record = actor.update(prompts, completions, [r.advantage for r in _rollouts(None)])
    return logps, record["loss"]


def test_actor_api_logps_and_update_at_world_1_and_4():
    """The library API: per-token log-probabilities of token ids, gathered from the shards, and one update from
    ids and advantages, equal the unsharded reference."""
    policy, _ = _models()
    with torch.no_grad():
        expected = [completion_logps(policy, p, c, TEMPERATURE)[0] for p, c in _tokens()]
    ref_loss = _reference("dapo", "token", 0.0, None)[0]
    for world, hp, cp in ((1, 1, 1), (4, 2, 2)):
        for logps, loss in run_distributed(_actor, world, hp, cp):
            assert len(logps) == len(expected)
            for got, want in zip(logps, expected):
                torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
            assert abs(loss - ref_loss) < 1e-10, (world, loss, ref_loss)
