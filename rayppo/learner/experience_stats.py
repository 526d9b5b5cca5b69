"""The figures ``make_experience`` reports, over the global batch: the KL to the reference, the
critic's fit, the off-policy ratios (with the geometric-mean mask of rollout correction, which
reads the same ratios: ``proximal_terms``). Each rank's sums and counts are all-reduced, so N ranks
report what one process would."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from rayppo.choices import KLEstimator
from rayppo.learner import ppo
from rayppo.learner.collective import Collective
from rayppo.learner.update_plan import UpdatePlan


def global_means(values: dict[str, torch.Tensor], weight: float, collective: Collective) -> dict[str, float]:
    """Weighted means over ranks of per-rank scalars (weight = this rank's rows or tokens)."""
    stacked = torch.stack([v.detach().double().cpu() * weight for v in values.values()] + [torch.tensor(weight, dtype=torch.float64)])
    summed = collective.sum(stacked)
    return {k: float(summed[i] / summed[-1]) for i, k in enumerate(values)}


@dataclass(frozen=True)
class ReferenceKL:
    """The KL to the reference over the global batch, per response."""

    mean: float
    """Mean over responses of sum_t KL_t in the k1 estimate (docs/algorithm.md's KL_t): the sequence
    KL whatever estimator shapes the reward; what the KL controller and ``stop.kl_budget`` read."""
    penalty_mean: float
    """The same sum in the configured estimator (``ppo.kl_estimator``)."""
    k3_mean: float
    """The same sum in the k3 estimate: as unbiased, and >= 0 in every response, where the k1 mean of a
    batch dips below 0 by sampling noise while the KL is small (what ``plot.png`` draws KL with)."""

    def metrics(self) -> dict[str, float]:
        """``kl/ref_mean``, ``kl/penalty_mean`` and ``kl/ref_k3_mean``, for the metrics line."""
        return {"kl/ref_mean": self.mean, "kl/penalty_mean": self.penalty_mean, "kl/ref_k3_mean": self.k3_mean}


def kl_stats(
    policy_logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, kl_estimator: KLEstimator,
    collective: Collective,
) -> ReferenceKL:
    """KL to the reference over the global batch (all [B, T] inputs)."""
    kl_per_response = ppo.masked_sum_per_row(ppo.kl_penalty(policy_logprobs, ref_logprobs, "k1"), mask)
    penalty_per_response = ppo.masked_sum_per_row(ppo.kl_penalty(policy_logprobs, ref_logprobs, kl_estimator), mask)
    k3_per_response = ppo.masked_sum_per_row(ppo.kl_penalty(policy_logprobs, ref_logprobs, "k3"), mask)
    means = global_means({"k1": kl_per_response.mean(), "penalty": penalty_per_response.mean(),
                          "k3": k3_per_response.mean()}, mask.shape[0], collective)  # one all-reduce for all
    return ReferenceKL(mean=means["k1"], penalty_mean=means["penalty"], k3_mean=means["k3"])


def value_stats(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
                 collective: Collective) -> dict[str, float]:
    """The critic's figures over the global batch: explained variance, mean value and return."""
    # Over the global batch: the ranks' moments add (their explained variances would not).
    stats = {"value/explained_variance": float(ppo.explained_variance_from_moments(
        collective.sum(ppo.masked_moments(returns, mask)), collective.sum(ppo.masked_moments(returns - values, mask))))}
    return stats | global_means({"value/mean": ppo.masked_mean(values, mask),
                                  "returns/mean": ppo.masked_mean(returns, mask)}, float(mask.sum()), collective)


def offpolicy_stats(log_ratio: torch.Tensor, mask: torch.Tensor, collective: Collective,
                     row_keep: torch.Tensor | None = None) -> dict[str, float]:
    """``offpolicy/is_ratio_mean|max``: pi_prox / mu per valid token of the global batch, before
    any truncation (1 on rows of the learner's version in fp32; how far the stale rows, or the
    generator's numerics, have drifted); with a geometric-mean mask, ``correction/masked_rows``:
    the share of rows it dropped."""
    ratio = torch.exp(log_ratio) * mask
    means = {"offpolicy/is_ratio_mean": ppo.masked_mean(ratio, mask)}
    stats = global_means(means, float(mask.sum()), collective)
    # Ratios are > 0 and padding is 0, so the plain max is the max over valid tokens.
    stats["offpolicy/is_ratio_max"] = float(collective.max(ratio.max().double()))
    if row_keep is not None:
        stats |= global_means({"correction/masked_rows": 1.0 - row_keep.double().mean()}, float(len(row_keep)),
                               collective)
    return stats


@dataclass(frozen=True)
class ProximalTerms:
    """What the experience derives from the log-probs of the policy being improved (pi_old, or
    pi_prox): whichever computes them, the experience pass or the update's first forward
    (``proximal.fused_proximal``), gets the same terms from the same code."""

    row_keep: torch.Tensor | None
    """[B] the geometric-mean mask (``Experience.row_keep``); None: every row kept."""
    kl: ReferenceKL | None
    """The KL to the reference; None without one."""
    stats: dict[str, float]
    """``kl/*`` and ``offpolicy/*``, ``correction/masked_rows``."""


class PolicyTokens(NamedTuple):
    """The log-probs ``proximal_terms`` compares, all ``[B, T]``, 0 on padding."""

    logprobs: torch.Tensor
    """log pi of the policy being improved: pi_old (= mu) in lock-step, else pi_prox."""
    behaviour_logprobs: torch.Tensor
    """log mu, the generator's."""
    ref_logprobs: torch.Tensor | None
    """log pi_ref; None: no reference loaded."""
    mask: torch.Tensor
    """The valid tokens."""


def proximal_terms(tokens: PolicyTokens, plan: UpdatePlan, collective: Collective) -> ProximalTerms:
    """The KL to the reference (none without ``tokens.ref_logprobs``) of the policy being improved,
    and, where pi_prox is not mu's (``plan.proximal`` other than ``behaviour``: ``tokens.logprobs``
    is pi_prox), the off-policy figures of log(pi_prox / mu) and the geometric-mean mask
    (``plan.geo_mask``, ``ppo.geo_mask_bound``). Collective: every rank calls it."""
    logprobs, behaviour_logprobs, ref_logprobs, mask = tokens
    kl = None if ref_logprobs is None else kl_stats(logprobs, ref_logprobs, mask, plan.ppo.kl_estimator, collective)
    stats = {} if kl is None else kl.metrics()
    if plan.proximal == "behaviour":
        return ProximalTerms(None, kl, stats)
    log_ratio = (logprobs - behaviour_logprobs) * mask
    row_keep = ppo.geometric_mean_mask(log_ratio, mask, plan.ppo.geo_mask_bound) if plan.geo_mask else None
    return ProximalTerms(row_keep, kl, stats | offpolicy_stats(log_ratio, mask, collective, row_keep))
