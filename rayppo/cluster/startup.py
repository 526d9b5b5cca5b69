"""Starting a job's actors: wait until every one answers ``Engine.ready``, one line per role,
and an actor that fails while starting named with its own error and log file."""

from __future__ import annotations

import time
from typing import Any

import ray
from ray.exceptions import RayActorError

from rayppo.cluster.group import ActorGroup, get
from rayppo.console import LOG_NAMES, console
from rayppo.errors import ActorFailedError, brief
from rayppo.machine.role_resources import Engine


def start_failure(exc: RayActorError) -> str:
    """Why an actor died while starting: an error in its ``__init__`` ends Ray's message as
    ``Type: message``; any other death is said by its first line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if getattr(exc, "actor_init_failed", False) and lines else brief(exc)


def wait_ready(groups: dict[str, ActorGroup], timeout_s: float) -> None:
    """Wait until every actor answers ``Engine.ready``; one line per role as its last actor
    does (what it holds, the slowest actor's start-up seconds). An actor that fails while
    starting raises its own error, with the log file that holds the details."""
    pending = {ref: (role, i) for role, group in groups.items() for i, ref in enumerate(group.call_all(Engine.ready))}
    answers: dict[str, list[tuple[str, float]]] = {role: [] for role in groups}
    deadline = time.monotonic() + timeout_s
    with console.waiting(f"starting {len(pending)} actors", len(pending)) as progress:
        while pending:
            _next_ready(pending, answers, groups, deadline, timeout_s)
            progress()


def _next_ready(pending: dict[Any, tuple[str, int]], answers: dict[str, list[tuple[str, float]]],
                groups: dict[str, ActorGroup], deadline: float, timeout_s: float) -> None:
    """Wait for the next actor to answer ``ready``; print its role's line when it was the last."""
    done, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
    if not done:
        late = sorted({f"{LOG_NAMES[r]}-{i}" for r, i in pending.values()})
        raise ActorFailedError(f"{', '.join(late)} did not start within cluster.call_timeout_s={timeout_s:g} s"
                               f"{console.details(*next(iter(pending.values())))}")
    role, i = pending.pop(done[0])
    try:
        answers[role].append(get(done[0]))
    except RayActorError as exc:
        raise ActorFailedError(f"{LOG_NAMES[role]}-{i} failed while starting: {start_failure(exc)}"
                               f"{console.details(role, i)}") from None
    if len(answers[role]) == len(groups[role]):
        what, seconds = answers[role][0][0], max(s for _, s in answers[role])
        n = len(groups[role])
        label = LOG_NAMES[role] + (f" x{n}" if n > 1 else "")
        console.phase(f"{label:<13} ready in {seconds:5.1f} s: {what}")

