"""Reductions over the learner ranks, as the learn step sees them: ``LocalCollective`` in one
process, ``TorchCollective`` (``learner_engine.py``) over torch.distributed on the ranks."""

from __future__ import annotations

from typing import Protocol

import torch


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
