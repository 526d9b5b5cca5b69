"""What the learn step reads from the config, gathered once, and what changes from one step to the next.

``LearnSettings.of`` reads a ``Config`` once, where a trainer or a learner rank is built; from then
on the learner sees only these fields (the whole ``Config`` never reaches it). ``StepInputs`` is
what each call brings. The two, with the batch, decide the step's ``UpdatePlan``
(``update_plan.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from rayppo.choices import DistillMode, KLEstimator, Truncation
from rayppo.config.derived import NO_CORRECTION, Correction, reference_in_learner, rollout_correction, truncation_mode
from rayppo.config.schema import Config, PPOConfig
from rayppo.learner.guard import GuardBounds
from rayppo.learner.lr_schedule import lr_factor


@dataclass(frozen=True)
class TruncationRule:
    """How a response's length enters its reward: rows cut at the limit (``rollout.truncation``)
    and DAPO's overlong shaping (``rollout.overlong_buffer``)."""

    mode: Truncation = "bootstrap"
    """``bootstrap``: no score, GAE bootstrapped with V(S_T). ``terminal``: score, bootstrap 0."""
    missing_eos_penalty: float = 0.0
    """Subtracted from a cut row's score under ``terminal``."""
    max_new_tokens: int = 0
    """L_max, the response length limit (``rollout.max_new_tokens``)."""
    overlong_buffer: int = 0
    """L: the last tokens before L_max over which the score ramps down to -``overlong_penalty`` (0: off)."""
    overlong_penalty: float = 1.0
    """The score lost at L_max under ``overlong_buffer``."""

    @staticmethod
    def of(cfg: Config) -> TruncationRule:
        r = cfg.rollout
        return TruncationRule(mode=truncation_mode(cfg), missing_eos_penalty=r.missing_eos_penalty,
                              max_new_tokens=r.max_new_tokens, overlong_buffer=r.overlong_buffer,
                              overlong_penalty=r.overlong_penalty)


@dataclass(frozen=True)
class DistillTerm:
    """The reverse KL to a distillation teacher (``distill``; docs/distillation.md), resolved."""

    mode: DistillMode = "reward"
    """``reward``: -coef k_t joins token t's advantage; ``loss``: coef agg(k_t) joins the policy loss."""
    coef: float = 0.0
    """lambda_T (``distill.coef``); 0: no teacher, no term."""
    gamma: float = 0.0
    """The discount of the distillation rewards in the advantage (``mode=reward``)."""
    estimator: KLEstimator = "k1"
    """k_t's estimator, ``auto`` resolved: k1 for the reward, k2 for the loss."""
    task_reward: float = 1.0
    """The task reward's weight in training (``distill.task_reward``; 0: pure distillation)."""
    center: bool = False
    """Subtract the global batch's mean D_t (``distill.center``)."""
    topk: int = 0
    """k > 0: the loss term is the reverse KL over the teacher's top k tokens and the rest (``distill.topk``)."""

    @staticmethod
    def of(cfg: Config) -> DistillTerm:
        d = cfg.distill
        if d.teacher is None:
            return DistillTerm()
        estimator: KLEstimator = ("k1" if d.mode == "reward" else "k2") if d.estimator == "auto" else d.estimator
        return DistillTerm(d.mode, d.coef, d.gamma, estimator, d.task_reward, d.center, d.topk)


@dataclass(frozen=True)
class ExperienceSettings:
    """What the experience pass reads from the config, gathered once (``of``)."""

    ppo: PPOConfig
    """Estimator, KL mode and estimator, discount, whitening, off-policy targets, ``minibatches``
    (the chunks of the log pi_prox pass without a token budget)."""
    truncation: TruncationRule = TruncationRule()
    """How a response's length enters its reward."""
    max_staleness: int = 0
    """k: how many versions a row may lag the learner (``rollout.max_staleness``; 0: lock-step)."""
    micro_batch_tokens: int = 0
    """Padded tokens per forward pass without gradient (``learner.micro_batch_tokens``; 0: unbucketed)."""
    correction: Correction = NO_CORRECTION
    """Rollout correction in force (``config.derived.rollout_correction``)."""
    distill: DistillTerm = DistillTerm()
    """The reverse KL to the distillation teacher, where there is one."""

    @staticmethod
    def of(cfg: Config) -> ExperienceSettings:
        return ExperienceSettings(ppo=cfg.ppo, truncation=TruncationRule.of(cfg),
                                  max_staleness=cfg.rollout.max_staleness,
                                  micro_batch_tokens=cfg.learner.micro_batch_tokens,
                                  correction=rollout_correction(cfg.ppo, cfg.model.dtype, cfg.rollout.max_staleness),
                                  distill=DistillTerm.of(cfg))


@dataclass(frozen=True)
class LearnSettings:
    """What the learn step reads from the config, gathered once (``of``). The defaults are a
    test's: seed 0, T = 1, no length constant, no log-prob check, the reference loaded apart."""

    experience: ExperienceSettings
    """The experience pass's: estimator, truncation rule, staleness, micro-batches, rollout correction."""
    seed: int = 0
    """The run's seed; the minibatch plan of iteration i uses ``minibatch_seed(seed, i)``."""
    temperature: float = 1.0
    """T of log_softmax(logits / T), the sampling distribution the generators used."""
    max_new_tokens: int = 0
    """L_max (``rollout.max_new_tokens``): the loss aggregations that normalise by a fixed length."""
    guard: GuardBounds = GuardBounds()
    """The log-prob check's bounds (per ``model.dtype``; ``checks.*``)."""
    reference_from_base: bool = False
    """log pi_ref is the policy's own with its LoRA adapter off (``config.derived.reference_in_learner``)."""
    iterations: int = 1
    """N, the run's ``stop.iterations``: the learning-rate schedule's horizon (``lr_schedule.py``)."""

    def lr_factor(self, iteration: int) -> float:
        """The factor of the configured learning rates at ``iteration`` (``ppo.lr_schedule``)."""
        p = self.ppo
        return lr_factor(iteration, self.iterations, p.lr_schedule, p.lr_warmup, p.lr_end)

    @property
    def ppo(self) -> PPOConfig:
        """The update's section (epochs, minibatches, estimator, clipping, learning rates)."""
        return self.experience.ppo

    @staticmethod
    def of(cfg: Config) -> LearnSettings:
        return LearnSettings(experience=ExperienceSettings.of(cfg), seed=cfg.seed, temperature=cfg.rollout.temperature,
                             max_new_tokens=cfg.rollout.max_new_tokens, guard=GuardBounds.of(cfg),
                             reference_from_base=reference_in_learner(cfg), iterations=cfg.stop.iterations)


@dataclass(frozen=True)
class StepInputs:
    """What changes from one learn step to the next."""

    iteration: int
    """Seeds the minibatch plan (``minibatch_seed``); the guard names it in its reports."""
    version: int
    """The policy's version before the update: rows of that version were sampled by pi_prox
    itself (asynchronous mode)."""
    kl_coef: float
    """beta, the KL controller's current value."""
