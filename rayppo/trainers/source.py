"""Where an iteration's batch comes from: the variation point between the trainers' iterations.

    source.next(it)        a batch generated, filtered and scored   (its own stages: generate and
                           score, or wait for the pipeline's next scored batch)
    learn                  the trainer's update on it
    source.publish(v)      the policy of version v to the generators (sync and its check, or
                           put where the pipeline's generators take it)

A synchronous source samples each batch when asked; a pipelined one samples ahead in threads of
its own. Anything that needs the generators to itself (evaluation, a generator rejoining the
fleet, a restore) runs inside ``source.paused()``. ``StageClock`` times the stages and names the
one the driver waits on (``phase``), whoever runs it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from rayppo.data.prompts import PromptSampler
from rayppo.data.rollout import Rollout

if TYPE_CHECKING:  # the clock only calls it: the in-process trainer never imports Ray
    from rayppo.cluster.colocation import DeviceSchedule

PHASES = ("starting", "generate", "score", "wait", "learn", "sync", "verify", "evaluate", "checkpoint", "restore",
          "idle")
"""What the driver waits on (``StageClock.phase``); the pipelined source waits (``wait``) for a
scored batch while its threads generate and score."""


@dataclass
class Drawn:
    """One iteration's batch as a source hands it over."""

    rollout: Rollout
    """The rows to train on (generated, filtered, scored)."""
    figures: dict[str, float] = field(default_factory=dict)
    """The source's own metrics of this batch (scoring seconds, dynamic sampling, staleness)."""
    shown: Rollout | None = None
    """The rows the metrics line describes when not ``rollout`` (every row dropped as too stale)."""


class RolloutSource(Protocol):
    """What an iteration asks of the place its batches come from (module docstring)."""

    def start(self) -> None:
        """Begin what the source runs on its own (the pipeline's threads), once the roles are up."""
        ...

    def next(self, iteration: int) -> Drawn:
        """Batch ``iteration``: generated, filtered and scored."""
        ...

    def publish(self, version: int) -> dict[str, float]:
        """The learner's policy of ``version`` to the generators (checked); its metrics."""
        ...

    def paused(self, current: bool = False) -> AbstractContextManager[None]:
        """The generators to the caller alone inside (holding the published policy with ``current``)."""
        ...

    def bring_up_to_date(self, i: int) -> None:
        """Generator ``i`` (a replacement, or one joining the fleet) takes the published policy."""
        ...

    def restart(self, version: int) -> None:
        """After a restore (inside ``paused``): every generator takes the learner's ``version``."""
        ...

    def state(self, iteration: int) -> dict[str, Any]:
        """The source's part of the driver state before batch ``iteration`` (JSON)."""
        ...

    def load_state(self, state: dict[str, Any]) -> None:
        """Go on from ``state`` (a driver state, as ``state`` wrote its part)."""
        ...

    def timings(self, seconds: dict[str, float]) -> dict[str, float]:
        """The iteration's ``time/*`` figures from its stages' ``seconds`` (``StageClock.seconds``)."""
        ...

    def stop(self) -> None:
        """Tell what the source runs on its own to stop, without waiting (the run is closing)."""
        ...

    def close(self) -> None:
        """Stop what the source runs on its own and wait for it; its actors are the trainer's."""
        ...


class SamplerPosition:
    """The prompt sampler's position before the batch being drawn, for a source that samples when
    asked: a checkpoint taken with that batch untrained (a reward error, the guard before its
    update) records the position before it, so the batch is drawn again on resume."""

    def __init__(self, prompts: PromptSampler) -> None:
        self.prompts = prompts
        self._before: tuple[int, dict[str, int]] | None = None  # (batch, the position before it)

    def drawing(self, iteration: int) -> None:
        """Batch ``iteration`` is about to be drawn."""
        self._before = (iteration, self.prompts.state_dict())

    def state(self, iteration: int) -> dict[str, Any]:
        """The position before batch ``iteration`` (``RolloutSource.state``)."""
        if self._before is not None and self._before[0] == iteration:
            return {"prompts": dict(self._before[1])}
        return {"prompts": self.prompts.state_dict()}

    def load_state(self, state: dict[str, Any]) -> None:
        """The sampler goes on from the saved position."""
        self._before = None
        self.prompts.load_state_dict(state["prompts"])


class StageClock:
    """The stages of one iteration: their wall seconds, the one running now (``phase``), and the
    colocated schedule that frees or takes back the GPU around each (``DeviceSchedule``)."""

    def __init__(self, schedule: DeviceSchedule | None = None) -> None:
        self.schedule = schedule
        self.phase = "starting"
        self.seconds: dict[str, float] = {}
        """Stage -> wall seconds, of the iteration begun last (``begin``)."""

    def begin(self) -> None:
        """A new iteration: no stage timed yet."""
        self.seconds = {}

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """One stage: ``phase`` names it while it runs; its seconds go to ``seconds[name]``. A
        stage that fails leaves ``phase`` on it (the fault matrix reads where a failure landed)."""
        self.phase, start = name, time.perf_counter()
        if self.schedule is not None:
            self.schedule.before(name)
        yield
        if self.schedule is not None:
            self.schedule.after(name)
        self.seconds[name] = time.perf_counter() - start
        self.phase = "idle"

    @contextmanager
    def during(self, name: str) -> Iterator[None]:
        """Work between iterations (evaluation, checkpoint, restore): named, not timed."""
        self.phase = name
        try:
            yield
        finally:
            self.phase = "idle"
