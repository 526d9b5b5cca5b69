"""The learn step: one PPO update on a scored rollout, the same code in every trainer.

The in-process trainer calls ``learn`` on the whole batch; each rank of the distributed learner
calls it on the rows it owns (``LearnerEngine.train``), the collective making the statistics
global. One step is:

    minibatch plan (the same on every rank)  -> this rank's minibatches    (update.py)
    values, shaped rewards, advantages, whitening, log pi_prox           (experience.py)
    M epochs x minibatches of clipped PPO + value loss, the mismatch guard on the first  (update.py)

Its settings are read from the config once (``LearnSettings.of``); what changes per call (the
rows, beta, the iteration, the policy's version) are arguments.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from rayppo.config.schema import Config, PPOConfig
from rayppo.data.rollout import Rollout
from rayppo.data.seeds import minibatch_seed
from rayppo.learner.collective import Collective
from rayppo.learner.experience import Experience, ExperienceSettings, ProximalPolicy, make_experience
from rayppo.learner.guard import MismatchGuard
from rayppo.learner.rollout_tensors import RolloutTensors
from rayppo.learner.update import Minibatch, Steps, first_rows_kept, local_minibatches, minibatch_plan, ppo_update
from rayppo.models.packing import cut_layout


@dataclass(frozen=True)
class LearnSettings:
    """What the learn step reads from the config, gathered once."""

    experience: ExperienceSettings
    """The experience pass's: estimator, truncation rule, staleness, micro-batches, rollout correction."""
    seed: int
    """The run's seed; the minibatch plan of iteration i uses ``minibatch_seed(seed, i)``."""
    temperature: float
    """T of log_softmax(logits / T), the sampling distribution the generators used."""
    max_new_tokens: int
    """L_max (``rollout.max_new_tokens``): the loss aggregations that normalise by a fixed length."""
    config: Config
    """The whole config, for the mismatch guard's per-dtype bounds (``MismatchGuard.of``)."""

    @property
    def ppo(self) -> PPOConfig:
        """The update's section (epochs, minibatches, estimator, clipping, learning rates)."""
        return self.experience.ppo

    @staticmethod
    def of(cfg: Config) -> "LearnSettings":
        return LearnSettings(experience=ExperienceSettings.of(cfg), seed=cfg.seed, temperature=cfg.rollout.temperature,
                             max_new_tokens=cfg.rollout.max_new_tokens, config=cfg)


@dataclass
class LearnerModels:
    """The trained models of one process and how to step them."""

    policy: torch.nn.Module
    """pi_theta (a DeepSpeed engine on a learner rank, the plain module in-process)."""
    critic: torch.nn.Module | None
    """V_w, or None under a critic-free estimator."""
    steps: Steps
    """Backward of each model, then the optimiser step of both."""
    collective: Collective
    """All-reduces across the learner ranks (``LocalCollective`` in one process)."""
    device: torch.device | str
    pad_id: int
    """The tokenizer's padding id."""
    pack_mode: str = ""
    """Sequence packing of the learner's forward passes (``models/packing.py``; "": padded rows)."""


def learn(models: LearnerModels, rollout: Rollout, rows: list[int], batch_size: int, kl_coef: float, iteration: int,
          version: int, settings: LearnSettings) -> tuple[dict[str, float], Experience]:
    """One PPO update on ``rollout``, which holds the global rows ``rows`` (ascending) of a batch
    of ``batch_size`` rows; returns the update's metrics and the experience it trained on.

    ``version`` is the policy's version before the update: rows of that version were sampled by
    pi_prox itself (asynchronous mode). Collective: every rank calls it in the same iteration.
    """
    p = settings.ppo
    plan = minibatch_plan(batch_size, p.epochs, p.minibatches, seed=minibatch_seed(settings.seed, iteration))
    def planned(keep: list[float] | None = None) -> list[Minibatch]:
        return local_minibatches(plan, torch.tensor(rows, dtype=torch.long), rollout.lengths(), models.collective,
                                 settings.experience.micro_batch_tokens, cut_layout(models.pack_mode),
                                 trained=rollout.trained_tokens(), keep=keep)

    minibatches = planned()
    # pi_prox: these weights, before this update's first step (asynchronous mode, rollout correction).
    proximal = ProximalPolicy(models.policy, settings.temperature, version)
    tensors = dataclasses.replace(RolloutTensors.of(rollout, models.pad_id, models.device, models.pack_mode),
                                  num_groups=batch_size, first_rows=first_rows_kept(minibatches))
    exp, stats = make_experience(tensors, models.critic, kl_coef, settings.experience, models.collective, proximal)
    if exp.row_keep is not None:  # rows the geometric-mean mask dropped count in no share (same rows and cuts)
        minibatches = planned(exp.row_keep.tolist())
    guard = MismatchGuard.of(settings.config, iteration)
    stats |= ppo_update(models.policy, models.critic, exp, minibatches, p, settings.temperature, models.steps,
                        models.collective, guard, settings.max_new_tokens)
    return stats, exp
