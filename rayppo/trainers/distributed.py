"""The distributed trainer: the iteration of docs/algorithm.md over Ray actor groups.

    generate  (GeneratorActor x G, vLLM)     y ~ pi_old, log pi_old, policy version v
    reference (ReferenceActor x R)  ┐ concurrently
    reward    (RewardActor x W)     ┘        log pi_ref, r_phi(x, y)
    learn     (LearnerGroup x N, DeepSpeed)  values, shaped rewards, GAE, whitening, PPO epochs
    sync      rank 0 -> every generator      weights of version v + 1

Rollouts cross processes as Arrow tables (``Rollout`` pickles itself that way); weights go from
learner rank 0 to the generators through the object store or by broadcast (``weight_sync.py``).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

from rayppo.actors.generator import GeneratorEngine
from rayppo.actors.reference import ReferenceEngine
from rayppo.actors.reward import RewardEngine
from rayppo.cluster.colocation import DeviceSchedule
from rayppo.cluster.fleet import Fleet
from rayppo.cluster.learner_group import LearnerGroup
from rayppo.cluster.placement import (Placement, placement_report, release, requested_resources, reserve,
                                     room_for_generators)
from rayppo.cluster.roles import actor_count, add_generators, spawn_roles
from rayppo.cluster.session import RaySession
from rayppo.cluster.shares import sampled_shares
from rayppo.cluster.startup import wait_ready
from rayppo.cluster.supervisor import Fanout, Supervisor
from rayppo.cluster.weight_sync import make_weight_sync, verify_sync
from rayppo.config.derived import fleet_minimum, generator_context
from rayppo.config.schema import Config
from rayppo.console import console
from rayppo.data.prompts import PromptBatch, PromptSampler, load_prompt_set
from rayppo.data.rollout import Rollout, split_evenly
from rayppo.engine import Engine
from rayppo.errors import LearnerFailedError
from rayppo.learner.step import LearnResult
from rayppo.models.loading import load_tokenizer, resolve_model_path
from rayppo.models.shape import max_positions
from rayppo.run.checkpoint import DRIVER_STATE, CheckpointError, latest_checkpoint, read_driver_state
from rayppo.trainers.dynamic_sampling import fill_batch
from rayppo.trainers.evaluation import eval_plan, eval_source, run_evaluation
from rayppo.data.seeds import eval_seed, rollout_seed
from rayppo.trainers.iteration import group_shares, make_kl_controller, rollout_stats

log = logging.getLogger(__name__)

PHASES = ("starting", "generate", "score", "learn", "sync", "verify", "evaluate", "checkpoint", "restore", "idle")
"""What the driver waits on (``DistributedTrainer.phase``); the pipeline adds ``wait`` (for a
scored batch) and runs generate and score in its stage threads meanwhile."""


class DistributedTrainer:
    """Generators, reference and reward scorers and the learner group on a Ray cluster.

    ``phase`` names what the driver waits on now (one of ``PHASES``), for whoever watches the run
    from another thread: the fault matrix (``benchmarks/fault_matrix.py``) times its signals by it."""

    phase: str = "starting"

    def __init__(self, cfg: Config):
        self.cfg = cfg
        m, p = cfg.model, cfg.ppo
        # Everything that can fail on bad input is checked before any process starts.
        self.policy_path = str(resolve_model_path(m.policy, m.cache_dir))  # builds the embedded model once
        tokenizer = load_tokenizer(self.policy_path)
        positions = max_positions(self.policy_path)
        limit = cfg.generators.max_model_len or positions
        max_prompt = limit - cfg.rollout.max_new_tokens if limit else sys.maxsize
        prompt_set = load_prompt_set(cfg.data.prompts, cfg.data.prompt_column, tokenizer, max_prompt, cfg.data.split)
        self.prompts = PromptSampler(prompt_set, cfg.rollout.batch_size, cfg.seed, cfg.data.shuffle)
        held_out = eval_source(cfg)
        self.eval_prompts = (load_prompt_set(held_out[0], cfg.data.prompt_column, tokenizer, max_prompt, held_out[1])
                             if held_out else None)
        longest = max(len(ids) for ids in prompt_set.ids + (self.eval_prompts.ids if self.eval_prompts else []))
        # vLLM's max_model_len: what the job needs, not the model's whole context (generator_context).
        self.context = generator_context(cfg.generators.max_model_len, positions, longest, cfg.rollout.max_new_tokens)
        self.kl_ctl = make_kl_controller(p.kl_coef, p.adaptive_kl, p.kl_target, p.kl_horizon)
        self.iteration_count = 0
        self._start_state: dict[str, Any] | None = None
        self._initial_state = self._state_now()  # where a learner restart goes with no checkpoint yet
        self.learner_restarts = 0
        self.last_rollout: Rollout | None = None
        self.last_update: LearnResult | None = None
        self.placements: dict[str, Placement] = {}
        self.schedule = DeviceSchedule(cfg.cluster.colocate_all, cfg.cluster.call_timeout_s)
        self.supervisor = Supervisor(cfg.cluster.max_actor_restarts, cfg.cluster.call_timeout_s,
                                     cfg.cluster.restart_window)
        self.session = RaySession(cfg.cluster.address, cfg.cluster.num_cpus, requested_resources(cfg).get("CPU", 0.0),
                                  verbose=console.actor_log("driver", 0) is None).__enter__()
        try:
            self.placements = reserve(cfg)
            console.phase(f"starting {actor_count(cfg)}" + (f" (their output: {console.shown(console.log_dir)}/)"
                                                             if console.log_dir else ""))
            self._spawn_roles()
            wait_ready({"generators": self.generators, "reference": self.reference, "reward": self.rewards,
                        "learner": self.learner.ranks}, cfg.cluster.call_timeout_s)
            self.learner.locate()
            console.phase("warming up the generators (their first call allocates)")
            self.generators.get(self.generators.call_all(GeneratorEngine.warmup))
            self._write_placement()
        except BaseException:
            self.close()
            raise

    def _write_placement(self) -> None:
        """``placement.json``: the node of each actor of each role (again whenever the fleet changes)."""
        out = Path(self.cfg.output.dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "placement.json").write_text(json.dumps(placement_report(self.placements), indent=1))

    def _spawn_roles(self) -> None:
        cfg = self.cfg
        roles = spawn_roles(cfg, self.placements, self.context, self.schedule)
        self.generators, self.reference, self.rewards, self.learner = (roles.generators, roles.reference,
                                                                       roles.rewards, roles.learner)
        self.fleet = Fleet(self.generators, self.placements.get("generators"), fleet_minimum(cfg),
                           cfg.cluster.placement_timeout_s, Path(cfg.output.dir))
        self.supervisor.add_fleet(self.fleet)
        self.weight_sync = make_weight_sync(cfg, self.learner, self.generators, self.supervisor, self.fleet)
        self.schedule.generators = self.generators
        for group in (self.generators, self.reference, self.rewards):
            self.supervisor.watch(group)
        self.schedule.scorers, self.schedule.learner = [self.reference, self.rewards], self.learner.ranks

    # ------------------------------------------------------------------------------- iteration
    def iteration(self) -> dict[str, float]:
        """One PPO iteration; returns its metrics (docs/algorithm.md, "Metrics")."""
        it, seconds = self.iteration_count, {}
        self._start_state = self._state_now()  # what a checkpoint holds until this iteration completes
        self._regrow()  # generators placed again since the last iteration sample from this one on
        with self._stage("generate", seconds):
            rollout = self.generate(self.prompts.next_batch(), rollout_seed(self.cfg.seed, it))
            rollout, dynamic = self.dynamic_sampling(rollout, it)  # DAPO's dynamic sampling ({} when off)
        with self._stage("score", seconds):
            rollout, score_times = self.score(rollout)
        kl_coef = self.kl_ctl.value
        with self.learner.failures():  # a dead or hung rank: LearnerFailedError, then recover()
            with self._stage("learn", seconds):
                update = self._learn(rollout, kl_coef, it)
            with self._stage("sync", seconds):
                sync_bytes = self.weight_sync.sync(update.version)
            with self._stage("verify", seconds):
                verified = self._verify(update.version) if self.cfg.checks.verify_sync else 0.0
        self.supervisor.progress()
        return self._metrics(update.metrics, rollout, seconds, {**score_times, **dynamic, "kl_coef": kl_coef,
                                                                "sync/bytes": float(sync_bytes),
                                                                "sync/verified": float(verified)})

    def _metrics(self, stats: dict[str, float], rollout: Rollout, seconds: dict[str, float],
                 more: dict[str, float]) -> dict[str, float]:
        """The iteration's metrics line: the update's, the rollout's, each stage's seconds, ``more``."""
        timings = {"time/generate": seconds["generate"], "time/score": seconds["score"], "time/learn": seconds["learn"],
                   "time/sync": seconds["sync"] + seconds["verify"], "time/sync_verify": seconds["verify"],
                   "time/iteration": sum(seconds.values()), "faults/actor_restarts": float(self.supervisor.restarts),
                   "faults/learner_restarts": float(self.learner_restarts)}
        return {**stats, **rollout_stats(rollout, timings["time/iteration"], self.cfg.rollout.max_turns), **timings,
                **self.fleet.metrics(), **more}

    @contextmanager
    def _stage(self, name: str, seconds: dict[str, float]) -> Iterator[None]:
        """One stage of the iteration: ``phase`` names it while it runs, its wall time goes to
        ``seconds[name]``, and the colocated schedule frees or takes back the GPU around it
        (``DeviceSchedule.before`` and ``.after``)."""
        self.phase, start = name, time.perf_counter()
        self.schedule.before(name)
        yield
        self.schedule.after(name)
        seconds[name] = time.perf_counter() - start
        self.phase = "idle"

    def _learn(self, rollout: Rollout, kl_coef: float, it: int) -> LearnResult:
        """The learner group's update on a scored batch; from its return a checkpoint holds this
        iteration (``_commit_update``)."""
        update = self.learner.train(rollout, kl_coef, it)
        self._commit_update(update, rollout)
        return update

    def dynamic_sampling(self, rollout: Rollout, it: int) -> tuple[Rollout, dict[str, float]]:
        """``rollout.dynamic_sampling_rounds`` > 0: the informative groups of this batch and of up
        to that many extra rewarded batches (``dynamic_sampling.fill_batch``); else as it is."""
        rounds = self.cfg.rollout.dynamic_sampling_rounds
        if not rounds:
            return rollout, {}

        def draw(k: int) -> Rollout:
            return self.scored_by_reward(self.generate(self.prompts.next_batch(), rollout_seed(self.cfg.seed, it, k)))

        return fill_batch(self.scored_by_reward(rollout), draw, self.cfg.rollout.batch_size, rounds)

    def scored_by_reward(self, rollout: Rollout) -> Rollout:
        """``rollout`` with r_phi of every row (the reward pass alone)."""
        (score,) = self._reward_scores([rollout])
        return rollout.scored(score)

    def _verify(self, version: int) -> float:
        """The guard's check of the fleet's generators' weights after a sync (``verify_sync``)."""
        return self.fleet.on_active(lambda active: verify_sync(self.learner, self.generators, version, self.supervisor,
                                                               self.weight_sync.refresh, active))

    def _regrow(self) -> None:
        """Generators that left the fleet and whose replacements have a place now take the current
        weights, are checked (``checks.verify_sync``), and rejoin (``Fleet.rejoin``)."""
        self.fleet.iteration = self.iteration_count
        back = self.fleet.returned()
        if back:
            self.fleet.rejoin_all(back, self._bring_up_to_date)
            self._write_placement()

    def room_to_grow(self, generators: int) -> bool:
        """Whether the cluster has room now for ``generators`` in all."""
        more = generators - len(self.generators)
        return more > 0 and room_for_generators(self.cfg, more)

    def grow_fleet(self, generators: int) -> list[int]:
        """``generators`` generators in all from now on (more than now), without a restart: the new
        ones start in placement groups of their own, and once placed and built (waited for up to
        ``cluster.placement_timeout_s``; later ones join at a later iteration boundary) take the
        current weights, are checked and join the fleet, as a generator that lost its node rejoins.
        Returns their indices."""
        added = add_generators(self.cfg, self.generators, self.placements["generators"], self.context,
                               generators - len(self.generators))
        self.cfg.generators.num = len(self.generators)
        self.fleet.minimum = fleet_minimum(self.cfg)  # generators.min_num may come with the request
        for i in added:
            self.fleet.add(i)
        self.fleet.wait(added, self.cfg.cluster.placement_timeout_s)
        self._regrow()
        return added

    def _bring_up_to_date(self, i: int) -> None:
        """Generator ``i`` (a replacement) takes the current weights, and its fingerprints are checked."""
        self.weight_sync.refresh(i)
        if self.cfg.checks.verify_sync and self.iteration_count:  # before the first sync it holds what it built
            verify_sync(self.learner, self.generators, self.iteration_count, self.supervisor, self.weight_sync.refresh,
                        [i])

    def _commit_update(self, update: LearnResult, rollout: Rollout) -> None:
        """The learner has taken this iteration's update: the driver's state moves with it (beta,
        the iteration count), so that a checkpoint written after a later failure of this iteration
        (the sync, its check) pairs the updated learner with the state after the iteration, never
        with the state before it (which would train the batch twice on resume)."""
        # kl_ref None: no reference (beta = 0), or no row trained; the controller sees 0.
        self.kl_ctl.update(0.0 if update.kl_ref is None else update.kl_ref, len(rollout))
        if self.cfg.output.save_rollouts:  # each row's advantages (and returns) into its rollout file
            rollout = rollout.trained(*self.learner.trained_targets())
        self.iteration_count += 1
        self._start_state = None
        self.last_rollout = rollout
        self.last_update = update

    def generate(self, prompts: PromptBatch, seed: int) -> Rollout:
        """Each generator of the fleet samples its share of the prompts, in groups (``group_shares``);
        a row's noise is its group's and place's (``sample_seeds``), whichever generator draws it."""
        n = self.cfg.rollout.samples_per_prompt
        return self._sample(GeneratorEngine.generate, lambda g: group_shares(prompts, g, n), seed)

    def _sample(self, method: Callable[..., Rollout], split: Callable[[int], list[PromptBatch]], seed: int,
                *options: Any) -> Rollout:
        """``method`` (generate or evaluate) on each generator of the fleet with its share of the
        prompts (``split(generators)``), ``options`` and the call's seed (last; each row's noise
        follows from it and the row's group, ``sample_seeds``). A generator that dies or hangs is
        replaced, given the current weights, and samples its share again. When one leaves the fleet
        meanwhile, the other shares are kept and only the lost one is split again over the
        generators left (``cluster/shares.py``, ``PromptBatch.whole_groups``)."""
        shares = split(len(self.fleet.active))
        return Rollout.concat(sampled_shares(self.supervisor, self.fleet, method, shares, PromptBatch.whole_groups,
                                             (*options, seed), self.weight_sync.refresh))

    def _reward_scores(self, rollouts: list[Rollout]) -> list[list[float]]:
        """r_phi of each rollout's rows (the reward pass alone); 0 when nothing but an environment
        rewards them."""
        if not len(self.rewards):
            return [[0.0] * len(r) for r in rollouts]
        return [[x for part in parts for x in part] for parts in self.supervisor.run([self._reward_pass(r) for r in rollouts])]

    def _reward_pass(self, rollout: Rollout) -> Fanout:
        """r_phi of ``rollout``'s rows, split across the reward actors."""
        rows = split_evenly(len(rollout), len(self.rewards))
        return Fanout(self.rewards, "reward", RewardEngine.scores, [(rollout.select(r),) for r in rows])

    def score(self, rollout: Rollout) -> tuple[Rollout, dict[str, float]]:
        """log pi_ref and r_phi, the two passes running at the same time on their own actors (r_phi
        only when no reference runs, at ppo.kl_coef = 0)."""
        if not len(self.rewards):  # an environment's turn rewards are the whole reward
            rollout = rollout.scored([0.0] * len(rollout))
        scored = len(rollout.score) == len(rollout)  # dynamic sampling has rewarded it already
        passes = [] if scored else [self._reward_pass(rollout)]
        if len(self.reference):
            ref_rows = split_evenly(len(rollout), len(self.reference))
            passes.append(Fanout(self.reference, "reference", ReferenceEngine.ref_logprobs,
                                 [(rollout.select(r),) for r in ref_rows]))
        parts = dict(zip((p.role for p in passes), self.supervisor.run(passes)))  # at the same time; failed shares redone
        score = [x for part in parts["reward"] for x in part] if "reward" in parts else rollout.score
        rollout = rollout.scored(score, [x for part in parts.get("reference", []) for x in part])
        seconds = {p.role: p.seconds for p in passes}
        return rollout, {"time/reward": seconds.get("reward", 0.0), "time/reference": seconds.get("reference", 0.0)}

    def evaluate(self) -> dict[str, float]:
        """The current policy on the held-out prompts, split across the generators and scored by
        the reward actors (``rayppo/trainers/evaluation.py``); {} without held-out prompts."""
        if self.eval_prompts is None:
            return {}
        prompts, seed = self.eval_prompts, eval_seed(self.cfg.seed)
        self.phase = "evaluate"

        def split(generators: int) -> list[PromptBatch]:
            # Each held-out prompt keeps its place in the set as its group: its noise is the same on any split.
            return [prompts.select(rows).groups_of(1, rows.start) for rows in split_evenly(len(prompts), generators)]

        def score_pass(temperature: float, k: int) -> list[float]:
            rollout = self._sample(GeneratorEngine.evaluate, split, seed, temperature, k)
            (score,) = self._reward_scores([rollout])
            return rollout.scored(score).total_rewards()

        try:
            return run_evaluation(eval_plan(self.cfg), len(prompts), score_pass)
        finally:
            self.phase = "idle"

    def peak_memory(self) -> dict[str, int]:
        """Peak resident memory (bytes) of the largest process of each role."""
        groups = {"generators": self.generators, "reference": self.reference, "reward": self.rewards,
                  "learner": self.learner.ranks}
        actors = {role: list(self.fleet.active) if role == "generators" else list(range(len(group)))
                  for role, group in groups.items()}  # a generator waiting for a place answers nothing
        return {role: max(m["rss"] for m in group.get([group.call_at(i, Engine.peak_memory_bytes, ())
                                                       for i in actors[role]]))
                for role, group in groups.items() if actors[role]}

    # ----------------------------------------------------------------------------- save / close
    def save(self, out_dir: str | Path) -> None:
        """The final policy (Hugging Face format, with tokenizer) and critic."""
        self.learner.save(str(Path(out_dir).resolve()))

    def driver_state(self) -> dict[str, Any]:
        """What the next iteration needs besides the models (JSON): as of the last completed
        iteration, even when one failed half-way (its prompts are drawn again on resume)."""
        return self._start_state or self._state_now()

    def _state_now(self) -> dict[str, Any]:
        """The driver's state as it is: beta, the iteration count, the prompt position."""
        return {"iteration": self.iteration_count, "kl_coef": self.kl_ctl.value, "prompts": self.prompts.state_dict()}

    def checkpoint(self, path: Path) -> dict[str, Any]:
        """Every learner rank's DeepSpeed states under ``path``; returns the driver's state."""
        self.phase = "checkpoint"
        self.learner.save_checkpoint(str(path))
        self.phase = "idle"
        return self.driver_state()

    def restore(self, path: Path | None, state: dict[str, Any]) -> None:
        """Load a checkpoint (None: the initial models, as built) and bring every generator to
        its policy version (sync, then check)."""
        self.phase = "restore"
        version = self._load_state(path, state)
        self.schedule.wake_for_restore()  # colocated mode: a failure may have left vLLM asleep
        self.weight_sync.sync(version)
        if self.cfg.checks.verify_sync:
            self._verify(version)
        self.schedule.wake_after_restore()
        self.phase = "idle"

    def _load_state(self, path: Path | None, state: dict[str, Any]) -> int:
        """The learner's checkpoint at ``path`` (None: the initial models, as built) and the driver's
        ``state`` with it (beta, the iteration, the prompt position); returns the policy version."""
        version = self.learner.load_checkpoint(str(path)) if path is not None else 0
        check_pairing(path, version, state)
        self._start_state = None
        self.iteration_count = state["iteration"]
        self.kl_ctl.value = float(state["kl_coef"])
        self.prompts.load_state_dict(state["prompts"])
        return version

    def recover(self, failure: LearnerFailedError) -> int:
        """After a learner rank died or hung: rebuild the learner group, load the latest
        checkpoint (the start of the run when none was written) and bring the generators to it.
        Returns the iteration to go on from; the iterations since that checkpoint are redone.
        Past ``cluster.max_actor_restarts``, ``LearnerFailedError`` with the command to resume."""
        out = Path(self.cfg.output.dir)
        try:
            checkpoint: Path | None = latest_checkpoint(out)
        except CheckpointError:
            checkpoint = None
        hint = (f"; continue from its last checkpoint with: rayppo train --resume {out}" if checkpoint else
                f"; no checkpoint was written yet (output.checkpoint_every={self.cfg.output.checkpoint_every})")
        self.supervisor.count_restart(str(failure), LearnerFailedError, hint)
        start = time.perf_counter()
        self.learner.rebuild()
        self.schedule.learner = self.learner.ranks
        self.weight_sync = make_weight_sync(self.cfg, self.learner, self.generators, self.supervisor, self.fleet)
        self.restore(checkpoint, read_driver_state(checkpoint) if checkpoint else self._initial_state)
        self.learner_restarts += 1
        log.warning("%s: learner group restarted from %s in %.1f s (%s); redoing iterations from %d", failure,
                    checkpoint or "the initial models", time.perf_counter() - start, self.supervisor.budget_text(),
                    self.iteration_count)
        return self.iteration_count

    def close(self) -> None:
        """Kill every actor, then end the Ray session if this trainer started it."""
        self._kill_actors()
        self._end_session()

    def _kill_actors(self) -> None:
        self.supervisor.close()  # an actor killed under a call in flight is not replaced
        for group in ("generators", "reference", "rewards", "learner"):
            if hasattr(self, group):
                getattr(self, group).kill()

    def _end_session(self) -> None:
        """Release the placement groups and end the Ray session (if this trainer started it).
        Threads that call actors must be joined before: Ray ends the whole process (exit 1, no
        message on the terminal) when a thread calls into it after ``ray.shutdown``."""
        if self.placements:
            release(self.placements)
            self.placements = {}
        self.session.close()


def check_pairing(path: Path | None, version: int, state: dict[str, Any]) -> None:
    """The learner's policy version is the number of updates it took, one per iteration: a
    checkpoint whose learner and driver state disagree would train a batch twice (or skip one)."""
    if version != state["iteration"]:
        raise CheckpointError(f"--resume: {path} holds policy version {version} but its {DRIVER_STATE} says "
                              f"{state['iteration']} iterations: learner and driver state do not belong together")
