"""The asynchronous pipeline (``rollout.max_staleness = k >= 1``): generation overlaps learning.

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
weights, not a new gather). A stage thread's error stops the run from the caller's thread.

Checkpoints record the learner (as in the synchronous trainer) and the prompt sampler's position
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
from collections import defaultdict
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rayppo.actors.generator import GeneratorEngine
from rayppo.cluster.group import get, get_within
from rayppo.config.schema import Config
from rayppo.data.partial_rollouts import (carried_by, carry_from_json, carry_to_json, renumber_groups,
                                          split_finished_groups, unfinished, with_unique_groups)
from rayppo.data.prompts import PromptBatch
from rayppo.data.rollout import Rollout
from rayppo.errors import GeneratorLostError, LearnerFailedError
from rayppo.learner.guard import check_weights
from rayppo.trainers.distributed import DistributedTrainer
from rayppo.data.seeds import rollout_seed
from rayppo.trainers.iteration import group_shares, rollout_stats
from rayppo.trainers.staleness import drop_stale, generator_lead, staleness_stats

log = logging.getLogger(__name__)

POLL_S = 0.2
"""How often a waiting thread looks at the stop flag and the stages' errors."""
CLOSE_JOIN_S = 60.0
"""How long ``close`` waits for each stage thread once the actors are killed (their calls fail at once)."""


class BusyClock:
    """When one worker (a generator, the scorers) was busy: ``busy(a, b)``, seconds within [a, b]."""

    def __init__(self) -> None:
        self._intervals: list[tuple[float, float]] = []
        self._since: float | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        with self._lock:
            self._since = time.perf_counter()

    def stop(self) -> None:
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
    to_score: "queue.Queue[int]" = field(default_factory=queue.Queue)
    scored: queue.Queue = field(default_factory=queue.Queue)
    """(batch, scored rollout, scoring seconds), bounded to k + 1 batches."""
    error: BaseException | None = None
    threads: list[threading.Thread] = field(default_factory=list)


class _StoppedError(Exception):
    """Raised inside a stage thread when its start of the pipeline was stopped."""


class PipelinedTrainer(DistributedTrainer):
    """The distributed trainer with generation, scoring and learning overlapped (module docstring)."""

    _stages: Stages | None = None
    """The running start of the pipeline (None until the first ``_start_stages``)."""

    def __init__(self, cfg: Config):
        self.k = cfg.rollout.max_staleness
        self.partial = cfg.rollout.partial_tokens
        self.lead = generator_lead(self.k, self.partial, cfg.rollout.max_new_tokens)
        # A partial-rollout call goes on with its unfinished rows until the batch can be trained:
        # every rank needs rows in each minibatch.
        self._rows_needed = cfg.ppo.minibatches * cfg.learner.num_ranks
        self._cond = threading.Condition()
        self._payload_nbytes: int | None = None
        super().__init__(cfg)
        try:
            self._published = Published(0)
            # Per generator (the fleet may grow): the version it holds (it built the initial weights), its busy time.
            self._held: defaultdict[int, int] = defaultdict(int)
            self._clocks: defaultdict[int, BusyClock] = defaultdict(BusyClock)
            self._scoring_clock = BusyClock()
            self._unverified = False
            self._start_stages()
        except BaseException:
            self.close()
            raise

    # ----------------------------------------------------------------------------- the learner
    def iteration(self) -> dict[str, float]:
        """Train on batch v (v = the learner's version) once it is scored; publish v + 1."""
        it, clock, t0 = self.iteration_count, time.perf_counter, self._last_return
        self._regrow()
        self.phase = "wait"
        index, rollout, score_times, depth = self._next_scored()
        assert index == it, f"pipeline delivered batch {index} for iteration {it}"
        t_data = clock()
        version = self._published.version  # the learner's: it publishes after every update
        staleness = staleness_stats(rollout, version)
        scored = rollout
        rollout, dropped = drop_stale(rollout, version, self.k)
        kl_coef = self.kl_ctl.value
        with self.learner.failures():  # a dead or hung rank: LearnerFailedError, then recover()
            self.phase = "learn"
            update = self._learn(rollout, kl_coef, it)  # from its return a checkpoint holds this iteration
            t_learn = clock()
            self.phase = "sync"
            self._publish(update.version)
        t_end = clock()
        self.phase = "idle"
        with self._cond:
            self._stages.batches.pop(it, None)
            self._stages.prompt_states.pop(it, None)
            self._stages.carry_states.pop(it, None)
        self.supervisor.progress()
        self._last_return = t_end
        wall = t_end - t0
        sampling = self._stages.fleet
        generate = sum(self._clocks[g].busy(t0, t_end) for g in sampling) / len(sampling)
        timings = {"time/generate": generate, **score_times, "time/score": self._scoring_clock.busy(t0, t_end),
                   "time/wait_for_data": t_data - t0, "time/learn": t_learn - t_data, "time/sync": t_end - t_learn,
                   # Each generator checks its own loads, inside its busy time (time/generate).
                   "time/sync_verify": 0.0, "time/iteration": wall, "sync/bytes": float(self._payload_bytes()),
                   "sync/verified": self._verified(),
                   "async/generator_idle": max(0.0, 1 - generate / wall), "async/learner_idle": 1 - (t_learn - t_data) / wall,
                   "async/dropped_rows": float(dropped), "async/queue_depth": float(depth),
                   "async/carried_rows": float(sum(len(c) for c in self._stages.carry)),
                   "faults/actor_restarts": float(self.supervisor.restarts),
                   "faults/learner_restarts": float(self.learner_restarts)}
        shown = rollout if len(rollout) else scored  # every row dropped: the batch's figures as generated
        return {**update.metrics, **rollout_stats(shown, wall, self.cfg.rollout.max_turns), **timings, **staleness,
                **self.fleet.metrics(), "kl_coef": kl_coef}

    def _next_scored(self) -> tuple[int, Rollout, dict[str, float], int]:
        """The next scored batch and how many more wait behind it; raises a stage's error. A
        generator that left the fleet restarts the stages over the generators left, which draw the
        batches in flight again."""
        stages = self._stages
        while True:
            if isinstance(stages.error, GeneratorLostError):
                self._halt_stages()
                self._start_stages()
                stages = self._stages
            with self.learner.failures():  # rank 0's death can surface in a generator loading its weights
                if stages.error is not None:
                    raise stages.error
            try:
                index, rollout, times = stages.scored.get(timeout=POLL_S)
                return index, rollout, times, stages.scored.qsize()
            except queue.Empty:
                continue

    def _publish(self, version: int) -> None:
        """Rank 0's weights of ``version`` into the object store; waiting generators may go on."""
        payload = self.learner.policy_weights()
        prints = self.learner.sent_fingerprints() if self.cfg.checks.verify_sync else None
        if self._payload_nbytes is None:  # the size never changes: read the payload once
            self._payload_nbytes = get(payload).nbytes
        with self._cond:
            self._published = Published(version, payload, prints)
            self._cond.notify_all()

    def _verified(self) -> float:
        """``sync/verified``: 1.0 when every generator's loads were checked (a failed check stops
        the run), NaN when some generator cannot be fingerprinted, 0.0 with the check off."""
        if not self.cfg.checks.verify_sync:
            return 0.0
        return float("nan") if self._unverified else 1.0

    def _payload_bytes(self) -> int:
        """Bytes of one copy of the weights times the generators (as ``sync/bytes`` counts them)."""
        return (self._payload_nbytes or 0) * len(self._stages.fleet)

    def _regrow(self) -> None:
        """Generators placed again since they left the fleet load the published weights (checked)
        and rejoin; the stages restart with them (the batches in flight are drawn again)."""
        self.fleet.iteration = self.iteration_count
        back = self.fleet.returned()
        if not back:
            return
        self._halt_stages()
        try:
            self.fleet.rejoin_all(back, self._catch_up)
        finally:
            self._start_stages()
        self._write_placement()

    def _catch_up(self, i: int) -> None:
        """Replacement generator ``i`` (built with the initial weights) takes the published ones."""
        self._held[i] = 0
        if self._published.version > 0:
            self._load(i, self._published)

    # ------------------------------------------------------------------------------ the stages
    def _start_stages(self, carry: list[Rollout] | None = None) -> None:
        """Start the stage threads at batch ``iteration_count``, the generators' carries ``carry``
        (default: what they were before that batch, or empty)."""
        old = self._stages.carry_states.get(self.iteration_count) if self._stages else None
        carry = list(carry or old or [])
        carry += [Rollout.concat([]) for _ in range(len(self.generators) - len(carry))]  # the fleet may have grown
        fleet = list(self.fleet.active)
        carry = carried_by(carry, fleet)
        self._stages = stages = Stages(first=self.iteration_count, fleet=fleet, scored=queue.Queue(maxsize=self.k + 1),
                                       carry=list(carry), carry_states={self.iteration_count: list(carry)})
        workers = [threading.Thread(target=self._guarded, args=(stages, self._generate_loop, g), daemon=True,
                                    name=f"rayppo-generator-{g}") for g in fleet]
        workers.append(threading.Thread(target=self._guarded, args=(stages, self._score_loop), daemon=True,
                                        name="rayppo-scoring"))
        stages.threads = workers
        self._last_return = time.perf_counter()
        for thread in workers:
            thread.start()

    def _halt_stages(self) -> None:
        """Stop the stages and move the prompt sampler back to the next batch to train: the
        batches in flight are drawn again by the next start."""
        self._stop_stages()
        with self._cond:
            position = self._stages.prompt_states.get(self.iteration_count)
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

    def _guarded(self, stages: Stages, loop, *args: Any) -> None:
        """Run a stage loop; its first error (while running) is raised on the caller's thread."""
        try:
            loop(stages, *args)
        except _StoppedError:
            pass
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
                if published.version > self._held[g]:
                    self._load(g, published)
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
            return self.supervisor.call_one(self.generators, "generators", g, GeneratorEngine.generate,
                                            (share, seed), refresh=self._refresh)
        share.groups = with_unique_groups(share.groups, b, self.cfg.rollout.batch_size)
        waiting, round_ = stages.carry[g], 0
        while True:  # a round: every unfinished row gets up to partial_tokens more
            todo = unfinished(waiting)
            done = sorted(set(range(len(waiting))) - set(todo))
            out = self.supervisor.call_one(self.generators, "generators", g, GeneratorEngine.generate_partial,
                                           (share, waiting.select(todo), seed, self.partial), refresh=self._refresh)
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
            while b > self._published.version + self.lead:
                if stages.stop.is_set():
                    raise _StoppedError
                self._cond.wait(POLL_S)
            if stages.stop.is_set():
                raise _StoppedError
            return self._published

    def _batch(self, stages: Stages, b: int) -> Batch:
        """Batch b's prompts, drawn (in order) by the first generator to reach it."""
        with self._cond:
            if stages.stop.is_set():  # a restart is about to move the sampler: draw nothing more
                raise _StoppedError
            if b not in stages.batches:
                stages.prompt_states[b] = self.prompts.state_dict()
                stages.batches[b] = Batch(self.prompts.next_batch(), [None] * len(stages.fleet))
            return stages.batches[b]

    def _load(self, g: int, published: Published) -> None:
        """Generator g takes the published weights, then (``checks.verify_sync``) proves it holds them."""
        # A generator replaced during these calls takes *these* weights (the ones it is checked
        # against below), not newer ones published meanwhile.
        def refresh(i: int) -> None:
            self._refresh(i, published)

        version = self.supervisor.call_one(self.generators, "generators", g, GeneratorEngine.load_weights,
                                           (published.payload,), refresh=refresh)
        if version != published.version:
            raise RuntimeError(f"generator {g} reports policy version {version} after loading {published.version}")
        if published.fingerprints is not None:
            # A generator replaced during this call takes the published weights first (``_refresh``):
            # a fresh engine has loaded nothing, so it would fingerprint nothing.
            held = self.supervisor.call_one(self.generators, "generators", g, GeneratorEngine.weight_fingerprints, (),
                                            refresh=refresh)
            if held is None:  # tensor-parallel vLLM cannot be fingerprinted yet: sync/verified = NaN
                self._unverified = True
            else:
                check_weights(published.fingerprints, held, g, version)
        self._held[g] = version

    def _refresh(self, i: int, published: Published | None = None) -> None:
        """A replacement generator i takes ``published`` (default: the newest) weights, within the
        call deadline; its own build is version 0."""
        published = published or self._published
        self._held[i] = 0
        if published.payload is not None:
            future = self.generators.call_at(i, GeneratorEngine.load_weights, (published.payload,))
            self._held[i] = get_within(future, self.supervisor.timeout_s,
                                       f"replacement generator {i} could not load policy version {published.version}")

    def _score_loop(self, stages: Stages) -> None:
        """Score each complete batch (reference and reward at the same time), in order."""
        while True:
            try:
                b = stages.to_score.get(timeout=POLL_S)
            except queue.Empty:
                if stages.stop.is_set():
                    raise _StoppedError
                continue
            self._scoring_clock.start()
            try:
                parts = Rollout.concat(stages.batches[b].parts)
                rollout, times = self.score(renumber_groups(parts) if self.partial else parts)
            finally:
                self._scoring_clock.stop()
            while True:  # the queue is bounded: wait for the learner
                try:
                    stages.scored.put((b, rollout, times), timeout=POLL_S)
                    break
                except queue.Full:
                    if stages.stop.is_set():
                        raise _StoppedError

    def evaluate(self) -> dict[str, float]:
        """Held-out evaluation of the current policy, with the stage threads stopped: one owner per
        actor at a time (a generator or reward actor dying under both would be replaced twice, or
        its death raised as a foreign one). Every generator first loads the newest weights; the
        batches in flight are drawn again afterwards from the same prompts (the evaluation's
        price: their sampling is redone)."""
        if self.eval_prompts is None:
            return {}
        self.phase = "evaluate"
        self._halt_stages()  # batches past the learner were drawn: they are drawn again after
        try:
            for g in self.fleet.active:
                if self._published.version > self._held[g]:
                    self._load(g, self._published)
            return super().evaluate()
        finally:
            self._start_stages()

    # --------------------------------------------------------------- checkpoints and failures
    def driver_state(self) -> dict[str, Any]:
        """As the synchronous trainer's, with the sampler's position before the next batch to
        train (batches in flight are drawn again on resume)."""
        with self._cond:
            prompts = self._stages.prompt_states.get(self.iteration_count) or self.prompts.state_dict()
            carry = self._stages.carry_states.get(self.iteration_count) or self._stages.carry
        state = {"iteration": self.iteration_count, "kl_coef": self.kl_ctl.value, "prompts": dict(prompts)}
        if self.partial:  # the rows in flight between calls are kept: none is lost or sampled twice
            state["partial_rows"] = carry_to_json(carry)
        return state

    def restore(self, path: Path | None, state: dict[str, Any]) -> None:
        """Stop the stages, load the checkpoint, publish its weights and start again from it: every
        generator loads them (and is checked) before its first batch."""
        self.phase = "restore"
        self._stop_stages()
        version = self._load_state(path, state)
        self._publish(version)
        self._held = defaultdict(lambda: -1)  # every generator loads the restored weights first
        carry = carry_from_json(state.get("partial_rows"), len(self.generators)) if self.partial else None
        self._start_stages(carry)
        self.phase = "idle"

    def recover(self, failure: LearnerFailedError) -> int:
        self._stop_stages()  # before the learner goes: no stage may read its weights meanwhile
        return super().recover(failure)

    def close(self) -> None:
        if self._stages is not None:
            self._stages.stop.set()  # first: the errors of the actors killed next end the stages quietly
        self._kill_actors()
        # The actors are gone: a stage thread's call fails at once (and is not redone: the
        # supervisor is closed), one waiting for the window sees the stop. Joined before Ray ends.
        self._stop_stages(timeout_s=CLOSE_JOIN_S)
        self._end_session()
