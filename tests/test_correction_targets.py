"""Rollout correction reaches only what it should (issue 47, items 4-6).

- The critic's targets: V-trace corrects for staleness; bf16 numerics on rows of the learner's own
  version must leave them GAE's, or the traces min(1, pi_prox / mu) shrink them on noise alone.
- Rows the geometric-mean mask drops are out of every term, normaliser and metric of the update.
- ``rollout_correction=none`` is the plain clipped loss against mu, also in asynchronous mode.
- A group of equal task scores (GRPO) gets no group term at all, only its KL reward-to-go.

In this process on the embedded model (no Ray, no vLLM): seconds.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rayppo.config.derived import Correction
from rayppo.config.schema import PPOConfig
from rayppo.data.rollout import Rollout
from rayppo.learner import ppo
from rayppo.learner.collective import LocalCollective
from rayppo.learner.experience import make_experience
from rayppo.learner.experience_passes import ProximalPolicy
from rayppo.learner.learn_settings import ExperienceSettings, LearnSettings, StepInputs, TruncationRule
from rayppo.learner.minibatches import MicroBatch, ShardPlan, local_minibatches
from rayppo.learner.objectives import policy_objective, value_objective
from rayppo.learner.ppo import kl_penalty
from rayppo.learner.rollout_tensors import RolloutTensors, padded
from rayppo.learner.update_plan import UpdatePlan
from rayppo.models.loading import load_causal_lm

ROWS, LENGTH = 4, 6


def _rollout(tokenizer, version: int = 0, seed: int = 0, score: float = 1.0) -> Rollout:
    g = torch.Generator().manual_seed(seed)
    response = [int(t) for t in torch.randint(5, len(tokenizer) - 1, (LENGTH,), generator=g)]
    logprobs = [[float(x) for x in -torch.rand(LENGTH, generator=g) - 1.0] for _ in range(ROWS)]
    rollout = Rollout([tokenizer("say 7 :")["input_ids"]] * ROWS, [response] * ROWS, logprobs, ["stop"] * ROWS,
                      ["say 7 :"] * ROWS, ["r"] * ROWS, [version] * ROWS, [0] * ROWS, group_id=[0, 0, 1, 1])
    rollout.score = [score] * ROWS
    return rollout


@pytest.fixture
def policy(embedded_dir):
    return load_causal_lm(embedded_dir)


def _experience(rollout, tokenizer, policy, cfg, staleness=0, correction="tis", version=0):
    """(experience, stats, the step's plan) of ``rollout`` at T = 1, without a critic."""
    settings = ExperienceSettings(cfg, TruncationRule("terminal"), max_staleness=staleness,
                                  correction=Correction.named(correction))
    tensors = RolloutTensors.of(rollout, tokenizer.pad_token_id)
    plan = UpdatePlan.decide(LearnSettings(settings), StepInputs(iteration=0, version=version, kl_coef=0.0), tensors)
    exp, stats, _ = make_experience(tensors, None, plan, LocalCollective(), ProximalPolicy(policy, 1.0, version))
    return exp, stats, plan


def test_a_synchronous_corrected_run_trains_its_critic_on_gae_targets(tokenizer, policy):
    """Terminal reward 1, V = 0, gamma = lam = 1: every token's target is 1. The rollout's mu is
    far from pi_prox (|log ratio| ~ 1), as no healthy run is; V-trace on these rows would give
    targets far below 1. Synchronous (k = 0): no row is stale, so the targets are GAE's."""
    cfg = PPOConfig(advantage="gae", value_targets="vtrace", gamma=1.0, lam=1.0, whiten_advantages=False)
    exp, _, _ = _experience(_rollout(tokenizer), tokenizer, policy, cfg)
    mask = exp.batch.mask
    assert exp.prox_logprobs is not None and float(((exp.prox_logprobs - exp.old_logprobs) * mask).abs().max()) > 0.1
    assert torch.equal(exp.returns * mask, mask.to(exp.returns.dtype))
    # Asynchronous, the rows one version old: V-trace's targets, below 1 where a trace is cut.
    stale, _, _ = _experience(_rollout(tokenizer, version=0), tokenizer, policy, cfg, staleness=1, version=1)
    assert float((stale.returns * mask).min()) < 0.99
    # ... and rows of the learner's own version in the same mode are GAE's again.
    fresh, _, _ = _experience(_rollout(tokenizer, version=1), tokenizer, policy, cfg, staleness=1, version=1)
    assert torch.equal(fresh.returns * mask, mask.to(fresh.returns.dtype))


def test_rows_the_geometric_mean_mask_drops_are_in_no_term_and_no_metric(tokenizer, policy, embedded_dir):
    """Row 1 dropped: the update's objective, its entropy, clip and importance figures, and the
    critic's loss are those of rows 0, 2 and 3 alone, with the normalisers of three rows."""
    from rayppo.models.loading import Critic

    cfg = PPOConfig(advantage="gae", gamma=1.0, lam=1.0, entropy_coef=0.01, whiten_advantages=False,
                    loss_agg="token-mean")
    exp, _, plan = _experience(_rollout(tokenizer), tokenizer, policy, cfg, correction="tis+geo_mask")
    keep = torch.tensor([1.0, 0.0, 1.0, 1.0])
    dropped = dataclasses.replace(exp.rows(torch.arange(ROWS)), row_keep=keep)
    alone = dataclasses.replace(exp.rows(torch.tensor([0, 2, 3])), row_keep=None)
    critic = Critic(load_causal_lm(embedded_dir).model)
    whole, whole_stats, _ = policy_objective(policy, dropped, MicroBatch(torch.arange(ROWS), 1.0, 1.0), plan)
    part, part_stats, _ = policy_objective(policy, alone, MicroBatch(torch.arange(3), 1.0, 1.0), plan)
    assert float(whole) == pytest.approx(float(part), rel=1e-6, abs=1e-9)
    for key in ("entropy", "policy/clipfrac", "policy/approx_kl", "policy/is_weight_mean"):
        assert float(whole_stats[key]) == pytest.approx(float(part_stats[key]), rel=1e-6, abs=1e-9), key
    v_whole, _ = value_objective(critic, dropped, MicroBatch(torch.arange(ROWS), 1.0, 1.0), plan)
    v_part, _ = value_objective(critic, alone, MicroBatch(torch.arange(3), 1.0, 1.0), plan)
    assert float(v_whole) == pytest.approx(float(v_part), rel=1e-6)
    # The shares of two micro-batches (rows 0-1, 2-3): the dropped row counts in neither normaliser.
    lengths = ([3] * ROWS, [LENGTH] * ROWS)
    shard = ShardPlan([[torch.arange(ROWS)]], torch.arange(ROWS), lengths, micro_batch_tokens=2 * (3 + LENGTH))
    (cut,) = local_minibatches(shard, LocalCollective(), keep=keep.tolist())
    assert [m.rows.tolist() for m in cut] == [[0, 1], [2, 3]]
    assert [(m.token_share, m.row_share) for m in cut] == [pytest.approx((1 / 3, 1 / 3)), pytest.approx((2 / 3, 2 / 3))]


def test_rollout_correction_none_is_the_plain_clipped_loss_in_asynchronous_mode(tokenizer, policy):
    cfg = PPOConfig(advantage="grpo", whiten_advantages=False)
    exp, _, plan = _experience(_rollout(tokenizer, version=0, score=0.0), tokenizer, policy, cfg, staleness=1,
                               correction="none", version=1)
    advantages = torch.randn(exp.advantages.shape, generator=torch.Generator().manual_seed(2)) * exp.batch.mask
    exp = dataclasses.replace(exp, advantages=advantages)
    assert exp.prox_logprobs is not None and not plan.decoupled
    objective, stats, _ = policy_objective(policy, exp, MicroBatch(torch.arange(ROWS), 1.0, 1.0), plan)
    from rayppo.models.sequences import policy_forward

    logprobs, _ = policy_forward(policy, exp.batch, 1.0, with_entropy=True)
    plain, _ = ppo.policy_loss(logprobs, exp.old_logprobs, exp.advantages, exp.batch.mask,
                               ppo.Surrogate(cfg.clip_eps, cfg.clip_eps_high, cfg.loss_agg))
    assert float(objective) == pytest.approx(float(plain), rel=1e-6) and "policy/is_weight_mean" not in stats


@pytest.mark.parametrize("noise_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_a_flat_group_gets_exactly_its_kl_reward_to_go(estimator, noise_dtype, tokenizer):
    """A reward of 0.5 for every response and KL of the size bf16 numerics give (|d| ~ 0.03..0.3
    per token): the advantages are -beta sum_{k>=t} KL_k to 1e-7, not a group term made of the
    float32 residue of sum_t (r_t - r_KL,t) divided by the std floor (0.0075 and -0.0224 seen)."""
    beta, n = 0.05, 24
    g = torch.Generator().manual_seed(0)
    response = [int(t) for t in torch.randint(5, len(tokenizer) - 1, (n,), generator=g)]
    old = -torch.rand(ROWS, n, generator=g) * 3
    ref = (old + 0.3 * torch.randn(ROWS, n, generator=g)).to(noise_dtype).float()
    rollout = Rollout([tokenizer("say 7 :")["input_ids"]] * ROWS, [response] * ROWS, old.tolist(), ["stop"] * ROWS,
                      ["say 7 :"] * ROWS, ["r"] * ROWS, [0] * ROWS, [0] * ROWS, group_id=[0] * ROWS)
    rollout.ref_logprobs = ref.tolist()
    rollout.score = [0.5] * ROWS
    tensors = RolloutTensors.of(rollout, tokenizer.pad_token_id)
    settings = ExperienceSettings(PPOConfig(advantage=estimator, kl_mode="reward"), TruncationRule("terminal"))
    plan = UpdatePlan.decide(LearnSettings(settings), StepInputs(iteration=0, version=0, kl_coef=beta), tensors)
    exp = make_experience(tensors, None, plan).experience
    kl = kl_penalty(padded(rollout.logprobs), padded(rollout.ref_logprobs))
    to_go = -beta * kl.flip(-1).cumsum(-1).flip(-1)
    assert float((exp.advantages - to_go.to(exp.advantages.dtype)).abs().max()) < 1e-7
