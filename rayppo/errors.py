"""The errors a user acts on. Every one is a ``RayppoError``: its message is one line that names
the culprit (field, file and row, function, URL, role and actor), and ``rayppo`` prints it and
exits 2 with no traceback. Raised mid-run, the run first stops with a checkpoint where it can.

This module imports nothing, so the command line can catch them before loading anything heavy.
"""

from __future__ import annotations


class RayppoError(Exception):
    """A problem with the job's input or its cluster, said in one line naming the culprit."""


class ModelFolderError(RayppoError, FileNotFoundError):
    """A model folder that is missing, is not a model, or cannot be used; names field and path."""


class Preempted(KeyboardInterrupt):
    """SIGTERM before the training loop started (its own handler takes over from there):
    ``rayppo train`` closes what it started and exits 143, as a terminated program does."""


def raise_preempted(signum, frame) -> None:
    """A SIGTERM handler: unwind as on Ctrl-C, so that every ``finally`` and ``close`` runs."""
    raise Preempted


class ActorFailedError(RayppoError, RuntimeError):
    """An actor failed more often than ``cluster.max_actor_restarts`` allows within its window, or could not be
    brought up to date after a restart; the message names role, actor and cause."""


class LearnerFailedError(ActorFailedError):
    """A learner rank died or missed ``cluster.call_timeout_s``: the group cannot go on as it is
    (its collectives and ZeRO partitions are gone) and is rebuilt from the latest checkpoint."""


def brief(exc: BaseException) -> str:
    """``TypeName: first line`` of an exception (Ray's actor errors run to many lines)."""
    lines = str(exc).splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"
