"""Errors that stop a run at an iteration boundary after a checkpoint (the driver catches them)."""

from __future__ import annotations


class ActorFailedError(RuntimeError):
    """An actor failed more often than ``cluster.max_actor_restarts`` allows, or could not be
    brought up to date after a restart; the message names role, actor and cause."""


class LearnerFailedError(ActorFailedError):
    """A learner rank died or missed ``cluster.call_timeout_s``: the group cannot go on as it is
    (its collectives and ZeRO partitions are gone) and is rebuilt from the latest checkpoint."""
