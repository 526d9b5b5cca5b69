"""The advantage estimators over a batch: A_t and the critic's targets of every row, from its shaped
rewards and values (``docs/estimators.md``).

GAE (or V-trace's targets over stale tokens), REINFORCE++'s whitened returns, and the group
estimators (GRPO, Dr. GRPO, RLOO, REINFORCE++ with a group baseline), whose statistics are the
global batch's: each rank's partial sums are all-reduced, so a group split over ranks is one
group. Multi-turn episodes run the same recursions over their action tokens only. The arithmetic
is ``ppo``'s, ``group_math``'s and ``rewards``'; this module only routes a batch through it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from rayppo.choices import GroupEstimator
from rayppo.config.schema import PPOConfig
from rayppo.learner import action_tokens, group_math, ppo
from rayppo.learner.collective import Collective
from rayppo.learner.rewards import discounted_returns


class EstimatorInputs(NamedTuple):
    """What the estimators read of B rows over T tokens (0 on padding)."""

    rewards: torch.Tensor
    """[B, T] the shaped rewards r_t (the score on the last token, -beta KL_t on every token)."""
    kl_rewards: torch.Tensor
    """[B, T] the KL part of r_t alone: -beta KL_t under ``kl_mode=reward``, else 0."""
    values: torch.Tensor
    """[B, T] V(S_{t-1}) before the update (0 without a critic)."""
    mask: torch.Tensor
    """[B, T] the tokens the estimators run over (an episode's actions)."""
    bootstrap: torch.Tensor
    """[B] the value after a row's last token: 0 at EOS, V(S_T) on a cut row (``ppo.truncation_targets``)."""
    log_ratio: torch.Tensor | None
    """[B, T] log(pi_prox / mu) on stale tokens, 0 elsewhere: V-trace's (``UpdatePlan.vtrace``);
    None: GAE's targets."""
    task_scores: torch.Tensor
    """[B] r_i, what each row earned without the KL: the group estimators' score."""
    group_ids: torch.Tensor | None
    """[B] long: each row's prompt group (None: no groups, which only GAE and REINFORCE++ accept)."""


def gae_targets(inputs: EstimatorInputs, cfg: PPOConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)`` [B, T]: GAE; or, given ``inputs.log_ratio`` = log pi_prox - log mu,
    the V-trace returns of ``ppo.compute_offpolicy_targets`` with its Retrace-style advantages
    (``offpolicy_advantages=retrace``) or GAE's (``gae``, over the same values)."""
    rewards, values, mask, bootstrap = inputs.rewards, inputs.values, inputs.mask, inputs.bootstrap
    if inputs.log_ratio is None:
        return ppo.compute_gae(rewards, values, mask, cfg.gamma, cfg.lam, bootstrap)
    trace = ppo.VTrace(cfg.gamma, cfg.lam, cfg.vtrace_rho_clip, cfg.vtrace_c_clip)
    advantages, returns = ppo.compute_offpolicy_targets(rewards, values, mask, inputs.log_ratio, trace, bootstrap)
    if cfg.offpolicy_advantages == "gae":
        advantages, _ = ppo.compute_gae(rewards, values, mask, cfg.gamma, cfg.lam, bootstrap)
    return advantages, returns


def batch_group_advantages(
    scores: torch.Tensor, group_ids: torch.Tensor, num_groups: int, estimator: GroupEstimator, std_floor: float,
    collective: Collective,
) -> torch.Tensor:
    """``[B]`` the group estimator's A_i of this rank's rows, from the statistics of each group's
    rows on *every* rank (all-reduced), so a group split across ranks is still one group.
    ``group_ids`` [B] index the batch's groups, all below ``num_groups``."""
    counts = collective.sum(group_math.group_sums(torch.ones_like(scores), group_ids, num_groups))
    means = collective.sum(group_math.group_sums(scores, group_ids, num_groups)) / counts.clamp(min=1.0)
    # Centred in a second pass (not E[r^2] - E[r]^2, which cancels catastrophically).
    deviations = (scores.to(torch.float64) - means[group_ids]).square()
    squared = collective.sum(group_math.group_sums(deviations, group_ids, num_groups))
    extremes = collective.max(group_math.group_extremes(scores, group_ids, num_groups))
    stats = group_math.GroupStats(counts, means, squared, extremes)
    return group_math.group_advantages(scores, group_ids, stats, estimator, std_floor)


def batch_advantages(inputs: EstimatorInputs, cfg: PPOConfig, num_groups: int,
                     collective: Collective) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)`` [B, T] of ``cfg.advantage`` (``docs/estimators.md``), whitened over
    the global batch where the estimator says so; ``returns`` are 0 without a critic. The group ids
    are below ``num_groups`` on every rank."""
    mask = inputs.mask
    if cfg.advantage == "gae":
        advantages, returns = gae_targets(inputs, cfg)
        whiten = cfg.whiten_advantages
    elif cfg.advantage == "reinforce_pp":
        advantages, returns = discounted_returns(inputs.rewards, mask, cfg.gamma), torch.zeros_like(inputs.values)
        whiten = True
    else:
        if inputs.group_ids is None:
            raise ValueError(f"ppo.advantage={cfg.advantage} needs each row's group id (Rollout.group_id)")
        # The group step sees the task score r_i itself: its std would turn the rounding noise of
        # beta sum_t KL_t (or of sum_t (r_t - r_KL,t), ~1e-8 in float32) into advantages of ~0.01
        # to 1 in a group of equal scores. The KL (kl_mode=reward) then enters each token as its
        # reward-to-go, -beta sum_{k>=t} KL_k (OpenRLHF's order).
        per_row = batch_group_advantages(inputs.task_scores, inputs.group_ids, num_groups, cfg.advantage,
                                         cfg.group_std_floor, collective)
        advantages = per_row[:, None] * mask.to(per_row.dtype) + discounted_returns(inputs.kl_rewards, mask, cfg.gamma)
        returns = torch.zeros_like(inputs.values)
        whiten = cfg.advantage == "reinforce_pp_baseline"
    if whiten:
        advantages = ppo.whiten_from_moments(advantages, mask, collective.sum(ppo.masked_moments(advantages, mask)))
    return advantages, returns


def episode_advantages(inputs: EstimatorInputs, cfg: PPOConfig, num_groups: int, collective: Collective,
                       multi_turn: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_advantages``; for multi-turn episodes over their action tokens only
    (``action_tokens.gather_actions``): the recursions step from a turn's last action to the next turn's
    first, through the observation."""
    if not multi_turn:
        return batch_advantages(inputs, cfg, num_groups, collective)
    mask = inputs.mask
    rewards, kl_rewards, values = (action_tokens.gather_actions(x, mask) for x in (inputs.rewards, inputs.kl_rewards,
                                                                         inputs.values))
    ratio = None if inputs.log_ratio is None else action_tokens.gather_actions(inputs.log_ratio, mask)
    actions = inputs._replace(rewards=rewards, kl_rewards=kl_rewards, values=values, mask=action_tokens.gathered_mask(mask),
                              log_ratio=ratio)
    advantages, returns = batch_advantages(actions, cfg, num_groups, collective)
    return action_tokens.scatter_actions(advantages, mask), action_tokens.scatter_actions(returns, mask)
