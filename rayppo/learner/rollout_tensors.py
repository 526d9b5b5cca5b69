"""A rollout as the learner's tensors: converted once, where it enters the learner.

``Rollout`` (``data/rollout.py``) is the record that crosses processes: Python lists, one row per
response, and no torch. Everything the update computes takes tensors; ``RolloutTensors.of`` builds
them in one place, on the learner's device, and ``make_experience`` (``experience.py``) works from
them alone. ``padded`` and ``truncated`` are its column conversions (tests compare with them too).
Shapes follow docs/algorithm.md, "Tensor conventions": ``[B, T]`` over response positions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rayppo.data.rollout import Rollout
from rayppo.models.sequences import PackedBatch, pack


@dataclass
class RolloutTensors:
    """One rank's rows of a scored rollout, as tensors on the learner's device, and where they sit
    in the batch (``num_groups``)."""

    batch: PackedBatch
    """Token tensors: prompt | response layout, ``batch.mask`` [B, T] (the action mask of episodes)."""
    old_logprobs: torch.Tensor
    """[B, T] log mu(y_t | S_{t-1}), the generator's (pi_old in lock-step); 0 on padding."""
    ref_logprobs: torch.Tensor | None
    """[B, T] log pi_ref(y_t | S_{t-1}); None when no reference ran (kl_coef = 0)."""
    teacher_logprobs: torch.Tensor | None
    """[B, T] log pi_T(y_t | S_{t-1}) of the distillation teacher; None without one."""
    teacher_top_ids: torch.Tensor | None
    """[B, T, k] long: the teacher's k most likely tokens per position (``distill.topk``); None without them."""
    teacher_top_logprobs: torch.Tensor | None
    """[B, T, k] log pi_T of those tokens; None without them."""
    scores: torch.Tensor
    """[B] float32 r_phi(x, y)."""
    truncated: torch.Tensor
    """[B] bool: the response was cut at the length limit (finish reason ``length``)."""
    generator_ids: torch.Tensor
    """[B] long, on the host: the generator that sampled each row (0 when unrecorded)."""
    group_ids: torch.Tensor | None
    """[B] long: each row's prompt group; None for a rollout without groups."""
    versions: torch.Tensor | None
    """[B, T] long: the policy version that sampled each token (-1 on padding); None when a row
    has no recorded version."""
    turn_ends: torch.Tensor | None
    """[B, K] long: the response position of each policy turn's last token (-1 past a row's
    turns); None for single-turn rows."""
    turn_rewards: torch.Tensor | None
    """[B, K] float32: the environment's reward for each turn; None for single-turn rows."""
    episodes: bool
    """The rows are multi-turn episodes (``batch.mask`` is an action mask)."""
    num_groups: int
    """An upper bound of the batch's group ids, the same on every rank: the batch's rows (``of``
    counts this shard's; the learn step sets the whole batch's)."""

    @staticmethod
    def of(rollout: Rollout, pad_id: int, device: torch.device | str = "cpu",
           pack_mode: str = "") -> RolloutTensors:
        """Every column the update reads, as tensors on ``device``; ``pack_mode``: how the forward
        passes lay the rows out (``PackedBatch.pack_mode``; "": padded rows)."""
        n = len(rollout)
        batch = dataclasses.replace(pack(rollout.prompt_ids, rollout.response_ids, pad_id, rollout.action_mask),
                                    pack_mode=pack_mode).to(device)
        versioned = len(rollout.policy_version) == n
        return RolloutTensors(
            batch=batch,
            old_logprobs=padded(rollout.logprobs).to(device),
            ref_logprobs=padded(rollout.ref_logprobs).to(device) if rollout.ref_logprobs else None,
            teacher_logprobs=padded(rollout.teacher_logprobs).to(device) if rollout.teacher_logprobs else None,
            teacher_top_ids=padded(rollout.teacher_top_ids, torch.long).to(device) if rollout.teacher_top_ids else None,
            teacher_top_logprobs=padded(rollout.teacher_top_logprobs).to(device) if rollout.teacher_top_logprobs else None,
            scores=torch.tensor(rollout.score, dtype=torch.float32, device=device),
            truncated=truncated(rollout).to(device),
            generator_ids=torch.tensor(rollout.generator_id or [0] * n, dtype=torch.long),
            group_ids=torch.tensor(rollout.group_id, dtype=torch.long, device=device) if rollout.group_id else None,
            versions=padded(rollout.versions(), torch.long, value=-1).to(device) if versioned else None,
            turn_ends=padded(rollout.turn_ends, torch.long, value=-1).to(device) if rollout.turn_rewards else None,
            turn_rewards=padded(rollout.turn_rewards, torch.float32).to(device) if rollout.turn_rewards else None,
            episodes=bool(rollout.action_mask),
            num_groups=n,
        )

    def __len__(self) -> int:
        return int(self.scores.shape[0])


def padded(rows: Sequence[Sequence], dtype: torch.dtype = torch.float32, value: float = 0.0) -> torch.Tensor:
    """Ragged per-token rows (a ``Rollout`` column such as ``logprobs``) right-padded with ``value``
    into a ``[B, max_len]`` tensor; rows of k numbers per token (``teacher_top_*``) into ``[B, max_len, k]``."""
    width = max((len(r) for r in rows), default=0)
    per_token = next((torch.tensor(r[0]).shape for r in rows if r), ())  # () for a number, (k,) for k numbers
    out = torch.full((len(rows), width, *per_token), value, dtype=dtype)
    for i, row in enumerate(rows):
        if row:
            out[i, : len(row)] = torch.tensor(row, dtype=dtype)
    return out


def truncated(rollout: Rollout) -> torch.Tensor:
    """``[B]`` bool: the response was cut at the length limit (finish reason ``length``), so its
    return needs the truncation rule (``ppo.truncation_targets``)."""
    return torch.tensor([reason == "length" for reason in rollout.finish_reason], dtype=torch.bool)
