"""Multi-turn episodes: the action tokens in order (docs/multi-turn.md, "The MDP on that record").

An episode's row interleaves the policy's turns with the environment's observations; its mask
(``ppo``'s convention) is 1 on the action tokens only. ``gather_actions`` lays a row out as its
action tokens alone, where GAE, V-trace and the discounted returns of ``ppo`` run unchanged, and
``scatter_actions`` puts their results back. Pure functions over tensors, as ``ppo.py``.
"""

from __future__ import annotations

import torch


def gather_actions(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, T] -> [B, A]``: each row's entries at its action tokens (``mask`` 1), in order, then
    0; A is the most action tokens of any row. Over these columns the valid entries are a prefix,
    so GAE, V-trace and the discounted returns run unchanged: consecutive actions of one turn are
    consecutive columns, and the last action of a turn is followed by the first of the next, so
    V_next there is the value at the next turn's first action (the state after the observation)."""
    keep = mask.bool()
    width = int(keep.sum(dim=-1).max()) if keep.numel() else 0
    out = x.new_zeros((x.shape[0], width))
    out[gathered_mask(mask).bool()] = x[keep]  # row-major on both sides: each row's actions in order
    return out


def gathered_mask(mask: torch.Tensor) -> torch.Tensor:
    """``[B, T] -> [B, A]``: the mask of ``gather_actions``' layout (a prefix of n_b ones per row)."""
    counts = mask.bool().sum(dim=-1)
    width = int(counts.max()) if counts.numel() else 0
    return (torch.arange(width, device=mask.device) < counts[:, None]).to(mask.dtype)


def scatter_actions(compact: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, A] -> [B, T]``: the inverse of ``gather_actions``, 0 on non-action tokens."""
    out = compact.new_zeros(mask.shape)
    out[mask.bool()] = compact[gathered_mask(mask).bool()]
    return out


def add_turn_rewards(rewards: torch.Tensor, turn_ends: torch.Tensor, turn_rewards: torch.Tensor) -> torch.Tensor:
    """``rewards [B, T]`` plus each turn's reward on its last action token.

    turn_ends: [B, K] long, the response index of turn k's last action token (-1: no such turn);
    turn_rewards: [B, K] the environment's reward for turn k (r_t += r_turn_k at t = end_k).
    """
    out = rewards.clone()
    rows, turns = (turn_ends >= 0).nonzero(as_tuple=True)
    out.index_put_((rows, turn_ends[rows, turns]), turn_rewards[rows, turns].to(out.dtype), accumulate=True)
    return out
