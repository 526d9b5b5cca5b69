"""Where an iteration's batch comes from: the variation point between the trainers' iterations.

    source.next(it)          a batch generated, filtered and scored   (its own stages: generate and
                             score, or wait for the pipeline's next scored batch)
    learn                    the trainer's update on it
    publisher.publish(v)     the policy of version v to the generators (sync and its check, or put
                             where the pipeline's generators take it); none in one process, where
                             the generator samples from the module the learner trains
    source.timings(seconds)  the iteration's ``StageTimes`` (``run/stage_times.py``)

A synchronous source samples each batch when asked; a pipelined one samples ahead in threads of
its own. The generators themselves (pausing them, bringing one up to date, restarting them after
a restore, growing their number) are the fleet's business (``cluster/fleet.py``), not a source's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from rayppo.data.prompts import PromptSampler
from rayppo.data.rollout import Rollout
from rayppo.run.stage_times import StageTimes
from rayppo.trainers.clock import Stage


@dataclass
class SourcedBatch:
    """One iteration's batch as a source hands it over."""

    rollout: Rollout
    """The rows to train on (generated, filtered, scored)."""
    source_metrics: dict[str, float] = field(default_factory=dict)
    """The source's own metrics of this batch (dynamic sampling, staleness); its seconds are ``timings``'."""
    reported: Rollout | None = None
    """The rows the metrics line describes when not ``rollout`` (every row dropped as too stale)."""


class BatchSource(Protocol):
    """What an iteration asks of the place its batches come from (module docstring)."""

    def next(self, iteration: int) -> SourcedBatch:
        """Batch ``iteration``: generated, filtered and scored."""
        ...

    def state(self, iteration: int) -> dict[str, Any]:
        """The source's part of the driver state before batch ``iteration`` (JSON)."""
        ...

    def load_state(self, state: dict[str, Any]) -> None:
        """Go on from ``state`` (a driver state, as ``state`` wrote its part)."""
        ...

    def timings(self, seconds: dict[Stage, float]) -> StageTimes:
        """The iteration's stage seconds, from its stages' ``seconds`` (``StageClock.seconds``)."""
        ...


class Publisher(Protocol):
    """Where the learner's policy goes after each update: the generators of another process."""

    def publish(self, version: int) -> dict[str, float]:
        """The learner's policy of ``version`` to the generators (checked); its metrics."""
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
        """The position before batch ``iteration`` (``BatchSource.state``)."""
        if self._before is not None and self._before[0] == iteration:
            return {"prompts": dict(self._before[1])}
        return {"prompts": self.prompts.state_dict()}

    def load_state(self, state: dict[str, Any]) -> None:
        """The sampler goes on from the saved position."""
        self._before = None
        self.prompts.load_state_dict(state["prompts"])
