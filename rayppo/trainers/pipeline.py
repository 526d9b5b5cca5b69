"""The pipelined rollout source (``rollout.max_staleness = k >= 1``): generation overlaps learning.

    generator g   (a thread each)    its share of batch b, with the newest weights it holds; it
                                     waits until b <= learner version + k and loads newer weights
                                     between its batches (no global stop)
    scoring       (one thread)       log pi_ref and r_phi of each complete batch, in order
    scored queue  (at most k + 1)    batches waiting for the learner
    learner       (caller's thread)  batch v at version v: rows older than k versions dropped and
                                     counted, decoupled PPO with V-trace targets (the learner's
                                     ``rayppo/learner/experience.py``, ``update.py``), then v + 1 published

Batch b is trained when the learner holds version b, so a row sampled with version w is b - w
versions stale: at most k by the waiting rule, and recorded per row (``policy_version``). Every
learner call stays on the caller's thread, since ranks must receive collective calls in one
order; the stage threads call only their own actors (a replaced generator takes the published
weights, not a new gather). A stage thread's error stops the run from the caller's thread; a
generator that leaves the fleet marks its start of the stages (``Stages.lost_generator``), and the
caller's thread starts them again over the generators left. The trainer's iteration is the
synchronous one's (``loop.py``): only this source differs (``source.py``).

Checkpoints record the learner (as with the synchronous source) and the prompt sampler's position
*before the next batch to train*; the batches in flight are not saved. After ``--resume`` (or a
learner restart) they are drawn again from the same prompts and sampled with the restored
weights, so nothing is lost or trained twice.

Partial rollouts (``rollout.partial_tokens = n > 0``): a generator samples at most ``n`` tokens
per call; responses still running are carried to its next call and continued with the weights it
then holds, each token recording its version (``token_versions``). A row joins a batch once every
row of its group has finished; the staleness rule then applies to a row's *oldest* token. The
rows in flight at a checkpoint (``carry_states``) are saved with it, so ``--resume`` continues
them rather than drawing their prompts again.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rayppo.actors.generator import GeneratorEngine
from rayppo.config.schema import Config
from rayppo.data.partial_rollouts import (
    carried_by,
    carry_from_json,
    carry_to_json,
    renumber_groups,
    split_finished_groups,
    unfinished,
    with_unique_groups,
)
from rayppo.data.prompts import PromptBatch, PromptSampler
from rayppo.data.rollout import Rollout
from rayppo.data.seeds import rollout_seed
from rayppo.errors import GeneratorLostError
from rayppo.run.stage_times import ScoringSeconds, StageTimes
from rayppo.trainers.clock import Stage, StageClock
from rayppo.trainers.distributed_roles import DistributedRoles
from rayppo.trainers.iteration import group_shares
from rayppo.trainers.pipeline_stages import POLL_S, Batch, BusyClock, Published, Stages, StoppedError
from rayppo.trainers.pipeline_weights import GeneratorWeights
from rayppo.trainers.source import SourcedBatch
from rayppo.trainers.staleness import drop_stale, generator_lead, staleness_stats

log = logging.getLogger(__name__)

CLOSE_JOIN_S = 60.0
"""How long ``close`` waits for each stage thread once the actors are killed (their calls fail at once)."""


class PipelinedSource:
    """Generation and scoring in threads of their own, ahead of the learner (module docstring).
    For the fleet (``cluster/fleet.py``) it is what samples ahead (``SamplesAhead``: paused while
    another caller needs the generators) and what keeps them on the published policy (``PolicyKeeper``)."""

    def __init__(self, cfg: Config, calls: DistributedRoles, prompts: PromptSampler, clock: StageClock) -> None:
        self.cfg, self.calls, self.prompts, self.clock = cfg, calls, prompts, clock
        self.k = cfg.rollout.max_staleness
        self.partial = cfg.rollout.partial_tokens
        self.batches_ahead = generator_lead(self.k, self.partial, cfg.rollout.max_new_tokens)
        # A partial-rollout call goes on with its unfinished rows until the batch can be trained:
        # every rank needs rows in each minibatch.
        self._rows_needed = cfg.ppo.minibatches * cfg.learner.num_ranks
        self._cond = threading.Condition()
        self.weights = GeneratorWeights(calls, cfg.checks.verify_sync, self._cond)
        # Per generator (the fleet may grow): its busy time.
        self._clocks: defaultdict[int, BusyClock] = defaultdict(BusyClock)
        self._scoring_clock = BusyClock()
        self._stages: Stages | None = None
        """The running start of the pipeline (None until the first ``start``)."""
        self._resume_carry: list[Rollout] | None = None  # the carries a restore goes on with
        self._iteration = 0  # the batch the learner trains now
        self._scoring = ScoringSeconds(0.0, 0.0)  # the scoring passes of the batch trained now
        self._last_return = self._t_data = self._t_end = time.perf_counter()

    # ----------------------------------------------------------------------------- the learner's side
    def next(self, iteration: int) -> SourcedBatch:
        """Batch ``iteration`` once it is scored, rows older than k versions dropped (and counted)."""
        with self.clock.stage(Stage.WAIT):
            index, rollout, self._scoring, depth = self._next_scored()
        assert index == iteration, f"pipeline delivered batch {index} for iteration {iteration}"
        self._iteration, self._t_data = iteration, time.perf_counter()
        version = self.weights.published.version  # the learner's: it publishes after every update
        staleness = staleness_stats(rollout, version)
        kept, dropped = drop_stale(rollout, version, self.k)
        figures = {**staleness, "async/dropped_rows": float(dropped), "async/queue_depth": float(depth)}
        # Every row dropped: the metrics line shows the batch's figures as generated.
        return SourcedBatch(kept, figures, reported=kept if len(kept) else rollout)

    def _next_scored(self) -> tuple[int, Rollout, ScoringSeconds, int]:
        """The next scored batch and how many more wait behind it; raises a stage's error. A
        generator that left the fleet restarts the stages over the generators left, which draw the
        batches in flight again."""
        stages = self._running
        while True:
            if stages.lost_generator:
                self._halt_stages()
                self._start_stages()
                stages = self._running
            with self.calls.learner.failures():  # rank 0's death can surface in a generator loading its weights
                if stages.error is not None:
                    raise stages.error
            try:
                index, rollout, times = stages.scored.get(timeout=POLL_S)
                return index, rollout, times, stages.scored.qsize()
            except queue.Empty:
                continue

    def publish(self, version: int) -> dict[str, float]:
        """``version`` to where the generators take it; the trained batch's records let go. Its
        figures: the payload, the check, and the rows the generators carry on with (partial rollouts)."""
        with self.clock.stage(Stage.SYNC):
            self.weights.publish(version)
        self._t_end = time.perf_counter()
        with self._cond:
            for records in (self._running.batches, self._running.prompt_states, self._running.carry_states):
                records.pop(self._iteration, None)
        return {"sync/bytes": float(self.weights.payload_bytes(len(self._running.fleet))),
                "sync/verified": self.weights.verified(),
                "async/carried_rows": float(sum(len(c) for c in self._running.carry))}

    def timings(self, seconds: dict[Stage, float]) -> StageTimes:
        """The iteration's wall time runs from the previous one's return (the stages never stop);
        generate and score are their threads' busy seconds within it."""
        t0, t_end = self._last_return, self._t_end
        self._last_return = t_end
        sampling = self._running.fleet
        generate = sum(self._clocks[g].busy(t0, t_end) for g in sampling) / len(sampling)
        return StageTimes(generate=generate, reference=self._scoring.reference, reward=self._scoring.reward,
                          teacher=self._scoring.teacher, learn=seconds[Stage.LEARN], sync=seconds[Stage.SYNC], iteration=t_end - t0,
                          score=self._scoring_clock.busy(t0, t_end), wait_for_data=self._t_data - t0,
                          # Each generator checks its own loads, inside its busy time (time/generate).
                          sync_verify=0.0)

    # ------------------------------------------------------------------- pauses, restores, state
    def start(self) -> None:
        """Start the stage threads (the first time; ``paused`` starts them again after)."""
        self._start_stages()

    @contextmanager
    def paused(self, current: bool = False) -> Iterator[None]:
        """The stage threads stopped inside (one owner per actor at a time: a generator or reward
        actor dying under both would be replaced twice, or its death raised as a foreign one), and
        the prompt sampler moved back to the next batch to train: the batches in flight are drawn
        again afterwards from the same prompts. With ``current`` every generator of the fleet
        first loads the published weights. Started again on the way out, unless what ran inside
        failed (the run stops; a learner restart starts them itself)."""
        self._halt_stages()
        if current:
            for g in self.calls.fleet.active:
                self.weights.catch_up(g)
        yield
        self._start_stages()

    def bring_up_to_date(self, i: int) -> None:
        """Replacement generator ``i`` (built with the initial weights) takes the published ones."""
        self.weights.built(i)
        self.weights.catch_up(i)

    def restart(self, version: int) -> None:
        """The restored weights are published; every generator loads them (and is checked)
        before its first batch."""
        self.weights.publish(version)
        self.weights.forget_held()

    def state(self, iteration: int) -> dict[str, Any]:
        """The sampler's position before batch ``iteration`` (batches in flight are drawn again
        on resume) and, with partial rollouts, the rows in flight between calls (none is lost or
        sampled twice)."""
        if self._stages is None:
            return {"prompts": self.prompts.state_dict()}
        with self._cond:
            prompts = self._running.prompt_states.get(iteration) or self.prompts.state_dict()
            carry = self._running.carry_states.get(iteration) or self._running.carry
        partial_rows = {"partial_rows": carry_to_json(carry)} if self.partial else {}
        return {"prompts": dict(prompts), **partial_rows}

    def load_state(self, state: dict[str, Any]) -> None:
        """The sampler's position and the carries the next start goes on with (inside ``paused``)."""
        self.prompts.load_state_dict(state["prompts"])
        if self.partial:
            self._resume_carry = carry_from_json(state.get("partial_rows"), len(self.calls.generators))

    def close(self) -> None:
        """Stop the stage threads (their actors are killed first: ``stop`` then ``join``)."""
        self._stop_stages(timeout_s=CLOSE_JOIN_S)

    def stop(self) -> None:
        """Tell the stages to stop, without waiting: the errors of actors killed next end them quietly."""
        if self._stages is not None:
            self._running.stop.set()

    # ------------------------------------------------------------------------------ the stages
    @property
    def _running(self) -> Stages:
        """The current start of the stages (``start`` made one; a restart replaces it)."""
        if self._stages is None:
            raise RuntimeError("the pipeline's stages were never started (PipelinedSource.start)")
        return self._stages

    def _start_stages(self) -> None:
        """Start the stage threads at the next batch to train, the generators' carries what a
        restore loaded or else what they were before that batch (or empty)."""
        first = self._next_batch()
        old = self._running.carry_states.get(first) if self._stages else None
        carry = list(self._resume_carry or old or [])
        self._resume_carry = None
        carry += [Rollout.concat([]) for _ in range(len(self.calls.generators) - len(carry))]  # the fleet may have grown
        fleet = list(self.calls.fleet.active)
        carry = carried_by(carry, fleet)
        self._stages = stages = Stages(first=first, fleet=fleet, scored=queue.Queue(maxsize=self.k + 1),
                                       carry=list(carry), carry_states={first: list(carry)})
        workers = [threading.Thread(target=self._guarded, args=(stages, self._generate_loop, g), daemon=True,
                                    name=f"rayppo-generator-{g}") for g in fleet]
        workers.append(threading.Thread(target=self._guarded, args=(stages, self._score_loop), daemon=True,
                                        name="rayppo-scoring"))
        stages.threads = workers
        self._last_return = time.perf_counter()
        for thread in workers:
            thread.start()

    def _next_batch(self) -> int:
        """The batch the learner trains next: its version (it publishes after every update)."""
        return self.weights.published.version

    def _halt_stages(self) -> None:
        """Stop the stages and move the prompt sampler back to the next batch to train: the
        batches in flight are drawn again by the next start."""
        self._stop_stages()
        with self._cond:
            position = self._running.prompt_states.get(self._next_batch()) if self._stages else None
        if position is not None:
            self.prompts.load_state_dict(position)

    def _stop_stages(self, timeout_s: float | None = None) -> None:
        """Stop the stage threads and wait for them (each finishes at most the call it is in)."""
        stages = self._stages
        if stages is None:
            return
        with self._cond:
            stages.stop.set()
            self._cond.notify_all()
        for thread in stages.threads:
            thread.join(timeout_s)
            if thread.is_alive():
                log.warning("%s still running %.0f s after the pipeline was stopped", thread.name, timeout_s)

    def _guarded(self, stages: Stages, loop: Callable[..., None], *args: Any) -> None:
        """Run a stage loop; its first error (while running) is raised on the caller's thread, a
        generator leaving the fleet is noted for the caller's thread to start the stages again."""
        try:
            loop(stages, *args)
        except StoppedError:
            pass
        except GeneratorLostError:  # the caller's thread starts the stages again over the generators left
            if not stages.stop.is_set() and stages.error is None:
                stages.lost_generator = True
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            if not stages.stop.is_set() and stages.error is None:
                stages.error = exc

    def _generate_loop(self, stages: Stages, g: int) -> None:
        """Generator g: its share of batches first, first + 1, ... within the staleness window."""
        b, position = stages.first, stages.fleet.index(g)  # its share's place in each batch
        while True:
            published = self._wait_for_window(stages, b)
            batch = self._batch(stages, b)
            self._clocks[g].start()
            try:
                self.weights.catch_up(g, published)
                shares = group_shares(batch.prompts, len(stages.fleet), self.cfg.rollout.samples_per_prompt)
                part = self._sample_share(stages, g, b, shares[position])
            finally:
                self._clocks[g].stop()
            with self._cond:
                batch.parts[position] = part
                if all(p is not None for p in batch.parts):
                    stages.to_score.put(b)
            b += 1

    def _sample_share(self, stages: Stages, g: int, b: int, share: PromptBatch) -> Rollout:
        """Generator g's part of batch b: its share sampled whole, or with partial rollouts the
        groups finished by its calls (the carry continued, the share started). Call k of batch b
        samples with ``rollout_seed(seed, b, k)``: a carried row continues under another seed in
        each call, never under the one that drew its earlier tokens."""
        seed = rollout_seed(self.cfg.seed, b)
        if not self.partial:
            return self.calls.on_generator(g, GeneratorEngine.generate, (share, seed), self.weights.refresh)
        share.groups = with_unique_groups(share.groups, b, self.cfg.rollout.batch_size)
        waiting, round_ = stages.carry[g], 0
        while True:  # a round: every unfinished row gets up to partial_tokens more
            todo = unfinished(waiting)
            done = sorted(set(range(len(waiting))) - set(todo))
            out = self.calls.on_generator(g, GeneratorEngine.generate_partial,
                                          (share, waiting.select(todo), seed, self.partial), self.weights.refresh)
            ready, waiting = split_finished_groups(Rollout.concat([waiting.select(done), out]))
            if len(ready) >= -(-self._rows_needed // len(stages.fleet)) or not unfinished(waiting):
                break
            waiting = Rollout.concat([ready, waiting])  # too few to train: another round, no new prompts
            round_ += 1
            share, seed = share.select([]), rollout_seed(self.cfg.seed, b, round_)
        with self._cond:
            stages.carry[g] = waiting
            stages.carry_states.setdefault(b + 1, list(stages.carry))[g] = waiting
        return ready

    def _wait_for_window(self, stages: Stages, b: int) -> Published:
        """Block until batch b may be sampled (b <= published version + lead); the newest weights."""
        with self._cond:
            while b > self.weights.published.version + self.batches_ahead:
                if stages.stop.is_set():
                    raise StoppedError
                self._cond.wait(POLL_S)
            if stages.stop.is_set():
                raise StoppedError
            return self.weights.published

    def _batch(self, stages: Stages, b: int) -> Batch:
        """Batch b's prompts, drawn (in order) by the first generator to reach it."""
        with self._cond:
            if stages.stop.is_set():  # a restart is about to move the sampler: draw nothing more
                raise StoppedError
            if b not in stages.batches:
                stages.prompt_states[b] = self.prompts.state_dict()
                stages.batches[b] = Batch(self.prompts.next_batch(), [None] * len(stages.fleet))
            return stages.batches[b]

    def _score_loop(self, stages: Stages) -> None:
        """Score each complete batch (reference and reward at the same time), in order."""
        while True:
            try:
                b = stages.to_score.get(timeout=POLL_S)
            except queue.Empty:
                if stages.stop.is_set():
                    raise StoppedError from None
                continue
            self._scoring_clock.start()
            try:
                parts = stages.batches[b].whole()
                rollout, times = self.calls.score(renumber_groups(parts) if self.partial else parts)
            finally:
                self._scoring_clock.stop()
            while True:  # the queue is bounded: wait for the learner
                try:
                    stages.scored.put((b, rollout, times), timeout=POLL_S)
                    break
                except queue.Full:
                    if stages.stop.is_set():
                        raise StoppedError from None

