"""An iteration's seconds, stage by stage, as one typed record: the ``time/*`` figures of its
metrics line and the seconds ``perf/*`` divides each stage's FLOPs by (``run/mfu.py``).

    source.next        generate (and dynamic sampling)   score: reference | reward at once
    learn              the learner's update
    publish            sync, and its check (verify)

Each rollout source fills the record from what it measured (``StageClock``'s stages, the scoring
passes' seconds, the pipeline's busy clocks); readers take its fields, and the figures' names are
made here alone (``StageTimes.metrics``), where the metrics line is put together.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ScoringSeconds:
    """The scoring passes of one batch, each on its own actors (they run at the same time)."""

    reference: float
    """log pi_ref of the rows; 0 when no reference runs (``ppo.kl_coef = 0``)."""
    reward: float
    """r_phi of the rows; 0 when dynamic sampling rewarded them already, or an environment's turn
    rewards are the whole reward."""
    teacher: float | None = None
    """log pi_T of the rows (on-policy distillation); None without a teacher."""


@dataclass(frozen=True)
class StageTimes:
    """One iteration's wall seconds by stage (docs/algorithm.md, "Metrics"). A figure the source
    does not measure is None and stays out of the metrics line."""

    generate: float
    """``time/generate``: sampling the batch, dynamic sampling's extra batches included; pipelined,
    the generators' mean busy seconds within the iteration."""
    reference: float
    """``time/reference``: the log pi_ref pass (``ScoringSeconds.reference``, or the in-process stage)."""
    reward: float
    """``time/reward``: the r_phi pass, gold scores included (``ScoringSeconds.reward``, or the in-process stage)."""
    learn: float
    """``time/learn``: the learner's update, from the scored batch to the updated policy."""
    sync: float
    """``time/sync``: the policy to the generators, with its check; 0 in one process (the generator
    samples from the module the learner trains)."""
    iteration: float
    """``time/iteration``: the iteration's wall seconds: its stages' sum, or pipelined (the stages
    never stop) from the previous iteration's end to this one's."""
    score: float | None = None
    """``time/score``: the reference and reward passes together, at the same time on their own
    actors; None in one process, where each is a stage of its own."""
    sync_verify: float | None = None
    """``time/sync_verify``: the check alone (inside ``sync``); 0 pipelined, where each generator
    checks its own loads inside its busy time; None in one process."""
    teacher: float | None = None
    """``time/teacher``: the log pi_T pass (``ScoringSeconds.teacher``, or the in-process stage); None
    without a teacher."""
    wait_for_data: float | None = None
    """``time/wait_for_data``: pipelined, the learner waiting for its scored batch; None when the
    stages take turns (``overlapped`` is false)."""

    @property
    def overlapped(self) -> bool:
        """Whether generation and scoring ran beside the learner (the pipelined source)."""
        return self.wait_for_data is not None

    def metrics(self) -> dict[str, float]:
        """The ``time/*`` figures of the metrics line; an overlapped iteration's also say how idle
        each side was (``async/generator_idle``, ``async/learner_idle``: shares of its wall time)."""
        optional = {"time/teacher": self.teacher, "time/score": self.score, "time/wait_for_data": self.wait_for_data,
                    "time/sync_verify": self.sync_verify}
        figures = {"time/generate": self.generate, "time/reference": self.reference, "time/reward": self.reward,
                   "time/learn": self.learn, "time/sync": self.sync,
                   **{name: seconds for name, seconds in optional.items() if seconds is not None},
                   "time/iteration": self.iteration}
        if self.overlapped:
            figures["async/generator_idle"] = max(0.0, 1 - self.generate / self.iteration)
            figures["async/learner_idle"] = 1 - self.learn / self.iteration
        return figures
