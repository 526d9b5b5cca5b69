"""The learner's half of an iteration, first part: a scored rollout -> the tensors PPO needs.

``make_experience`` computes values, shaped rewards, advantages and returns, and whitens the
advantages over the global batch, as the step's ``UpdatePlan`` says (where pi_prox comes from,
where the KL enters, which value targets); the forwards are ``experience_passes``', the
estimators ``advantages``', the arithmetic ``rayppo.learner.ppo``'s. The PPO epochs that follow are
``rayppo.learner.update``.

Asynchronous mode (``rollout.max_staleness`` = k > 0, docs/async.md, "Off-policy corrections"): rows
may come from a behaviour policy mu up to k versions older than the learner. ``make_experience``
then recomputes log pi_prox once with the learner's weights at the start of the update, shapes
the reward's KL term with it, and computes V-trace targets; the update uses the decoupled
policy loss under rollout correction (else the clipped one against mu) and measures
``logprob_mismatch`` only on the rows sampled by the learner's version.
With k = 0 both run exactly the synchronous iteration. Where pi_prox is the update's own forward
(``UpdatePlan.proximal == "update"``) no pass runs here, and the experience leaves out what
depends on pi_prox: ``update.one_forward_update`` makes a completed one.

The learn step (``step.py``) calls it in the in-process trainer and on every learner rank, on the
rollout made tensors once (``RolloutTensors``). A rank holds a shard of the rollout's rows; a
``Collective`` sums across ranks, so that advantage whitening uses the global batch and each
minibatch's loss is the global token mean: with N ranks the update is the one a single process
would make.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from rayppo.choices import KLEstimator
from rayppo.learner import action_tokens, ppo
from rayppo.learner.advantages import EstimatorInputs, episode_advantages
from rayppo.learner.collective import Collective, LocalCollective
from rayppo.learner.experience_passes import ProximalPolicy, critic_values, proximal_logprobs
from rayppo.learner.experience_stats import PolicyTokens, proximal_terms, value_stats
from rayppo.learner.learn_settings import TruncationRule
from rayppo.learner.rewards import overlong_penalty
from rayppo.learner.rollout_tensors import RolloutTensors
from rayppo.learner.update_plan import UpdatePlan
from rayppo.models.sequences import PackedBatch


@dataclass(frozen=True)
class Experience:
    """Everything one PPO update needs, for B responses of up to T tokens: data only (no autograd
    graph), complete when built; a later stage that knows more makes a new one (``dataclasses.replace``)."""

    batch: PackedBatch
    """Token tensors: prompt | response layout, ``batch.mask`` [B, T]."""
    old_logprobs: torch.Tensor
    """[B, T] log pi_old(y_t | S_{t-1}) reported by the generator: the behaviour policy mu that
    sampled the row (in asynchronous mode possibly older than the learner's weights)."""
    ref_logprobs: torch.Tensor
    """[B, T] log pi_ref(y_t | S_{t-1})."""
    teacher_logprobs: torch.Tensor | None
    """[B, T] log pi_T(y_t | S_{t-1}) of the distillation teacher (the loss term of
    ``distill.mode=loss`` reads it); None without a teacher."""
    teacher_top_ids: torch.Tensor | None
    """[B, T, k] long: the teacher's k most likely tokens j at each position (``distill.topk``); None without."""
    teacher_top_logprobs: torch.Tensor | None
    """[B, T, k] log pi_T(j | S_{t-1}) of those tokens: the top-k loss term reads them; None without."""
    old_values: torch.Tensor
    """[B, T] V_old(S_{t-1}) before the update."""
    rewards: torch.Tensor
    """[B, T] shaped rewards r_t = -beta KL_t (+ r_phi on the last token of rows that earned it)."""
    advantages: torch.Tensor
    """[B, T] A_t of ``ppo.advantage``: GAE (whitened when configured), or a group estimator's
    sequence advantage A_i on every valid token of row i, or REINFORCE++'s whitened returns; plus
    the distillation advantage D_t (``distill.mode=reward``, not whitened: lambda_T sets its scale)."""
    returns: torch.Tensor
    """[B, T] value targets A_t + V_old(S_{t-1}) (before whitening); 0 without a critic."""
    scores: torch.Tensor
    """[B] r_phi(x, y) (logged whole; a cut row's enters ``rewards`` only under ``terminal``)."""
    generator_ids: torch.Tensor
    """[B] long: the generator that sampled each row (named by the correctness guard)."""
    prox_logprobs: torch.Tensor | None = None
    """[B, T] log pi_prox(y_t | S_{t-1}): the learner's weights at the start of this update, without
    gradient (0 on padding). Asynchronous mode and rollout correction only; None where pi_prox is
    pi_old (``UpdatePlan.proximal``), and where it is the update's own forward
    (``proximal == "update"``: ``one_forward_update`` returns a record with it set)."""
    same_version: torch.Tensor | None = None
    """[B, T] bool: the token was sampled by pi_prox's version, so mu = pi_prox and their log-probs
    must agree up to rounding (the tokens ``logprob_mismatch`` compares; a row continued across
    generator calls can have both kinds). Asynchronous mode only."""
    row_keep: torch.Tensor | None = None
    """[B] 1.0 for rows the update trains on, 0.0 for rows the geometric-mean mask of rollout
    correction dropped (``ppo.geometric_mean_mask``); None: every row. A dropped row is out of every
    term (policy, entropy, KL loss, critic) and every normaliser and metric: ``trained_mask``."""
    kl_ref: float | None = None
    """Mean KL(pi || pi_ref) per response over the global batch (``ReferenceKL.mean``, logged as
    ``kl/ref_mean``), pi being the policy improved (pi_old, or pi_prox); None without a reference."""

    @property
    def trained_mask(self) -> torch.Tensor:
        """[B, T] the valid tokens of the rows the update trains on (``batch.mask`` without the rows
        ``row_keep`` dropped): the mask every loss term, normaliser and metric of the update reads."""
        mask = self.batch.mask
        return mask if self.row_keep is None else mask * self.row_keep.to(mask.dtype).unsqueeze(-1)

    def trained_targets(self, with_returns: bool) -> tuple[list[list[float]], list[list[float]]]:
        """``(advantages, returns)`` per row over its valid tokens (``Rollout.advantages``, ``.returns``);
        returns empty when ``with_returns`` is False (no critic)."""
        lengths = self.batch.token_mask.sum(-1).long().tolist()
        advantages = [row[:n].tolist() for row, n in zip(self.advantages.float().cpu(), lengths)]
        returns = [row[:n].tolist() for row, n in zip(self.returns.float().cpu(), lengths)] if with_returns else []
        return advantages, returns

    def rows(self, index: torch.Tensor) -> Experience:
        """The sub-experience of the given rows."""
        picked: dict[str, Any] = {name: getattr(self, name) for name in TOKEN_FIELDS + ROW_FIELDS}
        cut: dict[str, Any] = {name: None if t is None else t[index] for name, t in picked.items()}
        return dataclasses.replace(self, batch=self.batch.rows(index), **cut)

    def micro(self, index: torch.Tensor) -> Experience:
        """The rows of one micro-batch, cut to their own widths (``PackedBatch.trimmed``): the
        forward pass then processes their tokens, not the padding of the batch's longest row."""
        part = self.rows(index)
        batch = part.batch.trimmed()
        width = batch.mask.shape[1]
        cut = {name: getattr(part, name)[:, :width] for name in TOKEN_FIELDS if getattr(part, name) is not None}
        return dataclasses.replace(part, batch=batch, **cut)


TOKEN_FIELDS = ("old_logprobs", "ref_logprobs", "teacher_logprobs", "teacher_top_ids", "teacher_top_logprobs",
                "old_values", "rewards", "advantages", "returns", "prox_logprobs", "same_version")
"""The ``[B, T]`` (and ``[B, T, k]``) fields of an ``Experience`` (cut with the response columns)."""

ROW_FIELDS = ("scores", "generator_ids", "row_keep")
"""The ``[B]`` fields of an ``Experience``."""


def check_staleness(versions: Sequence[int], learner_version: int, max_staleness: int) -> None:
    """Refuse rows the learner must not train on: ``RuntimeError`` naming their policy versions.

    A row sampled by version v is trainable when ``learner_version - max_staleness <= v <=
    learner_version``: with k = 0 (the synchronous iteration) only the learner's own version; in
    asynchronous mode up to k versions older. A newer row cannot come from this learner at all. The
    driver drops rows staler than k before sending (``async/dropped_rows``): this is the defensive check.
    """
    if max_staleness == 0:
        stale = {v for v in versions if v != learner_version}
        if stale:
            raise RuntimeError(f"on-policy PPO refuses a stale rollout: generated by policy version(s) "
                               f"{sorted(stale)}, learner is at version {learner_version}")
        return
    newer = sorted({v for v in versions if v > learner_version})
    older = sorted({v for v in versions if v < learner_version - max_staleness})
    if newer or older:
        what = [f"version(s) {newer} newer than the learner" if newer else "",
                f"version(s) {older} older than rollout.max_staleness={max_staleness} allows" if older else ""]
        raise RuntimeError(f"the learner at policy version {learner_version} accepts rows of versions "
                           f"{learner_version - max_staleness}..{learner_version} (rollout.max_staleness="
                           f"{max_staleness}); this rollout has rows of " + " and ".join(w for w in what if w))


class ExperiencePass(NamedTuple):
    """What ``make_experience`` returns."""

    experience: Experience
    """The update's data."""
    stats: dict[str, float]
    """The figures of the pass (``kl/*``, ``offpolicy/*``, ``correction/*``, ``value/*``)."""
    first_values: torch.Tensor | None
    """[b, T] the first minibatch's critic forward, *with* its graph (``CriticValues.first_values``;
    ``UpdatePlan.first_rows``), for the update's first minibatch to take instead of its own: handed
    to ``ppo_update`` as it is, whose first backward frees it. None: not kept."""


class KLTerm(NamedTuple):
    """The reward's KL term, -beta KL_t on every token (``ppo.shape_rewards``)."""

    logprobs: torch.Tensor
    """[B, T] log pi of the policy being improved: pi_old (= mu) in lock-step, else pi_prox."""
    ref_logprobs: torch.Tensor
    """[B, T] log pi_ref (without a reference: ``logprobs`` itself, so KL_t = 0)."""
    coef: float
    """beta (``UpdatePlan.reward_kl_coef``: 0 when the KL enters the loss instead)."""
    estimator: KLEstimator
    """KL_t's estimator (``ppo.kl_estimator``)."""

    def shape(self, scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``ppo.shape_rewards`` of ``scores`` [B] with this term (``mask`` [B, T])."""
        return ppo.shape_rewards(scores, self.logprobs, self.ref_logprobs, mask, self.coef, self.estimator)


@torch.no_grad()
def make_experience(
    rows: RolloutTensors,
    critic: torch.nn.Module | None,
    plan: UpdatePlan,
    collective: Collective = LocalCollective(),
    proximal: ProximalPolicy | None = None,
) -> ExperiencePass:
    """Values, shaped rewards, advantages and returns, and (global) whitening for this rank's rows.

    ``critic`` None: a critic-free estimator (``plan.settings.ppo.advantage``), values 0. The KL is
    the reward's or the loss's (``plan.reward_kl_coef``, ``plan.loss_kl_coef``). Where pi_prox is
    not pi_old (``plan.proximal``: asynchronous mode, rollout correction) ``proximal`` (required
    then) gives log pi_prox, the policy being improved, which the reward's KL term uses instead of
    mu's; the targets are ``ppo.compute_offpolicy_targets``'s under ``plan.vtrace``; rows outside the
    geometric-mean band are masked under ``plan.geo_mask`` (``ppo.geo_mask_bound``). The critic
    forward of ``plan.first_rows`` is kept for the update (``ExperiencePass.first_values``); the group
    ids are below ``rows.num_groups`` on every rank. The forward passes without gradient (values,
    log pi_prox) run in micro-batches of ``learner.micro_batch_tokens`` padded tokens (0:
    unbucketed), packed as ``rows.batch.pack_mode`` says. A rollout without ``ref_logprobs``
    (kl_coef = 0: no reference was loaded) has no KL anywhere. ``plan.proximal == "update"``: no
    pi_prox pass runs; ``prox_logprobs``, ``row_keep``, ``kl_ref`` and the ``kl/*``, ``offpolicy/*``
    figures are left to ``update.one_forward_update``.
    """
    settings, cfg = plan.settings.experience, plan.ppo
    batch, mask, old_logprobs = rows.batch, rows.batch.mask, rows.old_logprobs
    prox_logprobs, same_version = _proximal_inputs(rows, plan, proximal, collective)
    # The KL term is of the policy being improved: pi_old (= mu) in lock-step, pi_prox otherwise
    # (one forward: the reward has no KL term, and the figures of pi_prox's come after the update's forward).
    policy_logprobs = old_logprobs if prox_logprobs is None else prox_logprobs
    ref_logprobs = policy_logprobs if rows.ref_logprobs is None else rows.ref_logprobs
    values = critic_values(critic, batch, plan.first_rows, settings.micro_batch_tokens, collective)
    kl = KLTerm(policy_logprobs, ref_logprobs, plan.reward_kl_coef, cfg.kl_estimator)
    rewards, bootstrap, task_scores = _shaped_rewards(rows, values.last_values, kl, settings.truncation)
    # The KL part of r_t alone (-beta KL_t): the group estimators keep it out of their statistics.
    kl_rewards = kl.shape(torch.zeros_like(rows.scores), mask)
    inputs = EstimatorInputs(rewards, kl_rewards, values.values, mask, bootstrap,
                             _stale_ratio(prox_logprobs, old_logprobs, mask, same_version) if plan.vtrace else None,
                             task_scores, rows.group_ids)
    advantages, returns = episode_advantages(inputs, cfg, rows.num_groups, collective, rows.episodes)
    # With a teacher: w A_t + D_t (w = distill.task_reward; 1 without one). The critic's targets stay the task's.
    advantages = settings.distill.task_reward * advantages + _distill_advantages(rows, policy_logprobs, plan,
                                                                                 collective)
    terms = (None if plan.proximal == "update" else
             proximal_terms(PolicyTokens(policy_logprobs, old_logprobs, rows.ref_logprobs, mask), plan, collective))
    stats = {} if terms is None else dict(terms.stats)
    if critic is not None:
        stats |= value_stats(values.values, returns, mask, collective)
    exp = Experience(batch=batch, old_logprobs=old_logprobs, ref_logprobs=ref_logprobs,
                     teacher_logprobs=rows.teacher_logprobs, teacher_top_ids=rows.teacher_top_ids,
                     teacher_top_logprobs=rows.teacher_top_logprobs, old_values=values.values,
                     rewards=rewards, advantages=advantages, returns=returns, scores=rows.scores,
                     generator_ids=rows.generator_ids, prox_logprobs=prox_logprobs, same_version=same_version,
                     row_keep=None if terms is None else terms.row_keep,
                     kl_ref=None if terms is None or terms.kl is None else terms.kl.mean)
    return ExperiencePass(exp, stats, values.first_values)


def _distill_advantages(rows: RolloutTensors, logprobs: torch.Tensor, plan: UpdatePlan,
                        collective: Collective) -> torch.Tensor:
    """``[B, T]`` D_t, the distillation rewards' reward-to-go (``ppo.distill_advantages``) with
    ``logprobs`` the policy being improved (as the reference's KL term: pi_prox where a pass computed
    it; where pi_prox is the update's own forward, lock-step only, the generator's log pi_old, equal up
    to rounding), less the global batch's mean with ``distill.center``; 0 unless ``distill.mode=reward``."""
    if not plan.distill_reward_coef or rows.teacher_logprobs is None:
        return torch.zeros_like(logprobs)
    term, mask = plan.settings.experience.distill, rows.batch.mask
    rewards = ppo.distill_rewards(logprobs, rows.teacher_logprobs, mask, plan.distill_reward_coef, term.estimator)
    advantages = ppo.distill_advantages(rewards, mask, term.gamma)
    if not term.center:
        return advantages
    # (sum, count) over every rank's valid tokens: the mean of the whole batch, as one process sees it.
    total = collective.sum(torch.stack([(advantages * mask).sum(), mask.sum().to(advantages.dtype)]))
    return (advantages - total[0] / total[1].clamp(min=1)) * mask


def _stale_ratio(prox_logprobs: torch.Tensor | None, old_logprobs: torch.Tensor, mask: torch.Tensor,
                 same_version: torch.Tensor | None) -> torch.Tensor:
    """``[B, T]`` log(pi_prox / mu) on the stale tokens, 0 elsewhere: V-trace's ratios.

    The value targets correct for staleness only: on tokens pi_prox's own version sampled the ratio
    is numerics (bf16), and V-trace's traces min(1, pi_prox / mu) would shrink the targets on noise
    alone (0.06 instead of 1 at token 0 of a 200-token row at |log ratio| ~ 0.03). pi_prox from the
    update's forward: no token is stale, so the ratio is 0 on every token, as the pass would have given."""
    if same_version is None:
        raise ValueError("V-trace targets need each token's version (asynchronous mode)")
    log_ratio = torch.zeros_like(old_logprobs) if prox_logprobs is None else (prox_logprobs - old_logprobs) * mask
    return log_ratio.masked_fill(same_version, 0.0)


def _proximal_inputs(rows: RolloutTensors, plan: UpdatePlan, proximal: ProximalPolicy | None,
                     collective: Collective) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(prox_logprobs [B, T], same_version [B, T] bool)`` where pi_prox is not pi_old (asynchronous
    mode; rollout correction, where every row is of the learner's version, mu its generator's
    numerics); ``(None, None)`` where it is (``plan.proximal == "behaviour"``). pi_prox from the
    update's forward: no pass runs and ``prox_logprobs`` is None."""
    if plan.proximal == "behaviour":
        return None, None
    settings, batch = plan.settings.experience, rows.batch
    if proximal is None:
        raise ValueError("asynchronous mode and rollout correction need the proximal policy pi_prox")
    if settings.max_staleness == 0:
        same_version = batch.mask.bool()
    elif rows.versions is None:
        raise ValueError(f"asynchronous mode needs every row's policy_version ({len(rows)} rows)")
    else:  # per token: a partial rollout's row holds tokens of several versions (Rollout.token_versions)
        same_version = (rows.versions == proximal.version) & batch.mask.bool()
    if plan.proximal == "update":
        return None, same_version
    return proximal_logprobs(proximal, batch, plan.ppo.minibatches, settings.micro_batch_tokens,
                             collective), same_version


def _shaped_rewards(rows: RolloutTensors, last_values: torch.Tensor, kl: KLTerm,
                    rule: TruncationRule) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(rewards [B, T], bootstrap [B], task_scores [B])``: the shaped reward (docs/algorithm.md) of
    each row after the length rules (the overlong ramp, then the truncation rule) with -beta KL_t
    (``kl``) on every action token; an episode's turn rewards on each turn's last action token (earned, so
    kept whatever the truncation rule does with the final score). ``task_scores`` is what the row
    earned without the KL: the score after the length rules plus its turn rewards (the group
    estimators' r_i)."""
    mask = rows.batch.mask
    # The overlong ramp counts the policy's own tokens (an episode's actions): a long tool output is
    # not the policy's length (single-turn rows: every response token is an action).
    lengths = mask.sum(-1)
    scores = rows.scores + overlong_penalty(lengths, rule.max_new_tokens, rule.overlong_buffer, rule.overlong_penalty)
    # A cut row: either V(S_T) stands in for its score (bootstrap) or the cut is final (terminal).
    returned, bootstrap = ppo.truncation_targets(scores, last_values, rows.truncated, rule.mode,
                                                 rule.missing_eos_penalty)
    rewards = kl.shape(returned, mask)
    task_scores = returned.to(rewards.dtype)
    if rows.turn_rewards is not None and rows.turn_ends is not None:  # set together (RolloutTensors.of)
        rewards = action_tokens.add_turn_rewards(rewards, rows.turn_ends, rows.turn_rewards)
        task_scores = task_scores + action_tokens.add_turn_rewards(torch.zeros_like(rewards), rows.turn_ends,
                                                         rows.turn_rewards).sum(dim=-1)
    return rewards, bootstrap, task_scores
