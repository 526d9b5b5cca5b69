"""The learn step's modes, decided once: where pi_prox comes from, which loss, where the KL (to the
reference, and to a distillation teacher) enters,
which value targets, whether the first minibatch reuses the experience pass's value forward.

Each mode follows from the settings (``LearnSettings``: estimator, staleness, rollout correction,
KL mode) and the batch (a reference or not, beta, the minibatch cut, stale tokens). ``decide``
makes them one frozen ``UpdatePlan`` before any pass runs; the experience pass
(``make_experience``) and the update (``ppo_update``, ``one_forward_update``) read the plan and
decide nothing again. The step gathers the facts (``step.py``), the one-forward rule is
``proximal.fused_proximal``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from rayppo.config.schema import PPOConfig
from rayppo.learner import ppo
from rayppo.learner.guard import MismatchGuard
from rayppo.learner.learn_settings import LearnSettings, StepInputs
from rayppo.learner.rollout_tensors import RolloutTensors

ProximalSource = Literal["behaviour", "pass", "update"]
"""Where log pi_prox, the policy the update improves, comes from:

- ``behaviour``: pi_prox is pi_old = mu, the generator's log-probs (lock-step without rollout
  correction): nothing is recomputed.
- ``pass``: one forward without gradient over every row, at the learner's weights before the update
  (``experience_passes.proximal_logprobs``; asynchronous mode, rollout correction).
- ``update``: the update's one forward, detached (``proximal.fused_proximal`` holds): the experience
  leaves out what depends on pi_prox, and ``update.one_forward_update`` makes it before the loss."""


@dataclass(frozen=True)
class UpdatePlan:
    """How this step's experience pass and update run: every mode, decided once (``decide``)."""

    settings: LearnSettings
    """What the config set (estimator, discount, clipping, truncation, micro-batches, temperature)."""
    proximal: ProximalSource
    """Where log pi_prox comes from. Anything but ``behaviour``: mu and pi_prox differ, the sync
    check compares them on the tokens of the learner's version (``update.same_version_mismatch``),
    and the off-policy figures are reported; ``behaviour``: the check compares the first
    minibatch's log-probs with mu."""
    decoupled: bool
    """Which policy loss: the decoupled one, trust region around pi_prox and truncated importance
    weights min(pi_prox / mu, is_clip) (rollout correction ``tis``, ``tis+geo_mask``); False: the
    clipped loss against mu = pi_old, in asynchronous mode under ``rollout_correction=none`` too."""
    geo_mask: bool
    """Rows whose geometric-mean ratio pi_prox / mu leaves the band are dropped (``ppo.geometric_mean_mask``)."""
    reward_kl_coef: float
    """beta of the reward's KL term -beta KL_t (``kl_mode=reward``; KL 0 without a reference); 0 otherwise."""
    loss_kl_coef: float
    """beta of the loss's KL term beta agg(k3(log pi_theta, log pi_ref)) (``kl_mode=loss`` with a
    reference); 0 otherwise."""
    distill_reward_coef: float
    """lambda_T of the distillation rewards -lambda_T k(log pi, log pi_T) in the advantages
    (``distill.mode=reward`` with teacher log-probs); 0 otherwise."""
    distill_loss_coef: float
    """lambda_T of the loss term lambda_T agg(k(log pi_theta, log pi_T)) (``distill.mode=loss``); 0 otherwise."""
    has_reference: bool
    """log pi_ref was given (a reference model, or the LoRA policy's base): ``kl/*`` is reported."""
    vtrace: bool
    """Value targets: V-trace over the stale tokens (asynchronous mode, ``value_targets=vtrace``;
    ``ppo.compute_offpolicy_targets``); False: GAE's."""
    first_rows: torch.Tensor | None
    """[b] long: this rank's rows of the first minibatch, whose critic forward the experience pass
    runs last and with its graph, the update reusing it as that minibatch's value forward (the
    critic's weights have not moved yet). None: no critic, or the first minibatch is cut into
    micro-batches (``minibatches.first_rows_kept``): each micro-batch runs its own."""
    surrogate: ppo.Surrogate
    """The clipped loss's constants: clip range, aggregation, L_max."""
    guard: MismatchGuard | None
    """The log-prob check before the first optimiser step (None: not checked)."""

    @property
    def ppo(self) -> PPOConfig:
        """The update's section of the config (coefficients, clip ranges, estimator)."""
        return self.settings.ppo

    @staticmethod
    def decide(settings: LearnSettings, step: StepInputs, rows: RolloutTensors, first_rows: torch.Tensor | None = None,
               one_forward: bool = False) -> UpdatePlan:
        """The plan of a step on ``rows`` (this rank's; every input is the same on every rank, so all
        ranks decide alike). ``first_rows``: the first minibatch's rows when their value forward is
        reused; ``one_forward``: pi_prox is the update's own forward (``proximal.fused_proximal``,
        and no stale token), which only matters where pi_prox is used at all."""
        e, p = settings.experience, settings.ppo
        # pi_prox differs from mu in asynchronous mode (staleness) and under rollout correction (numerics).
        uses_prox = e.max_staleness > 0 or e.correction.truncated_is
        proximal: ProximalSource = "behaviour" if not uses_prox else "update" if one_forward else "pass"
        has_reference = rows.ref_logprobs is not None
        if e.distill.coef and rows.teacher_logprobs is None:
            raise ValueError("distill.teacher is set, but the rollout has no teacher_logprobs (no teacher pass ran)")
        if e.distill.topk and rows.teacher_top_logprobs is None:
            raise ValueError("distill.topk is set, but the rollout has no teacher_top_logprobs (the teacher ran without it)")
        return UpdatePlan(
            settings=settings, proximal=proximal, decoupled=e.correction.truncated_is, geo_mask=e.correction.geo_mask,
            reward_kl_coef=step.kl_coef if p.kl_mode == "reward" else 0.0,
            loss_kl_coef=step.kl_coef if p.kl_mode == "loss" and has_reference else 0.0,
            distill_reward_coef=e.distill.coef if e.distill.mode == "reward" else 0.0,
            distill_loss_coef=e.distill.coef if e.distill.mode == "loss" else 0.0,
            has_reference=has_reference,
            # Lock-step rows are never stale: only asynchronous mode has ratios to correct the targets for.
            vtrace=e.max_staleness > 0 and p.value_targets == "vtrace",
            first_rows=first_rows,
            surrogate=ppo.Surrogate(p.clip_eps, p.clip_eps_high, p.loss_agg, settings.max_new_tokens),
            guard=settings.guard.at(step.iteration))
