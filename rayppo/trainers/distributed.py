"""The distributed trainer: the iteration of docs/algorithm.md over Ray actor groups.

    source    (GeneratorActor x G, vLLM)      y ~ pi_old, log pi_old, policy version v
              (ReferenceActor x R)  ┐ concurrently
              (RewardActor x W)     ┘         log pi_ref, r_phi(x, y)
    learn     (LearnerGroup x N, DeepSpeed)   values, shaped rewards, GAE, whitening, PPO epochs
    publish   rank 0 -> every generator       weights of version v + 1

The rollout source is what varies (``source_class``): the synchronous one samples each batch when
asked and syncs after the update (``sync_source.py``); the pipelined one (``rollout.max_staleness``
> 0) samples ahead in threads and hands each update to them (``pipeline.py``). Either drives the
fleet's generators (``Fleet.controlled_by``): the trainer pauses, restarts and takes back
generators through the fleet, which grows itself (``rayppo scale``). The iteration (``loop.py``),
evaluation, checkpoints, restores and a learner's restart are this trainer's, once for both.

Rollouts cross processes as Arrow tables (``Rollout`` pickles itself that way); weights go from
learner rank 0 to the generators through the object store or by broadcast (``cluster/weight_sync.py``).
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from rayppo.actors.generator import GeneratorEngine
from rayppo.cluster.colocation import DeviceSchedule
from rayppo.cluster.fleet import Fleet
from rayppo.cluster.fleet_control import FleetControl, SamplesAhead
from rayppo.cluster.placement import Placement, placement_report, release, requested_resources, reserve
from rayppo.cluster.roles import GeneratorSpawner, actor_count, spawn_roles
from rayppo.cluster.session import RaySession
from rayppo.cluster.startup import wait_ready
from rayppo.cluster.supervisor import Supervisor
from rayppo.config.derived import fleet_minimum, generator_context, lora_sync
from rayppo.config.schema import Config
from rayppo.console import console
from rayppo.data.prompts import PromptBatch
from rayppo.data.rollout import Rollout, split_evenly
from rayppo.data.seeds import eval_seed
from rayppo.errors import LearnerFailedError
from rayppo.learner.step import LearnResult
from rayppo.models.loading import load_tokenizer, resolve_model_path
from rayppo.models.shape import max_positions
from rayppo.models.teacher import checked_teacher
from rayppo.run.checkpoint import DRIVER_STATE, CheckpointError, latest_checkpoint, read_driver_state
from rayppo.run.mfu import probe_tokens
from rayppo.trainers.clock import PHASES, Stage, StageClock
from rayppo.trainers.distributed_roles import DistributedRoles
from rayppo.trainers.evaluation import eval_plan, held_out_result
from rayppo.trainers.loop import LoopTrainer, load_prompts

log = logging.getLogger(__name__)

__all__ = ["DistributedTrainer", "PHASES", "check_pairing", "source_class"]


def source_class(cfg: Config) -> type:
    """The rollout source ``cfg`` runs: the pipelined one when ``rollout.max_staleness`` > 0."""
    if cfg.rollout.max_staleness > 0:
        from rayppo.trainers.pipeline import PipelinedSource

        return PipelinedSource
    from rayppo.trainers.sync_source import SynchronousSource

    return SynchronousSource


class DistributedTrainer(LoopTrainer):
    """Generators, reference and reward scorers and the learner group on a Ray cluster, fed by
    the rollout source the config chooses (``source_class``)."""

    def __init__(self, cfg: Config):
        # Everything that can fail on bad input is checked before any process starts.
        # Builds the embedded model once.
        self.policy_path = str(resolve_model_path(cfg.model.policy, cfg.model.cache_dir))
        if cfg.distill.teacher:  # its tokenizer is checked here, before Ray starts (each node resolves it again)
            checked_teacher(cfg.distill.teacher, self.policy_path, cfg.model.cache_dir, cfg.distill.topk)
        positions = max_positions(self.policy_path)
        limit = cfg.generators.max_model_len or positions
        prompt_set, eval_prompts = load_prompts(cfg, load_tokenizer(self.policy_path),
                                                limit - cfg.rollout.max_new_tokens if limit else None)
        super().__init__(cfg, prompt_set, eval_prompts)
        longest = max(len(ids) for ids in prompt_set.ids + (eval_prompts.ids if eval_prompts else []))
        # vLLM's max_model_len: what the job needs, not the model's whole context (generator_context).
        self.context = generator_context(cfg.generators.max_model_len, positions, longest, cfg.rollout.max_new_tokens)
        self.learner_restarts = 0
        self.placements: dict[str, Placement] = {}
        self.schedule = DeviceSchedule(cfg.cluster.colocate_all, cfg.cluster.call_timeout_s)
        self.clock = StageClock()
        self.sampler: SamplesAhead | None = None
        """The source's threads that sample ahead (the pipelined source's); None when it samples when asked."""
        self.supervisor = Supervisor(cfg.cluster.max_actor_restarts, cfg.cluster.call_timeout_s,
                                     cfg.cluster.restart_window)
        self.session = RaySession(cfg.cluster.address, cfg.cluster.num_cpus, requested_resources(cfg).get("CPU", 0.0),
                                  verbose=console.actor_log("driver", 0) is None).__enter__()
        try:
            self.placements = reserve(cfg)
            console.phase(f"starting {actor_count(cfg)}" + (f" (their output: {console.user_path(console.log_dir)}/)"
                                                             if console.log_dir else ""))
            self._spawn_roles()
            if cfg.learner.lora_rank:
                console.phase("LoRA sync: " + lora_sync(cfg)[1])
            wait_ready(self.calls.groups(), cfg.cluster.call_timeout_s)
            self.learner.locate()
            console.phase("warming up the generators (their first call allocates)")
            self.generators.get(self.generators.call_all(GeneratorEngine.warmup))
            self._write_placement()
            if cfg.output.mfu:  # perf/mfu/*'s denominator, once, with nothing else computing yet: the
                # learner's GPUs, or on CPU its threads on the cores the roles share (the synchronous
                # source's stages take turns on them; the pipelined one's overlap)
                self.stage_counter.rate = self.learner.matmul_rate(probe_tokens(cfg))
            self._start_source()
        except BaseException:
            self.close()
            raise

    def _spawn_roles(self) -> None:
        """Every role's actors, the fleet, the weight sync, and the supervisor watching them."""
        cfg = self.cfg
        roles = spawn_roles(cfg, self.placements, self.context, self.schedule)
        self.generators, self.reference, self.rewards, self.teacher, self.learner = (
            roles.generators, roles.reference, roles.rewards, roles.teacher, roles.learner)
        self.fleet = Fleet(self.generators, self.placements.get("generators"), fleet_minimum(cfg),
                           cfg.cluster.placement_timeout_s, Path(cfg.output.dir))
        self.supervisor.add_fleet(self.fleet)
        self.calls = DistributedRoles(cfg, self.generators, self.reference, self.rewards, self.teacher, self.learner,
                                      self.supervisor, self.fleet, self.schedule)
        for group in (self.generators, self.reference, self.rewards, self.teacher):
            self.supervisor.watch(group)

    def _start_source(self) -> None:
        """The rollout source ``cfg`` chooses, which drives the fleet's generators from now on, and
        its threads started when it samples ahead."""
        source = source_class(self.cfg)(self.cfg, self.calls, self.prompts, self.clock)
        self.source, self.publisher = source, source
        self.sampler = source if isinstance(source, SamplesAhead) else None
        self.fleet.controlled_by(FleetControl(keeper=source, spawner=GeneratorSpawner(self.cfg, self.context),
                                              on_join=self._write_placement, sampler=self.sampler))
        self._initial_state = self.driver_state()  # where a learner restart goes with no checkpoint yet
        if self.sampler is not None:
            self.sampler.start()

    def _write_placement(self) -> None:
        """``placement.json``: the node of each actor of each role (again whenever the fleet changes)."""
        out = Path(self.cfg.output.dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "placement.json").write_text(json.dumps(placement_report(self.placements), indent=1))

    @property
    def weight_sync(self) -> Any:
        """How the learner's weights reach the generators (``cluster/weight_sync.py``)."""
        return self.calls.weight_sync

    def generate(self, prompts: PromptBatch, seed: int) -> Rollout:
        """The fleet's rollout of ``prompts`` (``DistributedRoles.generate``)."""
        return self.calls.generate(prompts, seed)

    # ------------------------------------------------------------------------------- iteration
    def _learn(self, rollout: Rollout, kl_coef: float, it: int) -> LearnResult:
        """The learner group's update on a scored batch."""
        update = self.learner.train(rollout, kl_coef, it)
        self.schedule.record(Stage.LEARN)  # colocated: where the learner's turn on the GPU ended
        return update

    def _trained_targets(self) -> tuple[list[list[float]], list[list[float]]]:
        """The learner ranks' advantages and returns of the last update, in row order."""
        return self.learner.trained_targets()

    def _learner_failures(self) -> AbstractContextManager[Any]:
        """A dead or hung rank: ``LearnerFailedError``, then ``recover``."""
        return self.learner.failures()

    def _iteration_done(self) -> None:
        """One more iteration completed: the clock of the supervisor's restart window."""
        self.supervisor.progress()

    def _run_figures(self) -> dict[str, float]:
        """Restarts so far and the fleet's size."""
        return {"faults/actor_restarts": float(self.supervisor.restarts),
                "faults/learner_restarts": float(self.learner_restarts), **self.fleet.metrics()}

    def _before_iteration(self) -> None:
        """Generators that left the fleet (or were added to it) and have a place now take the
        current weights, are checked (``checks.verify_sync``), and rejoin (``Fleet.take_back``);
        the pipeline's batches in flight are drawn again after."""
        self.fleet.take_back(self.iteration_count)

    def evaluate(self) -> dict[str, float]:
        """The current policy on the held-out prompts, split across the generators and scored by
        the reward actors (``rayppo/trainers/evaluation.py``), with the fleet paused and every
        generator holding the published policy; {} without held-out prompts."""
        if self.eval_prompts is None:
            return {}
        prompts, seed = self.eval_prompts, eval_seed(self.cfg.seed)

        def split(generators: int) -> list[PromptBatch]:
            # Each held-out prompt keeps its place in the set as its group: its noise is the same on any split.
            return [prompts.select(rows).groups_of(1, rows.start) for rows in split_evenly(len(prompts), generators)]

        def scored(rollout: Rollout) -> tuple[list[float], list[float]]:
            (score,) = self.calls.reward_scores([rollout])
            return rollout.scored(score).total_rewards(), self.calls.gold_scores(rollout)

        def score_pass(temperature: float, k: int) -> tuple[list[float], list[float]]:
            return scored(self.calls.sample(GeneratorEngine.evaluate, split, seed, temperature, k))

        def teacher_pass(temperature: float, k: int) -> tuple[list[float], list[float]]:
            return scored(self.calls.teacher_held_out(split(1)[0], temperature, k, seed))  # one actor, every prompt

        with self.clock.during("evaluate"), self.fleet.paused(current=True):
            self.last_evaluation = held_out_result(eval_plan(self.cfg), len(prompts), score_pass)
        if not len(self.teacher):
            return self.last_evaluation.figures
        with self.clock.during("evaluate"):
            return self.last_evaluation.figures | self.beside_teacher(teacher_pass, len(prompts))

    def peak_memory(self) -> dict[str, int]:
        """Peak resident memory (bytes) of the largest process of each role."""
        return self.calls.peak_memory()

    # ----------------------------------------------------------------------------- save / close
    def save(self, out_dir: str | Path) -> None:
        """The final policy (Hugging Face format, with tokenizer) and critic."""
        self.learner.save(str(Path(out_dir).resolve()))

    def checkpoint(self, path: Path) -> dict[str, Any]:
        """Every learner rank's DeepSpeed states under ``path``; returns the driver's state."""
        with self.clock.during("checkpoint"):
            self.learner.save_checkpoint(str(path))
        return self.driver_state()

    def restore(self, path: Path | None, state: dict[str, Any]) -> None:
        """Load a checkpoint (None: the initial models, as built) and bring every generator to
        its policy version (``Fleet.restart``), the fleet paused meanwhile."""
        with self.fleet.paused():
            self._restore(path, state)

    def _restore(self, path: Path | None, state: dict[str, Any]) -> None:
        """``restore`` inside a pause the caller holds (a learner restart holds it longer)."""
        with self.clock.during("restore"):
            version = self.learner.load_checkpoint(str(path)) if path is not None else 0
            check_pairing(path, version, state)
            self._load_driver_state(state)
            self.fleet.restart(version)

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
        with self.fleet.paused():  # before the learner goes: nothing may read its weights meanwhile
            self.supervisor.count_restart(str(failure), LearnerFailedError, hint)
            start = time.perf_counter()
            self.learner.rebuild()
            self.calls.learner_rebuilt()
            self._restore(checkpoint, read_driver_state(checkpoint) if checkpoint else self._initial_state)
        self.learner_restarts += 1
        log.warning("%s: learner group restarted from %s in %.1f s (%s); redoing iterations from %d", failure,
                    checkpoint or "the initial models", time.perf_counter() - start, self.supervisor.budget_text(),
                    self.iteration_count)
        return self.iteration_count

    def close(self) -> None:
        """Kill every actor, then end the Ray session if this trainer started it. The threads that
        sample ahead are told to stop first (the errors of the actors killed next end them quietly)
        and joined before Ray ends: Ray ends the whole process (exit 1, no message on the
        terminal) when a thread calls into it after ``ray.shutdown``."""
        if self.sampler is not None:
            self.sampler.stop()
        self.supervisor.close()  # an actor killed under a call in flight is not replaced
        for group in ("generators", "reference", "rewards", "teacher", "learner"):
            if hasattr(self, group):
                getattr(self, group).kill()
        if self.sampler is not None:
            self.sampler.close()
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
