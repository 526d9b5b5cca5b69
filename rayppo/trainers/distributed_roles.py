"""The distributed roles' calls an iteration makes: a batch sampled by the fleet, scored by the
reference, reward and teacher actors, under the ``Supervisor`` (a dead or hung actor is replaced and its
share redone). Every rollout source and the evaluation call them; none knows another's."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from rayppo.actors.generator import GeneratorEngine
from rayppo.actors.reference import ReferenceEngine
from rayppo.actors.reward import RewardEngine
from rayppo.actors.teacher import TeacherEngine
from rayppo.cluster.colocation import DeviceSchedule
from rayppo.cluster.fleet import Fleet
from rayppo.cluster.group import ActorGroup
from rayppo.cluster.learner_group import LearnerGroup
from rayppo.cluster.shares import ShareCall, sampled_shares
from rayppo.cluster.supervisor import Fanout, Supervisor
from rayppo.cluster.weight_sync import BroadcastSync, IpcSync, ObjectStoreSync, make_weight_sync, verify_sync
from rayppo.config.schema import Config
from rayppo.data.prompts import PromptBatch
from rayppo.data.rollout import Rollout, TeacherScores, split_evenly
from rayppo.machine.role_resources import Engine
from rayppo.run.stage_times import ScoringSeconds
from rayppo.trainers.iteration import group_shares

T = TypeVar("T")


@dataclass
class DistributedRoles:
    """The actor groups of a distributed run and the calls the iteration makes on them."""

    cfg: Config
    generators: ActorGroup
    reference: ActorGroup
    rewards: ActorGroup
    teacher: ActorGroup
    """The distillation teacher's actors (``distill.teacher``); empty without one."""
    learner: LearnerGroup
    supervisor: Supervisor
    fleet: Fleet
    schedule: DeviceSchedule
    weight_sync: ObjectStoreSync | BroadcastSync | IpcSync = field(init=False)
    """How rank 0's weights reach the generators (``learner.weight_sync``); a new one after a
    learner restart (``learner_rebuilt``)."""

    def __post_init__(self) -> None:
        self.weight_sync = self._new_weight_sync()

    def learner_rebuilt(self) -> None:
        """The learner group's ranks were started again (``DistributedTrainer.recover``): the weights
        go from the new ones (a broadcast forms its group with them)."""
        self.weight_sync = self._new_weight_sync()

    def _new_weight_sync(self) -> ObjectStoreSync | BroadcastSync | IpcSync:
        return make_weight_sync(self.cfg, self.learner, self.generators, self.supervisor, self.fleet)

    def generate(self, prompts: PromptBatch, seed: int) -> Rollout:
        """Each generator of the fleet samples its share of the prompts, in groups (``group_shares``);
        a row's noise is its group's and place's (``sample_seeds``), whichever generator draws it."""
        n = self.cfg.rollout.samples_per_prompt
        return self.sample(GeneratorEngine.generate, lambda g: group_shares(prompts, g, n), seed)

    def sample(self, method: Callable[..., Rollout], split: Callable[[int], list[PromptBatch]], seed: int,
               *options: Any) -> Rollout:
        """``method`` (generate or evaluate) on each generator of the fleet with its share of the
        prompts (``split(generators)``), ``options`` and the call's seed (last; each row's noise
        follows from it and the row's group, ``sample_seeds``). A generator that dies or hangs is
        replaced, given the current weights, and samples its share again. When one leaves the fleet
        meanwhile, the other shares are kept and only the lost one is split again over the
        generators left (``cluster/shares.py``, ``PromptBatch.whole_groups``)."""
        shares = split(len(self.fleet.active))
        call = ShareCall(method, (*options, seed), self.weight_sync.refresh)
        return Rollout.concat(sampled_shares(self.supervisor, self.fleet, call, shares, PromptBatch.whole_groups))

    def on_generator(self, g: int, method: Callable[..., T], args: tuple[Any, ...],
                     refresh: Callable[[int], None]) -> T:
        """``method`` on generator ``g`` alone (the pipeline drives each on its own), replaced and
        redone by the supervisor when it dies or hangs, ``refresh`` bringing its replacement up to date."""
        return self.supervisor.call_one(self.generators, "generators", g, method, args, refresh=refresh)

    def scored_by_reward(self, rollout: Rollout) -> Rollout:
        """``rollout`` with r_phi of every row (the reward pass alone)."""
        (score,) = self.reward_scores([rollout])
        return rollout.scored(score)

    def reward_scores(self, rollouts: list[Rollout]) -> list[list[float]]:
        """r_phi of each rollout's rows (the reward pass alone); 0 when nothing but an environment
        rewards them."""
        if not len(self.rewards):
            return [[0.0] * len(r) for r in rollouts]
        return [[x for part in parts for x in part] for parts in self.supervisor.run([self._reward_pass(r) for r in rollouts])]

    def gold_scores(self, rollout: Rollout) -> list[float]:
        """The gold scorer's scores of ``rollout``'s rows (``reward.gold_function``); [] without one."""
        if not (self.cfg.reward.gold_function and len(self.rewards)):
            return []
        (parts,) = self.supervisor.run([self._reward_pass(rollout, RewardEngine.gold_scores)])
        return [x for part in parts for x in part]

    def _reward_pass(self, rollout: Rollout, method: Callable[..., list[float]] = RewardEngine.scores) -> Fanout:
        """r_phi (or, ``RewardEngine.gold_scores``, the gold scorer's score) of ``rollout``'s rows,
        split across the reward actors."""
        rows = split_evenly(len(rollout), len(self.rewards))
        role = "reward" if method is RewardEngine.scores else "gold"
        return Fanout(self.rewards, role, method, [(rollout.select(r),) for r in rows])

    def score(self, rollout: Rollout) -> tuple[Rollout, ScoringSeconds]:
        """log pi_ref, r_phi and log pi_T, the passes running at the same time on their own actors
        (log pi_ref only when a reference runs, ppo.kl_coef > 0; log pi_T with a distillation
        teacher); the gold score too with ``reward.gold_function``."""
        if not len(self.rewards):  # an environment's turn rewards are the whole reward
            rollout = rollout.scored([0.0] * len(rollout))
        scored = len(rollout.score) == len(rollout)  # dynamic sampling has rewarded it already
        passes = [] if scored else [self._reward_pass(rollout)]
        if self.cfg.reward.gold_function and len(self.rewards):
            passes.append(self._reward_pass(rollout, RewardEngine.gold_scores))
        if len(self.reference):
            ref_rows = split_evenly(len(rollout), len(self.reference))
            passes.append(Fanout(self.reference, "reference", ReferenceEngine.ref_logprobs,
                                 [(rollout.select(r),) for r in ref_rows]))
        if len(self.teacher):
            passes.append(Fanout(self.teacher, "teacher", TeacherEngine.teacher_logprobs,
                                 [(rollout.select(r),) for r in split_evenly(len(rollout), len(self.teacher))]))
        parts = dict(zip((p.role for p in passes), self.supervisor.run(passes)))  # at the same time; failed shares redone
        score = [x for part in parts["reward"] for x in part] if "reward" in parts else rollout.score
        gold = [x for part in parts["gold"] for x in part] if "gold" in parts else None
        teacher = TeacherScores.concat(parts["teacher"]) if "teacher" in parts else None
        rollout = rollout.scored(score, [x for part in parts.get("reference", []) for x in part], gold, teacher)
        seconds = {p.role: p.seconds for p in passes}  # a pass that did not run took none
        return rollout, ScoringSeconds(reference=seconds.get("reference", 0.0), reward=seconds.get("reward", 0.0),
                                       teacher=seconds.get("teacher"))

    def teacher_held_out(self, prompts: PromptBatch, temperature: float, samples: int, seed: int) -> Rollout:
        """The teacher's own responses to the held-out prompts (``TeacherEngine.evaluate``, on its first
        actor, replaced and redone when it dies), for its score beside the student's."""
        return self.supervisor.call_one(self.teacher, "teacher", 0, TeacherEngine.evaluate,
                                        (prompts, temperature, samples, seed))

    def verify(self, version: int, generators: list[int] | None = None) -> float:
        """The guard's check of ``generators``' weights (default: the fleet's) after a sync
        (``verify_sync``); made again over the generators left when one leaves the fleet."""
        if generators is not None:
            return verify_sync(self.learner, self.generators, version, self.supervisor, self.weight_sync.refresh,
                               generators)
        return self.fleet.on_active(lambda active: verify_sync(self.learner, self.generators, version,
                                                               self.supervisor, self.weight_sync.refresh, active))

    def groups(self) -> dict[str, ActorGroup]:
        """Each role's actor group, by role."""
        return {"generators": self.generators, "reference": self.reference, "reward": self.rewards,
                "teacher": self.teacher, "learner": self.learner.ranks}

    def peak_memory(self) -> dict[str, int]:
        """Peak resident memory (bytes) of the largest process of each role."""
        groups = self.groups()
        actors = {role: list(self.fleet.active) if role == "generators" else list(range(len(group)))
                  for role, group in groups.items()}  # a generator waiting for a place answers nothing
        return {role: max(m["rss"] for m in group.get([group.call_at(i, Engine.peak_memory_bytes, ())
                                                       for i in actors[role]]))
                for role, group in groups.items() if actors[role]}
