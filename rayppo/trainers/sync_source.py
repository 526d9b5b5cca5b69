"""The synchronous rollout source (``rollout.max_staleness = 0``): each batch sampled when asked.

    generate   the fleet samples batch b with policy version b      (GeneratorActor x G, vLLM)
               dynamic sampling: informative groups, refilled       (``dynamic_sampling.py``)
    score      log pi_ref and r_phi at the same time                (ReferenceActor x R, RewardActor x W)
    ... the trainer learns ...
    sync       rank 0's weights of version b + 1 to every generator (``cluster/weight_sync.py``)
    verify     the guard's fingerprints of what each one holds      (``checks.verify_sync``)

Nothing runs between two calls, so ``paused`` has nothing to stop.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rayppo.config.schema import Config
from rayppo.data.prompts import PromptSampler
from rayppo.data.rollout import Rollout
from rayppo.data.seeds import rollout_seed
from rayppo.trainers.dynamic_sampling import fill_batch
from rayppo.trainers.role_calls import RoleCalls
from rayppo.trainers.source import Drawn, SamplerPosition, StageClock


class SynchronousSource:
    """Generate, dynamic sampling, score; sync and verify (module docstring)."""

    def __init__(self, cfg: Config, calls: RoleCalls, prompts: PromptSampler, clock: StageClock) -> None:
        self.cfg, self.calls, self.prompts, self.clock = cfg, calls, prompts, clock
        self.version = 0
        """The policy version every generator holds (the initial weights until the first sync)."""
        self.position = SamplerPosition(prompts)

    def next(self, iteration: int) -> Drawn:
        """Batch ``iteration``, sampled by the fleet now, its informative groups kept, scored."""
        self.position.drawing(iteration)
        with self.clock.stage("generate"):
            rollout = self.calls.generate(self.prompts.next_batch(), rollout_seed(self.cfg.seed, iteration))
            rollout, dynamic = self._dynamic_sampling(rollout, iteration)  # {} when off
        with self.clock.stage("score"):
            rollout, score_times = self.calls.score(rollout)
        return Drawn(rollout, {**score_times, **dynamic})

    def _dynamic_sampling(self, rollout: Rollout, it: int) -> tuple[Rollout, dict[str, float]]:
        """``rollout.dynamic_sampling_rounds`` > 0: the informative groups of this batch and of up
        to that many extra rewarded batches (``dynamic_sampling.fill_batch``); else as it is."""
        rounds = self.cfg.rollout.dynamic_sampling_rounds
        if not rounds:
            return rollout, {}

        def draw(k: int) -> Rollout:
            return self.calls.scored_by_reward(self.calls.generate(self.prompts.next_batch(),
                                                                   rollout_seed(self.cfg.seed, it, k)))

        return fill_batch(self.calls.scored_by_reward(rollout), draw, self.cfg.rollout.batch_size, rounds)

    def publish(self, version: int) -> dict[str, float]:
        """Every generator of the fleet takes ``version`` (sync), then proves it (verify)."""
        with self.clock.stage("sync"):
            sync_bytes = self.calls.weight_sync.sync(version)
        self.version = version
        with self.clock.stage("verify"):
            verified = self.calls.verify(version) if self.cfg.checks.verify_sync else 0.0
        return {"sync/bytes": float(sync_bytes), "sync/verified": float(verified)}

    @contextmanager
    def paused(self, current: bool = False) -> Iterator[None]:
        """Nothing samples between iterations, and every generator holds the published policy."""
        yield

    def bring_up_to_date(self, i: int) -> None:
        """Generator ``i`` (a replacement) takes the current weights, and its fingerprints are checked."""
        self.calls.weight_sync.refresh(i)
        if self.cfg.checks.verify_sync and self.version:  # before the first sync it holds what it built
            self.calls.verify(self.version, [i])

    def restart(self, version: int) -> None:
        """Every generator takes the restored ``version`` (sync, then check)."""
        schedule = self.calls.schedule
        schedule.wake_for_restore()  # colocated mode: a failure may have left vLLM asleep
        self.calls.weight_sync.sync(version)
        self.version = version
        if self.cfg.checks.verify_sync:
            self.calls.verify(version)
        schedule.wake_after_restore()

    def state(self, iteration: int) -> dict[str, Any]:
        """The sampler's position before batch ``iteration`` (drawn again on resume when it was not trained)."""
        return self.position.state(iteration)

    def load_state(self, state: dict[str, Any]) -> None:
        """The sampler goes on from the saved position."""
        self.position.load_state(state)

    def timings(self, seconds: dict[str, float]) -> dict[str, float]:
        """Each stage's seconds; the iteration's are their sum."""
        return {"time/generate": seconds["generate"], "time/score": seconds["score"], "time/learn": seconds["learn"],
                "time/sync": seconds["sync"] + seconds["verify"], "time/sync_verify": seconds["verify"],
                "time/iteration": sum(seconds.values())}

    def start(self) -> None:
        """Nothing runs on its own: each batch is sampled when asked."""

    def stop(self) -> None:
        """Nothing of its own to stop."""

    def close(self) -> None:
        """Nothing of its own to wait for."""
