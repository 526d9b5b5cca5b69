"""The learner's half of an iteration: rollout -> experience -> clipped PPO updates.

``make_experience`` turns a scored rollout into the tensors PPO needs (values, shaped rewards,
GAE advantages and returns, whitened advantages); ``ppo_update`` runs M epochs x minibatches of
the clipped policy and value losses. Both call only the functions of ``rayppo.learner.ppo``.

The in-process reference trainer and the distributed learner ranks share this module. A rank
holds a contiguous shard of the rollout's rows; a ``Collective`` sums across ranks, so that
advantage whitening uses the global batch and each minibatch's loss is the global token mean:
with N ranks the update is the one a single process would make.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from rayppo.config import PPOConfig, RolloutConfig
from rayppo.data.rollout import Rollout
from rayppo.guard import MismatchGuard
from rayppo.learner import ppo
from rayppo.models.sequences import PackedBatch, critic_forward, pack, policy_forward


class Collective(Protocol):
    """Reductions over the learner ranks."""

    world_size: int

    def sum(self, x: torch.Tensor) -> torch.Tensor: ...

    def max(self, x: torch.Tensor) -> torch.Tensor: ...


class LocalCollective:
    """One process: every reduction is the identity."""

    world_size = 1

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def max(self, x: torch.Tensor) -> torch.Tensor:
        return x


@dataclass(frozen=True)
class TruncationRule:
    """How rows cut at the length limit enter the return (``rollout.truncation``)."""

    mode: str = "bootstrap"
    """``bootstrap``: no score, GAE bootstrapped with V(S_T). ``terminal``: score, bootstrap 0."""
    missing_eos_penalty: float = 0.0
    """Subtracted from a cut row's score under ``terminal``."""

    @staticmethod
    def of(rollout_cfg: RolloutConfig) -> "TruncationRule":
        return TruncationRule(rollout_cfg.truncation, rollout_cfg.missing_eos_penalty)


@dataclass
class Experience:
    """Everything one PPO update needs, for B responses of up to T tokens."""

    batch: PackedBatch
    """Token tensors: prompt | response layout, ``batch.mask`` [B, T]."""
    old_logprobs: torch.Tensor
    """[B, T] log pi_old(y_t | S_{t-1}) reported by the generator."""
    ref_logprobs: torch.Tensor
    """[B, T] log pi_ref(y_t | S_{t-1})."""
    old_values: torch.Tensor
    """[B, T] V_old(S_{t-1}) before the update."""
    rewards: torch.Tensor
    """[B, T] shaped rewards r_t = -beta KL_t (+ r_phi on the last token of rows that earned it)."""
    advantages: torch.Tensor
    """[B, T] GAE advantages A_t (whitened when configured)."""
    returns: torch.Tensor
    """[B, T] value targets A_t + V_old(S_{t-1}) (before whitening)."""
    scores: torch.Tensor
    """[B] r_phi(x, y) (logged whole; a cut row's enters ``rewards`` only under ``terminal``)."""
    generator_ids: torch.Tensor
    """[B] long: the generator that sampled each row (named by the correctness guard)."""

    def rows(self, index: torch.Tensor) -> "Experience":
        tensors = (self.old_logprobs, self.ref_logprobs, self.old_values, self.rewards,
                   self.advantages, self.returns, self.scores, self.generator_ids)
        return Experience(self.batch.rows(index), *(t[index] for t in tensors))


def _global_means(values: dict[str, torch.Tensor], weight: float, collective: Collective) -> dict[str, float]:
    """Weighted means over ranks of per-rank scalars (weight = this rank's rows or tokens)."""
    stacked = torch.stack([v.detach().double().cpu() * weight for v in values.values()] + [torch.tensor(weight, dtype=torch.float64)])
    summed = collective.sum(stacked)
    return {k: float(summed[i] / summed[-1]) for i, k in enumerate(values)}


@torch.no_grad()
def make_experience(
    rollout: Rollout,
    critic: torch.nn.Module,
    pad_id: int,
    kl_coef: float,
    cfg: PPOConfig,
    truncation: TruncationRule = TruncationRule(),
    collective: Collective = LocalCollective(),
    device: torch.device | str = "cpu",
) -> tuple[Experience, dict[str, float]]:
    """Values, shaped rewards, GAE and (global) whitening for this rank's scored rows."""
    batch = pack(rollout.prompt_ids, rollout.response_ids, pad_id).to(device)
    mask = batch.mask
    old_logprobs = rollout.tensor("logprobs").to(device)
    ref_logprobs = rollout.tensor("ref_logprobs").to(device)
    scores = torch.tensor(rollout.score, dtype=torch.float32, device=device)
    values, last_values = critic_forward(critic, batch)
    # A cut row: either V(S_T) stands in for its score (bootstrap) or the cut is final (terminal).
    returned_scores, bootstrap = ppo.truncation_targets(
        scores, last_values, rollout.truncated().to(device), truncation.mode, truncation.missing_eos_penalty)
    rewards = ppo.shape_rewards(returned_scores, old_logprobs, ref_logprobs, mask, kl_coef, cfg.kl_estimator)
    advantages, returns = ppo.compute_gae(rewards, values, mask, cfg.gamma, cfg.lam, bootstrap)
    if cfg.whiten_advantages:
        moments = collective.sum(ppo.masked_moments(advantages, mask))
        advantages = ppo.whiten_from_moments(advantages, mask, moments)
    # kl/ref_mean is always the k1 estimate (the seed's KL_t, summed per response): its mean is the
    # sequence KL whatever estimator shapes the reward; kl/penalty_mean is the configured one.
    kl_per_response = ppo.masked_sum_per_row(ppo.kl_penalty(old_logprobs, ref_logprobs, "k1"), mask)
    penalty_per_response = ppo.masked_sum_per_row(ppo.kl_penalty(old_logprobs, ref_logprobs, cfg.kl_estimator), mask)
    stats = _global_means({"kl/ref_mean": kl_per_response.mean(), "kl/penalty_mean": penalty_per_response.mean()},
                          len(rollout), collective)
    # Over the global batch: the ranks' moments add (their explained variances would not).
    stats["value/explained_variance"] = float(ppo.explained_variance_from_moments(
        collective.sum(ppo.masked_moments(returns, mask)), collective.sum(ppo.masked_moments(returns - values, mask))))
    stats |= _global_means(
        {
            "value/mean": ppo.masked_mean(values, mask),
            "returns/mean": ppo.masked_mean(returns, mask),
        },
        float(mask.sum()),
        collective,
    )
    generator_ids = torch.tensor(rollout.generator_id or [0] * len(rollout), dtype=torch.long)
    exp = Experience(batch, old_logprobs, ref_logprobs, values, rewards, advantages, returns, scores, generator_ids)
    return exp, stats


# ------------------------------------------------------------------------------------------
# Minibatches
# ------------------------------------------------------------------------------------------
@dataclass
class Minibatch:
    """This rank's part of one global minibatch."""

    rows: torch.Tensor
    """Local row indices into this rank's experience."""
    token_share: float
    """N x (this rank's valid tokens) / (the minibatch's tokens): rescales a local token mean
    so that the ranks' averaged gradients are the gradient of the global token mean."""
    row_share: float
    """The same for rows (used by the ``seq-mean-token-mean`` aggregation)."""


def minibatch_plan(n_rows: int, epochs: int, minibatches: int, seed: int) -> list[list[torch.Tensor]]:
    """Global row indices of every minibatch of every epoch: a fresh seeded shuffle per epoch.

    The plan depends only on the batch, never on the rank count.
    """
    generator = torch.Generator().manual_seed(seed)
    return [list(torch.randperm(n_rows, generator=generator).chunk(minibatches)) for _ in range(epochs)]


def local_minibatches(
    plan: list[list[torch.Tensor]], offset: int, mask: torch.Tensor, collective: Collective
) -> list[Minibatch]:
    """This rank's part of each planned minibatch; it owns global rows [offset, offset + B_r).

    A rank that owns none of a minibatch's rows still joins its gradient all-reduce: it runs
    one row with share 0.
    """
    n_local = mask.shape[0]
    parts = []
    for rows in (r for epoch in plan for r in epoch):
        mine = rows[(rows >= offset) & (rows < offset + n_local)] - offset
        parts.append(mine)
    local = torch.tensor([[float(mask[m].sum()), float(len(m))] for m in parts], dtype=torch.float64)
    total = collective.sum(local.clone())
    w = collective.world_size
    out = []
    for mine, (tokens, rows), (all_tokens, all_rows) in zip(parts, local.tolist(), total.tolist()):
        if len(mine) == 0:
            out.append(Minibatch(torch.zeros(1, dtype=torch.long), 0.0, 0.0))
        else:
            out.append(Minibatch(mine, w * tokens / max(all_tokens, 1.0), w * rows / all_rows))
    return out


def minibatch_loss(
    policy: torch.nn.Module,
    critic: torch.nn.Module,
    exp: Experience,
    mb: Minibatch,
    cfg: PPOConfig,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """``(policy objective, value objective, stats, gap)`` of this rank's part of a minibatch;
    ``gap`` [b, T] is |log pi - log pi_old| per token (0 on padding), the sync check."""
    part = exp.rows(mb.rows)
    mask = part.batch.mask
    logprobs, entropy = policy_forward(policy, part.batch, temperature, with_entropy=True,
                                       entropy_grad=cfg.entropy_coef != 0)
    pg_loss, pg_stats = ppo.policy_loss(logprobs, part.old_logprobs, part.advantages, mask, cfg.clip_eps, cfg.loss_agg)
    entropy_mean = ppo.masked_mean(entropy, mask)
    values, _ = critic_forward(critic, part.batch)
    vf_loss = ppo.value_loss(values, part.old_values, part.returns, mask, cfg.value_clip)
    gap = (logprobs.detach() - part.old_logprobs).abs() * mask
    stats = {f"policy/{k}": v for k, v in pg_stats.items()}
    stats |= {"policy/loss": pg_loss.detach(), "value/loss": vf_loss.detach(), "entropy": entropy_mean.detach()}
    # seq-mean-token-mean weighs rows, not tokens.
    pg_share = mb.token_share if cfg.loss_agg == "token-mean" else mb.row_share
    policy_objective = pg_share * pg_loss - mb.token_share * cfg.entropy_coef * entropy_mean
    return policy_objective, mb.token_share * cfg.vf_coef * vf_loss, stats, gap


StepFn = Callable[[torch.Tensor, torch.Tensor], None]
"""Backward + optimiser step for (policy objective, value objective): torch or DeepSpeed."""


def ppo_update(
    policy: torch.nn.Module,
    critic: torch.nn.Module,
    exp: Experience,
    minibatches: list[Minibatch],
    cfg: PPOConfig,
    temperature: float,
    step: StepFn,
    collective: Collective = LocalCollective(),
    guard: MismatchGuard | None = None,
) -> dict[str, float]:
    """M epochs x minibatches of clipped PPO + value loss; returns stats averaged over ranks.

    The first minibatch runs before any weight change, so its log-probs against the
    generator's old log-probs are the sync check ``logprob_mismatch``; ``guard`` stops the
    update there, before the first step, when the check fails.
    """
    weighted: dict[str, torch.Tensor] = {}
    first: dict[str, torch.Tensor] = {}
    for mb in minibatches:
        policy_objective, value_objective, stats, gap = minibatch_loss(policy, critic, exp, mb, cfg, temperature)
        if not first:
            mask = exp.batch.mask[mb.rows]
            first = {"mean": ppo.masked_mean(gap, mask) * mb.token_share, "max": gap.max()}
            if guard is not None:
                guard.check(gap, exp.generator_ids[mb.rows], collective)
        step(policy_objective, value_objective)
        for key, value in stats.items():
            weighted[key] = weighted.get(key, 0.0) + value.double() * mb.token_share
    keys = list(weighted)
    summed = collective.sum(torch.stack([weighted[k] for k in keys] + [first["mean"].double()]))
    denominator = collective.world_size * len(minibatches)
    out = {k: float(summed[i] / denominator) for i, k in enumerate(keys)}
    out["logprob_mismatch/mean"] = float(summed[-1] / collective.world_size)
    out["logprob_mismatch/max"] = float(collective.max(first["max"].double().clone()))
    return out
