"""The learner's half of an iteration: rollout -> experience -> clipped PPO updates.

``make_experience`` turns a scored rollout into the tensors PPO needs (values, shaped rewards,
GAE advantages and returns, whitened advantages); ``ppo_update`` runs M epochs x minibatches of
the clipped policy and value losses. Both call only the functions of ``rayppo.learner.ppo``.
The in-process reference trainer and the distributed learner ranks share this module; the
distributed ranks pass ``all_reduce`` so that whitening and loss normalisation are global.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from rayppo.config import PPOConfig
from rayppo.data.rollout import Rollout
from rayppo.learner import ppo
from rayppo.models.sequences import PackedBatch, critic_forward, pack, policy_forward

AllReduce = Callable[[torch.Tensor], torch.Tensor]
"""Sums a tensor over learner ranks (identity in a single process)."""


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


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
    """[B, T] shaped rewards r_t = -beta KL_t (+ r_phi on the last token)."""
    advantages: torch.Tensor
    """[B, T] GAE advantages A_t (whitened when configured)."""
    returns: torch.Tensor
    """[B, T] value targets A_t + V_old(S_{t-1}) (before whitening)."""
    scores: torch.Tensor
    """[B] r_phi(x, y)."""

    def rows(self, index: torch.Tensor) -> "Experience":
        return Experience(
            self.batch.rows(index),
            *(t[index] for t in (self.old_logprobs, self.ref_logprobs, self.old_values, self.rewards,
                                 self.advantages, self.returns, self.scores)),
        )


@torch.no_grad()
def make_experience(
    rollout: Rollout,
    critic: torch.nn.Module,
    pad_id: int,
    kl_coef: float,
    cfg: PPOConfig,
    all_reduce: AllReduce = _identity,
) -> tuple[Experience, dict[str, float]]:
    """Values, shaped rewards, GAE and whitening for a scored rollout. Also returns stats."""
    batch = pack(rollout.prompt_ids, rollout.response_ids, pad_id)
    mask = batch.mask
    old_logprobs = rollout.tensor("logprobs")
    ref_logprobs = rollout.tensor("ref_logprobs")
    scores = torch.tensor(rollout.score, dtype=torch.float32)
    values, last_values = critic_forward(critic, batch)
    # Truncated rows continue past the cut: bootstrap with V(S_T). EOS rows end: bootstrap 0.
    bootstrap = torch.where(rollout.truncated(), last_values, torch.zeros_like(last_values))
    rewards = ppo.shape_rewards(scores, old_logprobs, ref_logprobs, mask, kl_coef, cfg.kl_estimator)
    advantages, returns = ppo.compute_gae(rewards, values, mask, cfg.gamma, cfg.lam, bootstrap)
    if cfg.whiten_advantages:
        moments = all_reduce(ppo.masked_moments(advantages, mask))
        advantages = ppo.whiten_from_moments(advantages, mask, moments)
    kl_per_response = ppo.masked_sum_per_row(ppo.kl_penalty(old_logprobs, ref_logprobs, "k1"), mask)
    stats = {
        "kl/ref_mean": kl_per_response.mean().item(),
        "value/explained_variance": ppo.explained_variance(values, returns, mask).item(),
        "value/mean": ppo.masked_mean(values, mask).item(),
        "returns/mean": ppo.masked_mean(returns, mask).item(),
    }
    exp = Experience(batch, old_logprobs, ref_logprobs, values, rewards, advantages, returns, scores)
    return exp, stats


def minibatch_loss(
    policy: torch.nn.Module,
    critic: torch.nn.Module,
    mb: Experience,
    cfg: PPOConfig,
    temperature: float,
    token_share: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """``(policy_loss, value_loss, stats)`` of one minibatch, both differentiable.

    ``token_share`` rescales token means when the minibatch is split over ranks (this rank's
    tokens / the average rank's tokens), so averaged gradients equal the global token mean.
    """
    mask = mb.batch.mask
    logprobs, entropy = policy_forward(policy, mb.batch, temperature, with_entropy=True)
    pg_loss, stats = ppo.policy_loss(logprobs, mb.old_logprobs, mb.advantages, mask, cfg.clip_eps, cfg.loss_agg)
    entropy_mean = ppo.masked_mean(entropy, mask)
    values, _ = critic_forward(critic, mb.batch)
    vf_loss = ppo.value_loss(values, mb.old_values, mb.returns, mask, cfg.value_clip)
    stats = {f"policy/{k}": v for k, v in stats.items()}
    gap = (logprobs.detach() - mb.old_logprobs).abs() * mask
    stats.update({
        "policy/loss": pg_loss.detach(),
        "value/loss": vf_loss.detach(),
        "entropy": entropy_mean.detach(),
        "logprob_mismatch/mean": ppo.masked_mean(gap, mask),
        "logprob_mismatch/max": gap.max(),
    })
    # seq-mean-token-mean weighs rows, not tokens: equal row counts per rank need no rescaling.
    pg_share = token_share if cfg.loss_agg == "token-mean" else 1.0
    policy_total = (pg_loss - cfg.entropy_coef * entropy_mean) * pg_share
    return policy_total, cfg.vf_coef * vf_loss * token_share, stats


def minibatch_indices(n_rows: int, minibatches: int, generator: torch.Generator) -> list[torch.Tensor]:
    """A seeded shuffle of the rows, cut into ``minibatches`` equal parts."""
    order = torch.randperm(n_rows, generator=generator)
    return list(order.chunk(minibatches))


def mean_stats(history: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Average each stat over the minibatches of an update."""
    keys = history[0].keys()
    return {key: float(torch.stack([h[key].float() for h in history]).mean()) for key in keys}


StepFn = Callable[[torch.Tensor, torch.Tensor], None]
"""Backward + optimiser step for (policy loss, value loss): plain torch or DeepSpeed engines."""


def ppo_update(
    policy: torch.nn.Module,
    critic: torch.nn.Module,
    exp: Experience,
    cfg: PPOConfig,
    temperature: float,
    step: StepFn,
    plan: list[list[torch.Tensor]],
    token_share: Callable[[Experience], float] = lambda mb: 1.0,
) -> dict[str, float]:
    """M epochs x minibatches of clipped PPO + value loss over ``exp``.

    ``plan[epoch][k]`` holds the rows of minibatch k (``minibatch_plan`` makes it). The first
    minibatch runs before any weight change, so its log-probs against the generator's old
    log-probs are the sync check ``logprob_mismatch``.
    """
    history: list[dict[str, torch.Tensor]] = []
    mismatch: dict[str, float] = {}
    for epoch_plan in plan:
        for rows in epoch_plan:
            mb = exp.rows(rows)
            policy_total, value_total, stats = minibatch_loss(policy, critic, mb, cfg, temperature, token_share(mb))
            if not history:
                mismatch = {k: float(stats[k]) for k in ("logprob_mismatch/mean", "logprob_mismatch/max")}
            step(policy_total, value_total)
            history.append({k: v for k, v in stats.items() if not k.startswith("logprob_mismatch")})
    return {**mean_stats(history), **mismatch}


def minibatch_plan(n_rows: int, epochs: int, minibatches: int, seed: int) -> list[list[torch.Tensor]]:
    """Row indices of every minibatch of every epoch: a fresh seeded shuffle per epoch."""
    generator = torch.Generator().manual_seed(seed)
    return [minibatch_indices(n_rows, minibatches, generator) for _ in range(epochs)]
