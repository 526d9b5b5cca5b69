"""The group estimators' math: group statistics and group advantages. Pure functions over tensors,
as ``ppo.py`` (docs/estimators.md, "The formulas"; the tensor conventions of docs/algorithm.md).
REINFORCE++'s returns and DAPO's overlong ramp are ``rewards.py``'s.

Group statistics are sums and maxima, so an all-reduce of each rank's partial statistics is the
whole batch's however a group's rows are spread over the learner ranks (docs/estimators.md,
"Correct across ranks")."""

from __future__ import annotations

from typing import NamedTuple

import torch

from rayppo.choices import GroupEstimator


def group_sums(x: torch.Tensor, group_ids: torch.Tensor, num_groups: int) -> torch.Tensor:
    """``[B] -> [G]`` float64: the sum of ``x`` over each group's rows (0 for a group with none).

    Sums add across ranks: an all-reduce of each rank's ``group_sums`` is the whole batch's, however
    the rows of a group are spread over the ranks."""
    out = torch.zeros(num_groups, dtype=torch.float64, device=x.device)
    return out.index_add_(0, group_ids.long(), x.to(torch.float64))


def group_extremes(x: torch.Tensor, group_ids: torch.Tensor, num_groups: int) -> torch.Tensor:
    """``[B] -> [G, 2]`` float64: (max x, -min x) of each group (-inf for a group with no row
    here); an all-reduce with max gives the batch's. A group is all-equal when max + (-min) = 0."""
    out = torch.full((num_groups, 2), -torch.inf, dtype=torch.float64, device=x.device)
    x64, ids = x.to(torch.float64), group_ids.long()
    out[:, 0].scatter_reduce_(0, ids, x64, "amax")
    out[:, 1].scatter_reduce_(0, ids, -x64, "amax")
    return out


class GroupStats(NamedTuple):
    """The statistics of each of G groups over every row of the batch (float64; e.g. all-reduced
    ``group_sums`` and ``group_extremes``): what ``group_advantages`` reads."""

    counts: torch.Tensor
    """[G] n_g, the group's rows."""
    means: torch.Tensor
    """[G] mean_g r."""
    squared_deviations: torch.Tensor
    """[G] sum_{j in g} (r_j - mean_g r)^2."""
    extremes: torch.Tensor
    """[G, 2] (max_g r, -min_g r) (``group_extremes``)."""


def group_advantages(
    scores: torch.Tensor,
    group_ids: torch.Tensor,
    stats: GroupStats,
    estimator: GroupEstimator,
    std_floor: float = 1e-6,
) -> torch.Tensor:
    """``[B]`` sequence advantages A_i of the group estimators from whole-batch group statistics.

    ``scores`` [B]: each row's r_i; ``group_ids`` [B]: its group g; ``stats``: n_g, mean_g r, the
    squared deviations and extremes of every group (``GroupStats``).

        grpo                   A_i = (r_i - mean_g r) / max(std_g r, std_floor)
        dr_grpo                A_i = r_i - mean_g r
        reinforce_pp_baseline  A_i = r_i - mean_g r   (the caller whitens over the batch)
        rloo                   A_i = r_i - (sum_{j in g} r_j - r_i) / (n_g - 1) = n_g / (n_g - 1) (r_i - mean_g r)

    std_g is the unbiased sample standard deviation (divisor n_g - 1), as DeepSeekMath's GRPO and
    the implementations whose recipes users bring (TRL, veRL) compute it: the same rewards give
    the same advantages as there. ``std_floor`` keeps a near-constant group's rounding residue
    from being divided by ~0. A group whose rewards are all exactly equal (and a group of one row)
    gets A = 0 under every estimator, not rounding residue over a floor.
    """
    counts, means, squared_deviations, extremes = stats
    g = group_ids.long()
    n = counts.to(torch.float64)[g]
    centred = scores.to(torch.float64) - means.to(torch.float64)[g]
    flat = (extremes[:, 0] + extremes[:, 1] == 0)[g] | (n < 2)
    if estimator == "grpo":
        std = (squared_deviations.to(torch.float64)[g] / (n - 1).clamp(min=1.0)).sqrt()
        advantages = centred / std.clamp(min=std_floor)
    elif estimator in ("dr_grpo", "reinforce_pp_baseline"):
        advantages = centred
    elif estimator == "rloo":
        advantages = centred * n / (n - 1).clamp(min=1.0)
    else:
        raise ValueError(f"estimator must be grpo, dr_grpo, rloo or reinforce_pp_baseline, got {estimator!r}")
    return torch.where(flat, torch.zeros_like(advantages), advantages).to(scores.dtype)
