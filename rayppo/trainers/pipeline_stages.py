"""The asynchronous pipeline's records: one start of its stage threads (``Stages``), a batch in
the making, the published policy, and the busy clocks its timings read
(``rayppo/trainers/pipeline.py`` runs them)."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from rayppo.data.prompts import PromptBatch
from rayppo.data.rollout import Rollout

POLL_S = 0.2
"""How often a waiting thread looks at the stop flag and the stages' errors."""


class BusyClock:
    """When one worker (a generator, the scorers) was busy: ``busy(a, b)``, seconds within [a, b]."""

    def __init__(self) -> None:
        self._intervals: list[tuple[float, float]] = []
        self._since: float | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """The worker begins a task."""
        with self._lock:
            self._since = time.perf_counter()

    def stop(self) -> None:
        """The worker's task ended."""
        with self._lock:
            if self._since is not None:
                self._intervals.append((self._since, time.perf_counter()))
            self._since = None

    def busy(self, a: float, b: float) -> float:
        """Busy seconds in [a, b] (a task still running counts up to b); forgets what ended before a."""
        with self._lock:
            self._intervals = [(s, e) for s, e in self._intervals if e > a]
            running = [(self._since, b)] if self._since is not None else []
            return sum(max(0.0, min(e, b) - max(s, a)) for s, e in self._intervals + running)


@dataclass
class Published:
    """The newest policy the learner has put in the object store."""

    version: int
    payload: Any = None
    """ObjectRef of rank 0's ``WeightsPayload``; None for the initial weights every generator builds."""
    fingerprints: dict[str, Any] | None = None
    """Rank 0's fingerprints of those weights (the weight check after each generator's load)."""


@dataclass
class Batch:
    """One iteration's prompts and the generators' parts of its rollout."""

    prompts: PromptBatch
    parts: list[Rollout | None]
    """Each generator's part, None until it arrives."""

    def whole(self) -> Rollout:
        """The parts as one rollout, in generator order; only once every part has arrived."""
        missing = [g for g, part in enumerate(self.parts) if part is None]
        if missing:
            raise RuntimeError(f"batch scored before generators {missing} delivered their parts")
        return Rollout.concat([part for part in self.parts if part is not None])


@dataclass
class Stages:
    """One start of the pipeline. A restart makes a new one, so threads of a stopped start only
    ever write into their own."""

    first: int
    """The first batch (= the learner's version when it started)."""
    fleet: list[int] = field(default_factory=list)
    """The generators sampling (the fleet's active ones when it started), a thread each; batch
    parts and shares go by position in this list."""
    stop: threading.Event = field(default_factory=threading.Event)
    batches: dict[int, Batch] = field(default_factory=dict)
    prompt_states: dict[int, dict[str, int]] = field(default_factory=dict)
    """The sampler's position before each batch was drawn (what a checkpoint records)."""
    carry: list[Rollout] = field(default_factory=list)
    """Partial rollouts: each generator's rows not yet delivered (``rayppo/data/partial_rollouts.py``)."""
    carry_states: dict[int, list[Rollout]] = field(default_factory=dict)
    """Every generator's carry before its call for each batch (what a checkpoint records)."""
    to_score: queue.Queue[int] = field(default_factory=queue.Queue)
    scored: queue.Queue = field(default_factory=queue.Queue)
    """(batch, scored rollout, scoring seconds), bounded to k + 1 batches."""
    error: BaseException | None = None
    """A stage's first error, raised on the caller's thread."""
    lost_generator: bool = False
    """A generator left the fleet (before any error): the caller's thread starts the stages again
    over the generators left."""
    threads: list[threading.Thread] = field(default_factory=list)


class StoppedError(Exception):
    """Raised inside a stage thread when its start of the pipeline was stopped."""
