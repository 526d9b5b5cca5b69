"""The stages of an iteration and the clock that times them, whoever runs them (a rollout source,
the trainer's learner). The clock also names what the driver waits on now (``phase``), for
whoever watches the run from another thread (``benchmarks/fault_matrix.py``)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from enum import StrEnum


class Stage(StrEnum):
    """A timed stage of an iteration; its value is the ``phase`` the driver shows while it runs."""

    GENERATE = "generate"
    """The batch sampled (dynamic sampling's extra batches too)."""
    REFERENCE = "reference"
    """log pi_ref of the batch (in one process: a stage of its own)."""
    REWARD = "reward"
    """r_phi of the batch (in one process: a stage of its own)."""
    TEACHER = "teacher"
    """log pi_T of the batch, on-policy distillation (in one process: a stage of its own)."""
    SCORE = "score"
    """Reference and reward at the same time, on their own actors."""
    WAIT = "wait"
    """The pipelined source's learner waiting for a scored batch (its threads generate and score)."""
    LEARN = "learn"
    """The learner's update."""
    SYNC = "sync"
    """The updated policy to the generators (or, pipelined, to where they take it)."""
    VERIFY = "verify"
    """The guard's fingerprints of what each generator holds after the sync."""


PHASES = ("starting", "generate", "score", "wait", "learn", "sync", "verify", "evaluate", "checkpoint", "restore",
          "idle")
"""What the driver waits on (``StageClock.phase``) in a distributed run: its stages, the work
between iterations (``StageClock.during``), ``starting`` before the first and ``idle`` between."""


class StageClock:
    """The stages of one iteration: their wall seconds, and the one running now (``phase``)."""

    def __init__(self) -> None:
        self.phase = "starting"
        self.seconds: dict[Stage, float] = {}
        """Stage -> wall seconds, of the iteration begun last (``begin``), in the order they ran."""

    def begin(self) -> None:
        """A new iteration: no stage timed yet."""
        self.seconds = {}

    @contextmanager
    def stage(self, stage: Stage) -> Iterator[None]:
        """One stage: ``phase`` names it while it runs; its seconds go to ``seconds[stage]``. A
        stage that fails leaves ``phase`` on it (the fault matrix reads where a failure landed)."""
        self.phase, start = stage.value, time.perf_counter()
        yield
        self.seconds[stage] = time.perf_counter() - start
        self.phase = "idle"

    @contextmanager
    def during(self, name: str) -> Iterator[None]:
        """Work between iterations (evaluation, checkpoint, restore): named, not timed."""
        self.phase = name
        try:
            yield
        finally:
            self.phase = "idle"
