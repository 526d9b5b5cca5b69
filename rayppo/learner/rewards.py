"""A row's rewards outside PPO's core (``ppo.py``): DAPO's overlong ramp on its score, and the
discounted reward-to-go the critic-free estimators take as their return (REINFORCE++, and the KL
part of the group estimators' advantages). Pure functions over tensors, as ``ppo.py``
(docs/estimators.md, "The formulas"; the tensor conventions of docs/algorithm.md)."""

from __future__ import annotations

import torch


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """REINFORCE++'s per-token returns ``[B, T]``: G_t = sum_{k >= t} gamma^(k - t) r_k over the
    row's valid tokens (0 on padding); ``compute_gae`` with V = 0 and lam = 1 is the same sum."""
    mask_f = mask.to(rewards.dtype)
    returns = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    for t in reversed(range(rewards.shape[1])):
        running = (rewards[:, t] + gamma * running) * mask_f[:, t]
        returns[:, t] = running
    return returns


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025), ``[B]``, added to the score:

        0                                         |y| <= L_max - L
        factor ((L_max - L) - |y|) / L            L_max - L < |y| <= L_max

    a linear ramp from 0 to -factor over the last ``buffer`` = L tokens before ``max_length`` =
    L_max (responses are never longer than L_max here: the sampler stops there)."""
    if buffer <= 0:
        return torch.zeros(lengths.shape, dtype=torch.float32, device=lengths.device)
    start = max_length - buffer
    over = (lengths.to(torch.float32) - start).clamp(min=0.0)
    return -factor * over / buffer
