"""The synchronous rollout source (``rollout.max_staleness = 0``): each batch sampled when asked.

    generate   the fleet samples batch b with policy version b      (GeneratorActor x G, vLLM)
               dynamic sampling: informative groups, refilled       (``dynamic_sampling.py``)
    score      log pi_ref and r_phi at the same time                (ReferenceActor x R, RewardActor x W)
    ... the trainer learns ...
    sync       rank 0's weights of version b + 1 to every generator (``cluster/weight_sync.py``)
    verify     the guard's fingerprints of what each one holds      (``checks.verify_sync``)

Nothing runs between two calls, so the fleet has nothing of it to pause. In colocated mode
(``cluster.colocate_all``, the only source that runs it) the stages hand the GPU over as
``cluster/colocation.py`` lays out: vLLM sleeps once it has generated, its weights come back for
the sync and its KV cache once the sync is checked.
"""

from __future__ import annotations

from typing import Any

from rayppo.config.schema import Config
from rayppo.data.prompts import PromptSampler
from rayppo.data.rollout import Rollout
from rayppo.data.seeds import rollout_seed
from rayppo.run.stage_times import ScoringSeconds, StageTimes
from rayppo.trainers.clock import Stage, StageClock
from rayppo.trainers.distributed_roles import DistributedRoles
from rayppo.trainers.dynamic_sampling import fill_batch
from rayppo.trainers.source import SamplerPosition, SourcedBatch


class SynchronousSource:
    """Generate, dynamic sampling, score; sync and verify (module docstring). It also keeps the
    fleet's generators on the learner's policy (``cluster/fleet.py``'s ``PolicyKeeper``)."""

    def __init__(self, cfg: Config, calls: DistributedRoles, prompts: PromptSampler, clock: StageClock) -> None:
        self.cfg, self.calls, self.prompts, self.clock = cfg, calls, prompts, clock
        self.schedule = calls.schedule
        self.version = 0
        """The policy version every generator holds (the initial weights until the first sync)."""
        self.position = SamplerPosition(prompts)
        self._scoring = ScoringSeconds(0.0, 0.0)  # the scoring passes of the batch drawn last

    def next(self, iteration: int) -> SourcedBatch:
        """Batch ``iteration``, sampled by the fleet now, its informative groups kept, scored."""
        self.position.drawing(iteration)
        with self.clock.stage(Stage.GENERATE):
            rollout = self.calls.generate(self.prompts.next_batch(), rollout_seed(self.cfg.seed, iteration))
            rollout, dynamic = self._dynamic_sampling(rollout, iteration)  # {} when off
            self.schedule.record(Stage.GENERATE)
            self.schedule.sleep_generators()  # colocated: scoring and learning get the GPU memory
        with self.clock.stage(Stage.SCORE):
            rollout, self._scoring = self.calls.score(rollout)
            self.schedule.record(Stage.SCORE)
        return SourcedBatch(rollout, dynamic)

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
        with self.clock.stage(Stage.SYNC):
            self.schedule.wake_weights()  # colocated: the sync writes into vLLM's weights
            sync_bytes = self.calls.weight_sync.sync(version)
            self.schedule.record(Stage.SYNC)
        self.version = version
        with self.clock.stage(Stage.VERIFY):
            verified = self.calls.verify(version) if self.cfg.checks.verify_sync else 0.0
            self.schedule.wake_kv_cache()  # colocated: the next generation's KV cache
        return {"sync/bytes": float(sync_bytes), "sync/verified": float(verified)}

    def bring_up_to_date(self, i: int) -> None:
        """Generator ``i`` (a replacement) takes the current weights, and its fingerprints are checked."""
        self.calls.weight_sync.refresh(i)
        if self.cfg.checks.verify_sync and self.version:  # before the first sync it holds what it built
            self.calls.verify(self.version, [i])

    def restart(self, version: int) -> None:
        """Every generator takes the restored ``version`` (sync, then check)."""
        self.schedule.wake_for_restore()  # colocated mode: a failure may have left vLLM asleep
        self.calls.weight_sync.sync(version)
        self.version = version
        if self.cfg.checks.verify_sync:
            self.calls.verify(version)
        self.schedule.wake_after_restore()

    def state(self, iteration: int) -> dict[str, Any]:
        """The sampler's position before batch ``iteration`` (drawn again on resume when it was not trained)."""
        return self.position.state(iteration)

    def load_state(self, state: dict[str, Any]) -> None:
        """The sampler goes on from the saved position."""
        self.position.load_state(state)

    def timings(self, seconds: dict[Stage, float]) -> StageTimes:
        """Each stage's seconds; the sync's include its check; the iteration's are their sum."""
        return StageTimes(generate=seconds[Stage.GENERATE], reference=self._scoring.reference,
                          reward=self._scoring.reward, teacher=self._scoring.teacher, learn=seconds[Stage.LEARN],
                          sync=seconds[Stage.SYNC] + seconds[Stage.VERIFY], iteration=sum(seconds.values()),
                          score=seconds[Stage.SCORE], sync_verify=seconds[Stage.VERIFY])
