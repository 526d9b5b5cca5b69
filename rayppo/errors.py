"""The errors a user acts on. Every one is a ``RayppoError``: its message is one line that names
the culprit (field, file and row, function, URL, role and actor), and ``rayppo`` prints it and
exits 2 with no traceback. Raised mid-run, the run first stops with a checkpoint where it can.

This module imports only ``re`` and ``pathlib``, so the command line can catch them before loading anything heavy.
"""

from __future__ import annotations

import re
from pathlib import Path


class RayppoError(Exception):
    """A problem with the job's input or its cluster, said in one line naming the culprit."""


class ModelFolderError(RayppoError, FileNotFoundError):
    """A model folder that is missing, is not a model, or cannot be used; names field and path."""


class PreemptedError(KeyboardInterrupt):
    """SIGTERM before the training loop started (its own handler takes over from there):
    ``rayppo train`` closes what it started and exits 143, as a terminated program does."""


def raise_preempted(signum, frame) -> None:
    """A SIGTERM handler: unwind as on Ctrl-C, so that every ``finally`` and ``close`` runs."""
    raise PreemptedError


class ActorFailedError(RayppoError, RuntimeError):
    """An actor failed more often than ``cluster.max_actor_restarts`` allows within its window, or could not be
    brought up to date after a restart; the message names role, actor and cause."""


class LearnerFailedError(ActorFailedError):
    """A learner rank died or missed ``cluster.call_timeout_s``: the group cannot go on as it is
    (its collectives and ZeRO partitions are gone) and is rebuilt from the latest checkpoint."""


class GeneratorLostError(ActorFailedError):
    """A generator left the fleet (its replacement found no place in time): the call it was part
    of is made again on the generators left (``rayppo/cluster/fleet.py``)."""


class SharesLostError(GeneratorLostError):
    """Generators left the fleet during a fan-out, which ran to its end on the others first
    (``Supervisor.run``): ``results`` holds every share that was done (None where lost) and
    ``lost`` the positions of each fan-out whose generator left, so the caller samples only those
    again (nothing runs twice, no call is left running behind a retry)."""

    def __init__(self, message: str, results: list[list], lost: list[list[int]]):
        super().__init__(message)
        self.results, self.lost = results, lost


class FleetTooSmallError(ActorFailedError):
    """Fewer generators are left than ``generators.min_num``: the run stops with a checkpoint."""


class RunClosedError(RuntimeError):
    """A call that lost its actor while the run was closing (``Supervisor.close``): nothing to replace."""


ANSI = re.compile(r"\x1b\[[0-9;]*m")
RAY_HEADER = re.compile(r"^ray::[\w.]+\(\)(?: \(pid=[^)]*\))?:? ?")
"""Ray's header of an error raised in an actor: ``ray::GeneratorEngine.load_weights() (pid=..., ip=...,
actor_id=..., repr=...)``."""


def unwrapped(exc: BaseException) -> BaseException:
    """The exception an actor raised, out of Ray's ``RayTaskError(X)`` wrapping (which keeps it as
    ``cause``; ``RayTaskError.as_instanceof_cause``)."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException) and (type(cause).__name__ == type(exc).__name__
                                             or type(exc).__name__.startswith("RayTaskError")):
        return cause
    return exc


def plain(text: str) -> str:
    """``text`` on one line, without terminal colour codes or Ray's actor header."""
    return RAY_HEADER.sub("", " ".join(ANSI.sub("", text).split()))


def restated(exc: BaseException, suffix: str) -> BaseException:
    """An error an actor raised about its input (a ``RayppoError``, e.g. a reward function's failure),
    as its own type with its own one line and ``suffix`` (where the actor's log is): never Ray's
    header, colour codes or remote traceback."""
    cause = unwrapped(exc)
    text = plain(str(cause)) + suffix
    try:
        return type(cause)(text)
    except Exception:  # noqa: BLE001 - a type that takes other arguments: the message is what counts
        return RayppoError(text)


def brief(exc: BaseException) -> str:
    """``TypeName: first line`` of an exception, the one an actor raised when Ray wraps it (Ray's
    actor errors run to many lines, behind a header naming pid, ip and actor id)."""
    exc = unwrapped(exc)
    lines = [plain(line) for line in str(exc).splitlines()]
    return f"{type(exc).__name__}: {next((line for line in lines if line), '')}"


def new_path(path: Path, suffix: str) -> Path:
    """A file next to ``path`` named ``stem + suffix`` that does not exist yet, for the output of
    a command an error message suggests: a shell truncates a redirection target before the command
    reads its input, so a hint writing to its own input (``jq ... a.jsonl > a.jsonl``) would
    destroy the user's file."""
    candidate, n = path.with_name(path.stem + suffix), 2
    while candidate.exists() or candidate == path:
        candidate, n = path.with_name(f"{path.stem}-{n}{suffix}"), n + 1
    return candidate
