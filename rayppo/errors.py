"""Errors that stop a run at an iteration boundary after a checkpoint (the driver catches them)."""

from __future__ import annotations


class ActorFailedError(RuntimeError):
    """An actor failed more often than ``cluster.max_actor_restarts`` allows, or could not be
    brought up to date after a restart; the message names role, actor and cause."""
